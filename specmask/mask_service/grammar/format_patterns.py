"""JSON Schema ``format`` values as regular expressions either engine enforces exactly.

The end check (``specmask/orchestrator/output_check.py``: ``jsonschema`` with
``format-nongpl``) is the truth for a format. Each regex below accepts a subset
of what that checker accepts, equal to it except where noted; where the checker
is more lenient than the standard, the regex follows the standard (stricter,
never looser). The standards and the checkers they are compared with:

* ``date``: RFC 3339 ``full-date``; checker ``date.fromisoformat`` behind
  ``\\d{4}-\\d{2}-\\d{2}``. Days per month, February 29 only in Gregorian leap
  years (divisible by 4, centuries only when divisible by 400), years
  0001-9999 (Python has no year 0). Equal.
* ``date-time``: RFC 3339 ``date-time``; checker ``rfc3339-validator`` on the
  upper-cased text. ``T``/``t`` and ``Z``/``z`` (RFC 3339 5.6 allows the lower
  case, and the checker upper-cases), any number of fraction digits, an offset
  required (``Z`` or ``+hh:mm``/``-hh:mm``, hours 00-23). No leap second: the
  checker refuses every ``:60`` ("leap seconds are not supported"), so the
  regex does too (RFC 3339 allows 23:59:60 UTC on the days one was inserted;
  matching the checker is the side that never returns a refused output). Equal
  except a trailing line feed, which Python's ``$`` lets the checker pass and
  the regex never emits.
* ``time``: RFC 3339 ``full-time``; the checker prefixes ``1970-01-01T`` and
  checks a date-time, so the same rules. Equal except the trailing line feed.
* ``duration``: RFC 3339 Appendix A ``duration`` (ISO 8601 designators in
  order, each with at least one digit, ``W`` alone, ``T`` followed by a time
  part). The checker (``isoduration``) is more lenient (signs, fractions,
  skipped designators such as ``P1Y1D``); the regex is the ABNF's language.
* ``uuid``: RFC 4122 string form, ``8-4-4-4-12`` hex digits, either case. The
  checker (``uuid.UUID`` plus the hyphen positions) also takes underscores
  between digits and extra hyphens; the regex is the RFC's form.
* ``ipv4``: RFC 2673 dotted quad, octets 0-255 without leading zeros; checker
  ``ipaddress.IPv4Address``. Equal.
* ``ipv6``: RFC 4291 2.2 text forms (RFC 3986 ``IPv6address``: ``::``
  standing for one or more zero groups, a dotted-quad tail), no zone index;
  checker ``ipaddress.IPv6Address`` without ``scope_id``. Equal.
* ``hostname``: RFC 1123 labels (letters, digits, hyphens, 1-63 characters, no
  hyphen first or last); checker ``fqdn`` (at most 253 characters without a
  final dot). Stricter than the checker in three ways: no final dot and no
  label with ``--`` in its third and fourth characters (the test suite's
  reading: ``example.`` and ``xn--X`` are invalid hostnames, which ``fqdn``
  passes; a valid A-label needs punycode decoding, which a regex cannot do),
  and, alone, a length bound by labels, since a regex cannot count the whole
  name without listing every shape: up to 4 labels of up to 63 characters
  (the last up to 61). ``LENGTH_BOUNDED`` gives the exact form instead, any
  number of labels beside ``maxLength: 253``, for an engine that intersects
  a pattern with lengths.
* ``email``: the RFC 5321 ``Dot-string`` local part (atext atoms joined by
  dots, no quoted string) and a domain of hostname labels. The checker only
  asks for an ``@``; the regex is the common, unquoted subset.

Every regex is ASCII, JSON-safe (no ``"``, ``\\`` or control characters), and
anchored. ``pattern_for`` also folds ``minLength``/``maxLength`` into the
regex where that is exact (a fixed-length format, or the fraction digits of a
time), so xgrammar, which cannot combine a pattern with lengths, enforces both.
``tests/mask_service/test_format_patterns.py`` checks each regex against its
checker with random strings from the regex and near-misses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_DIGIT = "[0-9]"
_HEX = "[0-9A-Fa-f]"
# RFC 3339 full-date with the days of each month and Gregorian leap years; no year 0000.
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    rf"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_HMS = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
_ZULU = "[Zz]"
_NUM_OFFSET = r"[+-](?:[01][0-9]|2[0-3]):[0-5][0-9]"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H16 = f"{_HEX}{{1,4}}"
_LS32 = f"(?:{_H16}:{_H16}|{IPV4})"
IPV6 = (
    "(?:"
    + "|".join(
        (
            f"(?:{_H16}:){{6}}{_LS32}",
            f"::(?:{_H16}:){{5}}{_LS32}",
            f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
            f"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
            f"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
            f"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
            f"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
            f"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
            f"(?:(?:{_H16}:){{0,6}}{_H16})?::",
        )
    )
    + ")"
)
UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"


def _label(longest: int) -> str:
    """An RFC 1123 label of 1..longest characters, no hyphen first or last, and no ``--`` in
    the third and fourth characters (RFC 5891 4.2.3.1: reserved for A-labels such as
    ``xn--...``, whose punycode a regex cannot check)."""
    x, y = "[A-Za-z0-9]", "[-A-Za-z0-9]"
    return f"{x}(?:{x}|{y}{x}|{y}{y}{x}|{y}(?:{x}{y}|-{x}){y}{{0,{longest - 5}}}{x})?"


# Any number of labels: exact beside ``maxLength: 253`` (an engine that intersects a pattern
# with lengths: llguidance). Alone, a bounded subset: up to 4 labels, the last of up to 61,
# within 253 characters by construction (xgrammar; each counted label costs it compile time).
HOSTNAME_LABELS = rf"(?:{_label(63)}\.)*{_label(63)}"
HOSTNAME_MAX_LENGTH = 253
HOSTNAME = rf"(?:{_label(63)}\.){{0,3}}{_label(61)}"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_DOMAIN_LABEL = "[A-Za-z0-9](?:[-A-Za-z0-9]*[A-Za-z0-9])?"  # the checker bounds no length
EMAIL = rf"{_ATEXT}+(?:\.{_ATEXT}+)*@(?:{_DOMAIN_LABEL}\.)*{_DOMAIN_LABEL}"
# RFC 3339 Appendix A.
_D = f"{_DIGIT}+"
_DUR_SECOND = f"{_D}S"
_DUR_MINUTE = f"{_D}M(?:{_DUR_SECOND})?"
_DUR_HOUR = f"{_D}H(?:{_DUR_MINUTE})?"
_DUR_TIME = f"T(?:{_DUR_HOUR}|{_DUR_MINUTE}|{_DUR_SECOND})"
_DUR_DAY = f"{_D}D"
_DUR_MONTH = f"{_D}M(?:{_DUR_DAY})?"
_DUR_YEAR = f"{_D}Y(?:{_DUR_MONTH})?"
DURATION = f"P(?:(?:{_DUR_DAY}|{_DUR_MONTH}|{_DUR_YEAR})(?:{_DUR_TIME})?|{_DUR_TIME}|{_D}W)"


@dataclass(frozen=True)
class _Timed:
    """A date-time or time: a fixed-length head, optional fraction digits, then an offset.

    Its length is ``len(head) + (1 + k if k fraction digits else 0) + (1 or 6)``, so a
    length window is exactly a choice of fraction-digit counts per offset form."""

    head: str  # regex of the fixed-length part
    head_length: int

    def regex(self, min_length: int = 0, max_length: float = math.inf) -> str | None:
        """The regex of this format's strings with length in the window, or None if none fit."""
        branches = []
        for offset, offset_length in ((_ZULU, 1), (_NUM_OFFSET, 6)):
            fixed = self.head_length + offset_length
            # k fraction digits add k + 1 characters (the dot); k = 0 adds nothing.
            lo = max(1, min_length - fixed - 1)
            hi = max_length - fixed - 1
            fraction = None
            if hi >= lo:
                fraction = rf"\.[0-9]{{{lo},}}" if hi == math.inf else rf"\.[0-9]{{{lo},{int(hi)}}}"
            bare = min_length <= fixed <= max_length
            if fraction and bare:
                branches.append(f"{self.head}(?:{fraction})?{offset}")
            elif fraction:
                branches.append(f"{self.head}{fraction}{offset}")
            elif bare:
                branches.append(f"{self.head}{offset}")
        if not branches:
            return None
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


