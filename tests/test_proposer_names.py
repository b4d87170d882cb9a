"""A proposer is named only through ``ProposerKind``: no module of the package or the benches
spells a proposer's name as a string of its own (specmask.common.proposer_kind)."""

from __future__ import annotations

import ast
from pathlib import Path

from specmask.common.proposer_kind import ProposerKind

ROOT = Path(__file__).resolve().parents[1]
ENUM_MODULE = ROOT / "specmask" / "common" / "proposer_kind.py"
GENERATED = ROOT / "specmask" / "proto" / "gen"


def _literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant in ``path`` that is a proposer's name, whole or as an
    f-string's literal part."""
    names = {kind.value for kind in ProposerKind}
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip(" '\"") in names
    ]


def test_no_proposer_name_is_spelled_outside_its_enum() -> None:
    found = {
        str(path.relative_to(ROOT)): hits
        for root in ("specmask", "bench")
        for path in sorted((ROOT / root).rglob("*.py"))
        if path != ENUM_MODULE and GENERATED not in path.parents
        for hits in [_literals(path)]
        if hits
    }
    assert not found, f"proposer names as string literals (use ProposerKind): {found}"


def test_the_check_sees_a_literal(tmp_path: Path) -> None:
    """Not vacuous: a module that spells one is caught, in a tuple, a comparison or an f-string."""
    module = tmp_path / "m.py"
    module.write_text('A = ("draft_model",)\nB = x == "ngram"\nC = f"{y}grammar_forced"\nD = "ngram_min"\n')
    assert [line for line, _ in _literals(module)] == [1, 2, 3]


def test_members_are_their_wire_strings() -> None:
    """Requests, config and the worker registry keep the strings they had."""
    assert [str(k) for k in ProposerKind] == ["grammar_forced", "ngram", "draft_model"]
    assert ProposerKind("ngram") is ProposerKind.NGRAM and "draft_model" in (ProposerKind.DRAFT_MODEL,)
