"""Grammar specifications as clients name them (no engine imports).

A ``GrammarSpec`` is the value a generation request carries; the mask service
compiles it against a tokenizer. It lives apart from any engine so the worker
and orchestrator can build specs without importing xgrammar.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass

from specmask.common.reasoning_section import ReasoningSection


class GrammarKind(enum.Enum):
    """The closed set of grammar languages the service understands."""

    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF = "ebnf"  # GBNF / xgrammar EBNF with a `root` rule
    LARK = "lark"  # Lark syntax with a `start` rule
    ANY_JSON = "any_json"


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain generation to.

    ``separators`` and ``any_whitespace`` only matter for JSON kinds; they are
    part of the cache key because they change the compiled grammar.
    """

    kind: GrammarKind
    text: str = ""  # schema JSON / regex / grammar text; "" for ANY_JSON
    any_whitespace: bool = False  # JSON: allow arbitrary whitespace between tokens
    separators: tuple[str, str] | None = None  # JSON: (item sep, key sep), e.g. (",", ":")
    strict: bool = True  # JSON schema: no additional properties unless the schema allows them
    backend: str = ""  # grammar engine to use ("xgrammar", "llguidance"); "" = the service picks (backends.py)
    # JSON schema, opt-in checked mode: where no engine enforces the schema exactly only
    # because of keywords ``schema_relax`` can relax, compile that relaxation (a superset) instead of
    # refusing; the caller must then check every output against this spec's schema (orchestrator does).
    checked: bool = False
    # A reasoning model's free section before the grammar (reasoning_section.py): the output is
    # ``section`` then this grammar, compiled as one grammar; None = the grammar from the first token.
    reasoning: ReasoningSection | None = None

    def without_budget(self) -> GrammarSpec:
        """The grammar a section's token budget leaves unchanged: the budget is a session's
        (mask_service/grammar/section_budget.py), so every budget shares one compiled grammar."""
        if self.reasoning is None or not self.reasoning.max_tokens:
            return self
        return dataclasses.replace(self, reasoning=dataclasses.replace(self.reasoning, max_tokens=0))

    def without_reasoning(self) -> GrammarSpec:
        """The caller's grammar alone: what the content after the section must match."""
        return dataclasses.replace(self, reasoning=None) if self.reasoning is not None else self

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise TypeError(f"kind must be a GrammarKind, got {self.kind!r}")
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningSection):
            raise TypeError(f"reasoning must be a ReasoningSection, got {self.reasoning!r}")
        if self.separators is not None and len(self.separators) != 2:
            raise ValueError("separators must be (item_separator, key_separator)")

    def effective_separators(self) -> tuple[str, str]:
        """The separators a JSON grammar uses: compact (",", ":") unless overridden.

        Compact is the default because it matches ``json.dumps(..., separators=(",", ":"))``
        and gives the fewest tokens per document.
        """
        return self.separators if self.separators is not None else (",", ":")

    def cache_key(self) -> str:
        """A stable digest of everything that changes the compiled grammar.

        Computed once per spec: the orchestrator asks for it several times per request
        (grammar check and its single flight, router placement, end check), and hashing a
        large schema each time would cost more than the rest of the lookup. ``dataclasses.replace``
        builds a new spec, so a changed field never keeps an old digest."""
        key = self.__dict__.get("_cache_key")
        if key is None:
            key = self._digest()
            object.__setattr__(self, "_cache_key", key)  # frozen: fields only; this is a memo
        return key

    def _digest(self) -> str:
        """sha256 over the other fields as compact JSON, a newline, then the text as is. JSON
        never holds a raw newline, so the first one ends the header. The text is not passed
        through json.dumps: escaping a large schema costs several times the hash itself, paid in
        the orchestrator and again in the replica for every request that sends the schema."""
        is_json = self.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON)
        header = json.dumps(
            [
                self.kind.value,
                self.any_whitespace if is_json else None,
                list(self.effective_separators()) if is_json else None,
                self.strict if self.kind is GrammarKind.JSON_SCHEMA else None,
                *([self.backend] if self.backend else []),
                *([{"checked": True}] if self.checked else []),  # an object: never equal to a backend name
                *([{"reasoning": self.reasoning.key()}] if self.reasoning is not None else []),
            ],
            separators=(",", ":"),
        )
        digest = hashlib.sha256(header.encode())
        digest.update(b"\n")
        # surrogatepass: a lone surrogate (possible in text from an HTTP JSON body) gets bytes of
        # its own instead of an encoding error; no valid character encodes to those bytes.
        digest.update(self.text.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()
