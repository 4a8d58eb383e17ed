"""StopMatcher: stop strings found across pushes, held-back text released when it is not a stop."""

from __future__ import annotations

import pytest

from app.inference.engine.stop import StopMatcher


def _run(matcher: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    stopped = False
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        (["Hello ###", " more"], "Hello "),
        (["Hello #", "##", " more"], "Hello "),
        (["Hello #", "#", "#"], "Hello "),
        (["He", "llo", "#", "#", "# trailing"], "Hello"),
        (["<|im_", "end|>rest"], ""),
        (["a<|im_", "end|>"], "a"),
    ],
)
def test_stop_string_split_across_pushes(chunks: list[str], expected: str) -> None:
    text, stopped = _run(StopMatcher(["###", "<|im_end|>"]), chunks)
    assert stopped
    assert text == expected


def test_partial_match_is_held_then_released() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.push("a #") == ("a ", False)
    assert matcher.push("#") == ("", False)  # "##" could still become "###"
    assert matcher.push("x") == ("##x", False)  # it did not
    assert matcher.push("##") == ("", False)
    assert matcher.flush() == "##"  # end of reply: release what was held


def test_earliest_stop_string_wins() -> None:
    matcher = StopMatcher(["END", "STOP"])
    assert matcher.push("one STOP two END") == ("one ", True)
    assert matcher.matched == "STOP"
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("anything ###") == ("anything ###", False)
    assert matcher.flush() == ""


def test_text_without_stop_is_emitted_unchanged_across_many_pushes() -> None:
    text = "The #1 rule: use ## for headings, not ### wait"
    chunks = [text[i : i + 3] for i in range(0, len(text), 3)]
    out, stopped = _run(StopMatcher(["####"]), chunks)
    assert not stopped
    assert out == text


def test_reset_allows_reuse() -> None:
    matcher = StopMatcher(["X"])
    assert matcher.push("aXb") == ("a", True)
    matcher.reset()
    assert matcher.push("cd") == ("cd", False)
