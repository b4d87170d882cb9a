"""bench.e2e's case selection: subsets by file-name prefix, N per subset, chat prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.e2e import CHAT_USER_TURN, load_cases, subset_of

MASKBENCH = Path(__file__).resolve().parents[1] / "data" / "maskbench"


@pytest.mark.parametrize(
    ("stem", "subset"),
    [
        ("Github_easy---o30341", "Github_easy"),
        ("Glaiveai2K---book_flight_d310c236", "Glaiveai2K"),
        ("BFCL_simple_118", "BFCL_simple"),
        ("BFCL_parallel_multiple_3", "BFCL_parallel_multiple"),
        ("JME_7", "JME"),
        ("plain", "plain"),
    ],
)
def test_subset_of(stem: str, subset: str) -> None:
    assert subset_of(stem) == subset


def test_subsets_take_n_each_with_chat_prompts() -> None:
    cases = load_cases(str(MASKBENCH), 2, chat=True, subsets=("Github_easy", "BFCL_simple"))
    assert [c.subset for c in cases] == ["Github_easy"] * 2 + ["BFCL_simple"] * 2
    assert len({c.name for c in cases}) == 4  # spread over the files, no repeats
    assert all(c.prompt == [{"role": "user", "content": CHAT_USER_TURN}] for c in cases)
    assert all(isinstance(c.schema, dict) for c in cases)


def test_unknown_subset_is_an_error() -> None:
    with pytest.raises(SystemExit, match="no schemas of subset"):
        load_cases(str(MASKBENCH), 1, subsets=("Nope",))


def test_n_below_the_file_count_spreads_over_the_sorted_files() -> None:
    files = sorted(p.stem for p in MASKBENCH.glob("*.json"))
    cases = load_cases(str(MASKBENCH), 8)
    assert [c.name for c in cases] == [files[(i * len(files)) // 8] for i in range(8)]
    assert len({c.subset for c in cases}) > 2  # not the first files' subset alone
    cycled = load_cases(str(MASKBENCH), len(files) + 3)
    assert [c.name for c in cycled] == files + files[:3]
