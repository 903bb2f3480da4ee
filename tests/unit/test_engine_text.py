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
