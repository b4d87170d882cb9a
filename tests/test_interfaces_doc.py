"""docs/INTERFACES.md lists the seams' classes as they are.

The page's dataclass and enum listings are generated from the source (bench.interfaces_doc),
beside the contracts between packages that only prose can say: the page must equal its
rendering, so a field added, removed or re-documented in the code is on the page in the
same commit. A hand-written ``class Name`` listing outside them must still name only
fields, methods or members a class of that name in specmask/ has (read with ast: nothing
is imported).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from bench.interfaces_doc import ListingError, class_listing, render

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "INTERFACES.md"

_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_CLASS = re.compile(r"class (\w+)(?:\([^)]*\))?:\s*(.*)")
_FIELD = re.compile(r" {4}(\w+)\s*:")
_INLINE_FIELD = re.compile(r"(\w+)\s*:")


def listed_fields(page: str) -> list[tuple[str, str]]:
    """(class, field) for every field the page's python blocks list under a class."""
    out: list[tuple[str, str]] = []
    for block in _BLOCK.findall(page):
        cls: str | None = None
        for line in block.splitlines():
            header = _CLASS.match(line)
            if header:
                cls = header.group(1)
                inline = header.group(2).split("#", 1)[0]  # `class X: a: int; b: str = ""`
                out.extend((cls, name) for name in _INLINE_FIELD.findall(inline))
            elif cls is not None and (field := _FIELD.match(line)):
                out.append((cls, field.group(1)))
            elif line and not line.startswith((" ", "@")):
                cls = None
    return out


def class_members() -> dict[str, set[str]]:
    """Class name -> names defined in its body (fields, methods, enum members), over specmask/."""
    members: dict[str, set[str]] = {}
    for path in (REPO_ROOT / "specmask").rglob("*.py"):
        if "gen" in path.relative_to(REPO_ROOT / "specmask").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = members.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


def test_the_reader_finds_listings() -> None:
    page = """```python
@dataclass(frozen=True)
class Item:
    session_id: str
    gone: int = 0          # a comment: with a colon
class Short: a: int; b: str = ""
```"""
    assert listed_fields(page) == [("Item", "session_id"), ("Item", "gone"), ("Short", "a"), ("Short", "b")]


def test_every_listed_field_exists() -> None:
    listed = listed_fields(PAGE.read_text(encoding="utf-8"))
    assert len(listed) > 50, "the page's listings were not found: has its format changed?"
    members = class_members()
    unknown = sorted({(cls, name) for cls, name in listed if name not in members.get(cls, set())})
    assert not unknown, f"docs/INTERFACES.md lists fields no class in specmask/ has: {unknown}"


def test_the_page_is_its_rendering() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert page.count("<!-- generated: ") >= 12, "the page's generated listings were not found"
    assert render(page) == page, "docs/INTERFACES.md is stale: run python -m bench.interfaces_doc"


def test_a_listing_is_the_class_as_written(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import enum\n"
        "@dataclass(frozen=True)\n"
        "class Item:\n"
        '    """Doc."""\n'
        "    a: int  # [B] int32\n"
        "    def size(self) -> int:\n"
        "        return 1\n"
        "\n"
        "    # Why b: it says so.\n"
        "    b: str = 'é'\n"
        "    @property\n"
        "    def width(self) -> int:\n"
        "        return 2\n"
        "    def _private(self) -> None: ...\n",
        encoding="utf-8",
    )
    assert class_listing(source, "Item") == (
        "@dataclass(frozen=True)\n"
        "class Item:\n"
        '    """Doc."""\n'
        "    a: int  # [B] int32\n"
        "    # Why b: it says so.\n"
        "    b: str = 'é'\n"
        "    # also: size(), width\n"
    )
    with pytest.raises(ListingError, match="not one"):
        class_listing(source, "Missing")
    with pytest.raises(ListingError):
        class_listing(tmp_path / "gone.py", "Item")
