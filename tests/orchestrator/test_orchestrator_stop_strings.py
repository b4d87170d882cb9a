"""Stop strings over text deltas: earliest match wins, possible prefixes are held back."""

from __future__ import annotations

import pytest

from orchestrator.stop_strings import StopStringMatcher


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool, str]:
    m = StopStringMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, m.matched or ""


def test_no_stops_passes_through() -> None:
    assert _run([], ["ab", "cd"]) == ("abcd", False, "")


def test_stop_inside_one_delta() -> None:
    assert _run(["END"], ["abcENDdef"]) == ("abc", True, "END")


def test_stop_across_deltas_is_never_emitted() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.feed("hello <") == ("hello ", False)  # "<" may start the stop string
    assert m.feed("/") == ("", False)
    assert m.feed("s>tail") == ("", True)
    assert m.matched == "</s>"
    assert m.feed("more") == ("", True)


def test_held_prefix_released_when_it_does_not_match() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.feed("a <") == ("a ", False)
    assert m.feed("b") == ("<b", False)


def test_earliest_occurrence_wins() -> None:
    assert _run(["cd", "b"], ["abcd"]) == ("a", True, "b")
    assert _run(["bcd", "cd"], ["abcde"]) == ("a", True, "bcd")


def test_flush_releases_held_text_at_end() -> None:
    assert _run(["xyz"], ["abc", "xy"]) == ("abcxy", False, "")


@pytest.mark.parametrize("split", range(1, 9))
def test_every_split_point(split: int) -> None:
    text = "ab<stop>cd"
    assert _run(["<stop>"], [text[:split], text[split:]]) == ("ab", True, "<stop>")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])
