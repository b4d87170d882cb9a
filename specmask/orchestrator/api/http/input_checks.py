"""Checks on a request body before its fields are read (docs/api-errors.md, "4xx rules").

* The body must be declared JSON: ``Content-Type: application/json`` (or a ``+json``
  type), or no Content-Type at all; anything else (``text/plain``, a form) is a 415.
* No string anywhere in the body may hold a lone UTF-16 surrogate. JSON may spell one
  (``"\\ud800"``) and Python's parser keeps it, but it is not text: it cannot be encoded
  as UTF-8 for the tokenizer, the mask service or the grammar engines, and used to
  surface as a 500 from whichever touched it first. Refused here, once, with its path.
* Known fields are strictly typed (``routes.parse_body`` validates with ``strict=True``):
  no string or bool where a number is expected, no string where a bool is (an integer
  is still a valid float).
"""

from __future__ import annotations

from aiohttp import web

from specmask.orchestrator.api.http.errors import UNSUPPORTED_MEDIA_TYPE, ApiError

JsonValue = dict[str, "JsonValue"] | list["JsonValue"] | str | int | float | bool | None


def check_content_type(request: web.Request) -> None:
    """415 unless the body is declared JSON (or not declared at all)."""
    if "Content-Type" not in request.headers:
        return
    kind = request.content_type
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return
    raise ApiError(
        UNSUPPORTED_MEDIA_TYPE,
        f"request body of type {kind!r} is not supported: send JSON with Content-Type: application/json",
    )


def _has_lone_surrogate(text: str) -> bool:
    # Surrogates are U+D800..U+DFFF; a proper pair in a JSON escape is decoded to one code point.
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def find_lone_surrogate(value: JsonValue, path: str = "") -> str | None:
    """The path (``messages.0.content``) of the first string or key holding a lone surrogate, or None."""
    stack: list[tuple[JsonValue, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if _has_lone_surrogate(node):
                return where or "body"
        elif isinstance(node, dict):
            for key, sub in node.items():
                child = f"{where}.{key}" if where else key
                if _has_lone_surrogate(key):
                    return child
                stack.append((sub, child))
        elif isinstance(node, list):
            stack.extend((sub, f"{where}.{i}" if where else str(i)) for i, sub in enumerate(node))
    return None


def refuse_lone_surrogates(data: JsonValue) -> None:
    """400 naming the field when any string in ``data`` holds a lone surrogate."""
    found = find_lone_surrogate(data)
    if found is not None:
        where = found.encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate
        raise ApiError.invalid(
            f"{where}: the string holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
            "which is not valid Unicode text",
            param=where,
        )