_DATE_TIME = _Timed(f"{DATE}[Tt]{_HMS}", 19)
_TIME = _Timed(_HMS, 8)

# The unbounded regex of each format (anchored where used: ``pattern_for``).
FORMAT_REGEXES: dict[str, str] = {
    "date": DATE,
    "date-time": _DATE_TIME.regex() or "",
    "time": _TIME.regex() or "",
    "duration": DURATION,
    "uuid": UUID,
    "ipv4": IPV4,
    "ipv6": IPV6,
    "hostname": HOSTNAME,
    "email": EMAIL,
}
# Formats whose exact form is a regex beside a maximum length (format -> (regex, max length)).
LENGTH_BOUNDED: dict[str, tuple[str, int]] = {"hostname": (HOSTNAME_LABELS, HOSTNAME_MAX_LENGTH)}
# Shortest and longest string of each format's regex (inf: unbounded).
_LENGTHS: dict[str, tuple[int, float]] = {
    "date": (10, 10),
    "uuid": (36, 36),
    "ipv4": (7, 15),
    "ipv6": (2, 45),
    "hostname": (1, 253),
    "duration": (3, math.inf),
    "email": (3, math.inf),
}


def pattern_for(fmt: str, min_length: int = 0, max_length: float = math.inf) -> str | None:
    """An anchored regex of the strings of ``fmt`` whose length (in code points) is within
    ``[min_length, max_length]``, or None where this is not expressible exactly (a window
    cutting through a format of variable length other than date-time and time, or one
    no string of the format fits: the caller keeps the keywords and the engine decides)."""
    if fmt in ("date-time", "time"):
        body = (_DATE_TIME if fmt == "date-time" else _TIME).regex(min_length, max_length)
        return None if body is None else f"^{body}$"
    if fmt not in FORMAT_REGEXES:
        return None
    shortest, longest = _LENGTHS[fmt]
    if min_length <= shortest and longest <= max_length:
        return f"^{FORMAT_REGEXES[fmt]}$"
    return None
