"""The local engine's prefix cache: a next turn prefills only what is new, with exact logprobs, and a
KV is never reused under other weights than the ones that computed it."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from clawr1.core.config import EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.engine import adapters as store
from clawr1.engine.local import LocalEngine
from clawr1.engine.prefix import PrefixCache
from tests.conftest import run
from tests.unit.test_adapters import make_adapter


def kv(length: int, fill: float = 0.0) -> DynamicCache:
    """A two-layer cache of `length` positions (keys and values of 1 x 2 heads x length x 4 floats: 128 bytes a token)."""
    return DynamicCache(ddp_cache_data=[(torch.full((1, 2, length, 4), fill), torch.full((1, 2, length, 4), fill))
                                        for _ in range(2)])


def test_lookup_finds_the_longest_prefix_of_the_same_owner_and_leaves_the_last_token():
    cache = PrefixCache(budget_bytes=1 << 20)
    cache.store("a", [1, 2, 3, 4], kv(4, 1.0))
    cache.store("a", [1, 2, 9], kv(3, 2.0))
    cache.store("b", [1, 2, 3, 4, 5, 6], kv(6, 3.0))
    length, found = cache.lookup("a", [1, 2, 3, 4, 5])
    assert length == 4 and found.layers[0].keys.shape[2] == 4 and float(found.layers[0].keys[0, 0, 0, 0]) == 1.0
    assert cache.lookup("a", [1, 2, 3, 4])[0] == 3  # the last token is always run: it gives the first logits
    assert cache.lookup("a", [1, 2, 9, 9])[0] == 3
    assert cache.lookup("a", [7, 2, 3])[0] == 0  # no common prefix
    assert cache.lookup("c", [1, 2, 3, 4, 5])[0] == 0  # another owner's KV is never used


def test_a_longer_prompt_supersedes_its_prefix_and_the_budget_evicts_the_least_recent():
    cache = PrefixCache(budget_bytes=128 * 10)  # ten tokens of kv()
    cache.store("a", [1, 2, 3], kv(3))
    cache.store("a", [1, 2, 3, 4, 5], kv(5))  # the same conversation, one turn on: one entry left
    assert len(cache) == 1 and cache.nbytes == 5 * 128
    cache.store("a", [1, 2, 3, 4], kv(4))  # the entry on file already extends it: not filed twice
    assert len(cache) == 1 and cache.nbytes == 5 * 128
    cache.store("a", [8, 8, 8, 8], kv(4))
    cache.lookup("a", [1, 2, 3, 4, 5, 6])  # used: now the most recent
    cache.store("a", [9, 9, 9], kv(3))  # 12 tokens > 10: the least recently used ([8, ...]) goes
    assert cache.lookup("a", [8, 8, 8, 8, 8])[0] == 0 and cache.lookup("a", [1, 2, 3, 4, 5, 6])[0] == 5
    assert cache.nbytes == 8 * 128
    cache.store("a", list(range(100, 111)), kv(11))  # bigger than the whole budget: not kept, nothing evicted
    assert len(cache) == 2
    cache.resize(128 * 6)  # a smaller budget: the least recently used ([9, 9, 9]) leaves
    assert cache.lookup("a", [9, 9, 9, 9])[0] == 0 and cache.nbytes == 5 * 128
    cache.drop("a")
    assert len(cache) == 0 and cache.nbytes == 0


def _turns(engine: LocalEngine) -> tuple[list[int], list[int]]:
    first = engine.render([{"role": "system", "content": "You are a careful assistant. " * 6},
                           {"role": "user", "content": "Name three rivers."}])
    second = first + engine.tokenizer("The Rhine, the Danube and the Elbe.<|im_end|>\n")["input_ids"] + \
        engine.render([{"role": "user", "content": "Which one is longest?"}])
    return first, second


@pytest.mark.parametrize("budget_mb", [64, 0])
def test_a_next_turn_prefills_only_what_is_new_with_exact_logprobs(tiny_model_dir, budget_mb):
    """The second turn's prompt extends the first's: with the cache it prefills only the new tokens
    (in 16-token chunks from an unaligned start), and its logprobs equal a one-pass `score`."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, prefill_chunk=16, prefix_cache_mb=budget_mb))
    first, second = _turns(engine)
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

    async def go():
        await engine.generate(first, sampling).final()
        before = dict(engine.stats)
        gen = await engine.generate(second, sampling).final()
        scored = await engine.score(second, gen.token_ids, temperature=0.8)
        await engine.close()
        return before, gen, scored

    before, gen, scored = run(go())
    cached = engine.stats["prefix_cached_tokens"] - before.get("prefix_cached_tokens", 0)
    prefilled = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    assert cached == (len(first) if budget_mb else 0)
    assert prefilled == len(second) - cached
    assert len(gen.token_ids) == len(scored) > 0
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_a_slot_reused_by_a_later_version_never_serves_the_earlier_versions_kv(tiny_model_dir, tmp_path):
    """v1 computes a prompt's KV in a slot; v2 retires it and v3 is copied into the same slot. A turn
    under v3 that extends the prompt must prefill it anew: its logprobs are v3's, not v1's KV's."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    versions = {v: make_adapter(tiny_model_dir, tmp_path, v, seed=v) for v in (1, 2, 3)}
    first, second = _turns(engine)
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

    async def go():
        await engine.load_adapter("policy", versions[1])
        slot_v1 = engine._adapters["policy"][0]
        await engine.generate(first, sampling, adapter="policy").final()
        await engine.load_adapter("policy", versions[2])
        await engine.load_adapter("policy", versions[3])
        assert engine._adapters["policy"][0] == slot_v1  # the test's premise: v3 was copied into v1's slot
        before = engine.stats["prefix_cached_tokens"]
        gen = await engine.generate(second, sampling, adapter="policy").final()
        scored = await engine.score(second, gen.token_ids, adapter="policy", temperature=0.8)
        await engine.close()
        return engine.stats["prefix_cached_tokens"] - before, gen, scored

    cached, gen, scored = run(go())
    assert gen.version == 3 and cached == 0
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_new_full_weights_drop_every_cached_prefix(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9)
    path = store.publish_weights(model, Path(tmp_path) / "weights", "policy", 1)
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1))
    first, second = _turns(engine)
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

    async def go():
        await engine.generate(first, sampling).final()
        assert len(engine._prefix) == 1
        assert await engine.load_weights(path) == 1
        before = engine.stats["prefix_cached_tokens"]
        gen = await engine.generate(second, sampling).final()
        scored = await engine.score(second, gen.token_ids, temperature=0.8)
        await engine.close()
        return engine.stats["prefix_cached_tokens"] - before, gen, scored

    cached, gen, scored = run(go())
    assert gen.version == 1 and cached == 0
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_a_failing_lookup_fails_its_request_only(tiny_model_dir):
    """The lookup copies a prefix, which can run out of memory on a GPU: that request gets an
    EngineFailure and the stream already running goes on."""
    from clawr1.core.types import EngineFailure

    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1))
    first, second = _turns(engine)

    def no_memory(owner, prompt_ids):
        raise torch.OutOfMemoryError("simulated")

    async def go():
        running = engine.generate(first, SamplingParams(max_tokens=40, temperature=1.0, seed=1))
        await anext(aiter(running))
        engine._prefix.lookup = no_memory
        failed = engine.generate(second, SamplingParams(max_tokens=4))
        with pytest.raises(EngineFailure, match="OutOfMemoryError"):
            await failed.final()
        gen = await running.final()
        await engine.close()
        return gen

    gen = run(go())
    assert gen.finish_reason in ("stop", "length") and len(gen.token_ids) > 1
