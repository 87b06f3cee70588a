"""How `kvtopo drill --engine vllm-server` judges an answer against transformers' reference."""

from __future__ import annotations

from kvtopo.drill.vllmserver import same_answer

REF_IDS = [119, 41, 111, 132]


def test_the_same_tokens_with_a_held_back_trailing_character_are_the_same_answer() -> None:
    # seen in a run: vLLM held back the incomplete last character transformers showed as U+FFFD
    assert same_answer("\ufffdF=", REF_IDS, "\ufffdF=\ufffd", REF_IDS)


def test_other_tokens_are_another_answer_even_with_the_same_text() -> None:
    assert not same_answer("abc", [1, 2, 3], "abc", REF_IDS)


def test_other_text_is_another_answer() -> None:
    assert not same_answer("abd", REF_IDS, "abc", REF_IDS)
    assert not same_answer("ab", None, "abc", REF_IDS)  # no token ids: the text alone decides
