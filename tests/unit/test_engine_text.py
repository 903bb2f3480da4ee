"""The token-advance rule every engine shares: incremental text equals the tokenizer's full decode,
stop sequences cut where they end, and nothing half-decoded or possibly-stop is streamed."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from clawr1.core.types import Generation
from clawr1.engine.text import Advance

TEXTS = ["Plain words, then numbers 12345 and punctuation!?", "Ünïcödé café — naïve “quotes” and emoji 🙂🚀 end",
         "中文的句子，还有日本語のテキスト。", "  leading spaces\n\nand\tindented\n    code()  ", "a" * 50]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(tokenizer, ids, stops=(), max_tokens=10_000, eos=frozenset()):
    advance, gen, streamed, reason = Advance(tokenizer, eos, stops, max_tokens), Generation(prompt_ids=[1]), [], None
    for token in ids:
        delta, reason = advance(gen, token, -0.5)
        streamed.append(delta)
        if reason:
            break
    return gen, "".join(streamed), reason, streamed


def test_incremental_text_is_the_full_decode_at_every_length(tokenizer):
    rng = random.Random(0)
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(5)]  # arbitrary ids
    for ids in sequences:
        advance, gen = Advance(tokenizer, frozenset(), (), 10_000), Generation(prompt_ids=[1])
        for n, token in enumerate(ids, 1):
            advance(gen, token, 0.0)
            full = tokenizer.decode(ids[:n], skip_special_tokens=True)
            # Only a trailing half character may be missing while the reply goes on.
            assert full.startswith(gen.text) and full[len(gen.text):].strip("\ufffd") == "", (n, gen.text, full)
        advance.finish(gen)
        assert gen.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_stream_adds_up_to_the_content_and_never_shows_half_a_character(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        gen, streamed, reason, deltas = run(tokenizer, ids, max_tokens=len(ids))
        assert reason == "length" and streamed == gen.content == text
        assert not any("\ufffd" in d for d in deltas)


def test_a_stop_sequence_across_tokens_cuts_the_content_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of reply, more text", add_special_tokens=False)
    gen, streamed, reason, _ = run(tokenizer, ids, stops=("END",))
    assert reason == "stop" and gen.stop_match == "END"
    assert streamed == gen.content == "The answer is 42. "
    assert len(gen.token_ids) < len(ids)  # it stopped at the token that completed the stop


def test_end_of_sequence_stops_without_text(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello there", add_special_tokens=False) + [eos, *tokenizer.encode(" more")]
    gen, streamed, reason, _ = run(tokenizer, ids, eos=frozenset({eos}))
    assert reason == "stop" and streamed == gen.content == "Hello there" and gen.token_ids[-1] == eos


def test_a_token_that_completes_two_stops_cuts_at_the_one_that_begins_first(tokenizer):
    """The content never holds a stop: with stops ("n", "u") a token " unstructured" completes
    both; the reply is cut before "u", not before "n" (which left "u" in it)."""
    ids = tokenizer.encode(" unstructured data", add_special_tokens=False)
    for stops in (("n", "u"), ("u", "n")):
        gen, streamed, reason, _ = run(tokenizer, ids, stops=stops)
        assert reason == "stop" and gen.stop_match == "u" and streamed == gen.content == " ", stops


def test_a_stop_in_text_held_back_for_half_a_character_is_cut_when_the_reply_ends(tokenizer):
    """A stop that ends inside a token holding half a UTF-8 character is not in the streamed-so-far
    text yet; if the reply then ends (out of tokens), the full decode finds it: cut, reason stop."""
    ids = tokenizer.encode("Sure. User: 日本", add_special_tokens=False)
    cut = next((k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith("\ufffd")
                and "User: " in tokenizer.decode(ids[:k])), None)
    if cut is None:
        pytest.skip("this tokenizer splits no character after the stop")
    gen, streamed, reason, _ = run(tokenizer, ids[:cut], stops=("User: ",), max_tokens=cut)
    assert reason == "stop" and gen.stop_match == "User: " and streamed == gen.content == "Sure. "


def test_a_stop_sequence_is_a_few_characters_not_a_document():
    """Text that could begin a stop is held back and re-checked every token: stops are bounded."""
    from clawr1.core.types import MAX_STOP_CHARS, InvalidRequestError, SamplingParams

    SamplingParams(stop=("x" * MAX_STOP_CHARS,))
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),))
