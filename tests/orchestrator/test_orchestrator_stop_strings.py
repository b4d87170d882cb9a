"""Stop strings over text deltas: earliest match wins, possible prefixes are held back."""

from __future__ import annotations

import itertools

import pytest

from specmask.orchestrator.stop_strings import StopStringMatcher


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


# ---- beside a grammar: a stop match counts only where the grammar may end ----------------


def _run_grammar(stops: list[str], deltas: list[str], sentences: set[str], **kw: int) -> tuple[str, bool, str]:
    m = StopStringMatcher(stops, lambda text: text in sentences, **kw)
    out, stopped = [], False
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, m.text_before_match


def test_stop_inside_a_sentence_is_ignored() -> None:
    # guided_choice alpha|beta with stop "l": "a" is no sentence, so generation goes on.
    assert _run_grammar(["l", "e"], ["a", "lp", "ha"], {"alpha", "beta"}) == ("alpha", False, "alpha")


def test_stop_where_the_grammar_may_end_stops() -> None:
    assert _run_grammar(["c"], ["a", "bc"], {"ab", "abc"}) == ("ab", True, "ab")


def test_refused_occurrence_is_released_and_later_one_counts() -> None:
    m = StopStringMatcher(["}"], lambda text: text == '{"a":{}}')
    assert m.feed('{"a":{') == ('{"a":{', False)
    assert m.feed("}") == ("}", False)  # '{"a":{' is not a document: the "}" is text
    assert m.feed("}") == ("}", False)  # '{"a":{}' is not one either
    assert m.feed("}") == ("", True)  # the text before this "}" is a whole document
    assert m.text_before_match == '{"a":{}}'


def test_held_prefix_of_a_refused_position_is_released() -> None:
    m = StopStringMatcher(["ab"], lambda text: False)
    assert m.feed("xa") == ("x", False)  # "a" may begin "ab"
    assert m.feed("b") == ("ab", False)  # "x" is no sentence: "ab" is output, not a stop
    assert m.matched is None


def test_checks_are_bounded_and_fail_closed() -> None:
    calls: list[str] = []

    def may_end(text: str) -> bool:
        calls.append(text)
        return True

    m = StopStringMatcher(["x"], may_end, max_end_checks=0)
    assert m.feed("axbx") == ("axbx", False)  # past the cap an occurrence never ends the output
    assert calls == []

    def broken(text: str) -> bool:
        raise RuntimeError("checker down")

    assert StopStringMatcher(["x"], broken).feed("ax") == ("ax", False)


def test_without_a_grammar_every_occurrence_counts() -> None:
    assert _run(["l", "e"], ["alpha"]) == ("a", True, "l")


def test_text_before_the_floor_never_stops_but_an_occurrence_ending_after_it_does() -> None:
    """vLLM's min_tokens: an occurrence counts only if it ends in text fed with may_stop."""
    m = StopStringMatcher(["ab"])
    assert m.feed("xab", may_stop=False) == ("xab", False)  # ends within the floor: not a stop
    assert m.feed("a", may_stop=False) == ("", False)  # may begin an "ab" that ends after the floor
    assert m.feed("b") == ("", True) and m.text_before_match == "xab"
    late = StopStringMatcher(["ab"])
    assert late.feed("ab", may_stop=False) == ("ab", False)
    assert late.feed("cab") == ("c", True) and late.text_before_match == "abc"


@pytest.mark.parametrize("floor", range(8))
def test_floor_at_every_position_of_every_split(floor: int) -> None:
    """Against the rule itself: the first occurrence ending past ``floor`` characters, whatever
    the deltas (each split of the text into three, the floor's own split among them)."""
    text, stops = "abXYabXYab", ["XY", "bX", "ab"]
    hits = [(i, s) for i in range(len(text)) for s in stops if text.startswith(s, i) and i + len(s) > floor]
    expected = min(hits, key=lambda h: (h[0], stops.index(h[1])))
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            cuts = sorted({0, a, b, floor, len(text)})
            m = StopStringMatcher(stops)
            out, stopped = [], False
            for lo, hi in itertools.pairwise(cuts):
                piece, stopped = m.feed(text[lo:hi], may_stop=hi > floor)
                out.append(piece)
                if stopped:
                    break
            assert stopped and m.matched == expected[1], (a, b)
            assert "".join(out) == text[: expected[0]] == m.text_before_match, (a, b)
