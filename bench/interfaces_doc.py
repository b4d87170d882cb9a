"""Render the generated listings of docs/INTERFACES.md from the source.

    python -m bench.interfaces_doc            # rewrite the page's generated listings
    python -m bench.interfaces_doc --check    # exit 1 when a listing differs from its source

The page keeps its prose (the contracts between packages that only words can say) by hand;
each dataclass or enum it lists is a generated block, copied from the class's source, its
comments included:

    <!-- generated: specmask/gpu_worker/config.py WorkerConfig -->
    ```python
    ...
    ```
    <!-- end generated -->

A field added, renamed or re-documented in the code reaches the page by running this, and
tests/test_interfaces_doc.py fails until it has. Read with ``ast``: nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "INTERFACES.md"

_BLOCK = re.compile(
    r"(?P<open><!-- generated: (?P<path>\S+) (?P<cls>\w+) -->\n)(?P<body>.*?)(?P<close><!-- end generated -->)",
    re.S,
)


class ListingError(ValueError):
    """A marker naming a file or class that does not exist."""


def class_listing(path: Path, name: str) -> str:
    """The class's decorators, header, docstring and fields (comments kept), as written; its
    public methods and properties named in a last comment line."""
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ListingError(f"{path}: {exc.strerror or exc}") from None
    lines = source.splitlines()
    found = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name]
    if len(found) != 1:
        raise ListingError(f"{path} has {len(found)} top-level classes named {name}, not one")
    cls = found[0]
    start = min([cls.lineno, *(d.lineno for d in cls.decorator_list)])
    out = lines[start - 1 : cls.body[0].lineno - 1]  # decorators and the header (up to the first statement)
    previous_end = cls.body[0].lineno - 1
    methods: list[str] = []
    for node in cls.body:
        assert node.end_lineno is not None  # set by ast.parse
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
                methods.append(node.name if is_property else f"{node.name}()")
        else:
            # The comment lines just above a field belong to it, even after a method.
            first = node.lineno
            while first - 1 > previous_end and lines[first - 2].strip().startswith("#"):
                first -= 1
            out.extend(lines[first - 1 : node.end_lineno])
            if (
                node is cls.body[0]
                and _is_docstring(node)
                and node.end_lineno < len(lines)
                and not lines[node.end_lineno].strip()
            ):
                out.append("")  # a blank line after the docstring, as written (ruff format wants it)
        previous_end = node.end_lineno
    if methods:
        out.append(f"    # also: {', '.join(methods)}")
    return "\n".join(out) + "\n"


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def render(page: str) -> str:
    """``page`` with every generated block rendered from its source."""

    def block(match: re.Match[str]) -> str:
        listing = class_listing(REPO_ROOT / match["path"], match["cls"])
        return f"{match['open']}```python\n{listing}```\n{match['close']}"

    return _BLOCK.sub(block, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from its rendering")
    args = parser.parse_args(argv)
    page = PAGE.read_text(encoding="utf-8")
    rendered = render(page)
    if args.check:
        if rendered != page:
            print(f"{PAGE.relative_to(REPO_ROOT)} is stale: run python -m bench.interfaces_doc", file=sys.stderr)
            return 1
        return 0
    if rendered != page:
        PAGE.write_text(rendered, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
