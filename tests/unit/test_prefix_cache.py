"""The local engine's prefix cache: a next turn prefills only what is new, with exact logprobs, and a
KV is never reused under other weights than the ones that computed it."""

import asyncio
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


def test_prompts_lists_an_owners_most_recent_first_and_whole_lookup_may_cover_the_last_token():
    cache = PrefixCache(budget_bytes=1 << 20)
    cache.store("a", [1, 2, 3], kv(3))
    cache.store("b", [4, 5], kv(2))
    cache.store("a", [7, 8], kv(2))
    cache.lookup("a", [1, 2, 3, 9])  # used: now a's most recent
    assert cache.prompts("a", 8) == [[1, 2, 3], [7, 8]] and cache.prompts("a", 1) == [[1, 2, 3]]
    assert cache.prompts("c", 8) == []
    assert cache.lookup("a", [1, 2, 3])[0] == 2 and cache.lookup("a", [1, 2, 3], whole=True)[0] == 3
    assert cache.covers("a", [1, 2]) and cache.covers("a", [1, 2, 3]) and cache.covers("b", [4, 5])
    assert not cache.covers("a", [1, 2, 3, 4]) and not cache.covers("a", [2]) and not cache.covers("b", [1, 2])


def test_a_reply_replaces_the_other_replies_to_its_prompt_but_not_a_later_turn_that_starts_with_it():
    """A group of samples of one prompt keeps one entry (the prompt part of it serves them all);
    another conversation that began with the same prompt and went on keeps its own."""
    cache = PrefixCache(budget_bytes=1 << 20)
    cache.store("a", [1, 2, 3, 4, 5, 6, 7, 8], kv(8))  # a conversation's turn 2, starting with [1, 2, 3]
    cache.store("a", [1, 2, 3, 10, 11], kv(5), prompt=3)  # sample 1 of prompt [1, 2, 3]
    cache.store("a", [1, 2, 3, 20, 21, 22], kv(6), prompt=3)  # sample 2: replaces sample 1
    cache.store("b", [1, 2, 3, 30], kv(4), prompt=3)  # another owner's: untouched
    assert len(cache) == 3 and cache.nbytes == (8 + 6 + 4) * 128
    assert cache.lookup("a", [1, 2, 3, 10, 11, 12])[0] == 3  # sample 1's reply is gone, its prompt is served
    assert cache.lookup("a", [1, 2, 3, 20, 21, 22, 23])[0] == 6
    assert cache.lookup("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])[0] == 8


def _turns(engine: LocalEngine) -> tuple[list[int], list[int]]:
    first = engine.render([{"role": "system", "content": "You are a careful assistant. " * 6},
                           {"role": "user", "content": "Name three rivers."}])
    second = first + engine.tokenizer("The Rhine, the Danube and the Elbe.<|im_end|>\n")["input_ids"] + \
        engine.render([{"role": "user", "content": "Which one is longest?"}])
    return first, second


async def _turn2(engine: LocalEngine, second: list[int], sampling: SamplingParams, adapter: str | None = None):
    """Serve turn 2, score its reply in one pass, close the engine: (prompt tokens taken from the
    prefix cache, the generation, the scored logprobs)."""
    before = engine.stats["prefix_cached_tokens"]
    gen = await engine.generate(second, sampling, adapter=adapter).final()
    scored = await engine.score(second, gen.token_ids, adapter=adapter, temperature=sampling.temperature)
    await engine.close()
    return engine.stats["prefix_cached_tokens"] - before, gen, scored


@pytest.mark.parametrize("budget_mb", [64, 0])
def test_a_next_turn_prefills_only_what_is_new_with_exact_logprobs(tiny_model_dir, budget_mb):
    """The second turn's prompt extends the first's: with the cache it prefills only the new tokens
    (in 16-token chunks from an unaligned start), and its logprobs equal a one-pass `score`."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, prefill_chunk=16, prefix_cache_mb=budget_mb))
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
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, max_batch=8, prefix_rewarm=0))
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
        return await _turn2(engine, second, sampling, "policy")

    cached, gen, scored = run(go())
    assert gen.version == 3 and cached == 0
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


@pytest.mark.parametrize("rewarm", [0, 8])
def test_new_full_weights_drop_every_cached_prefix_and_reprefill_them_when_idle(tiny_model_dir, tmp_path, rewarm):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9)
    path = store.publish_weights(model, Path(tmp_path) / "weights", "policy", 1)
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, prefill_chunk=16, prefix_rewarm=rewarm))
    first, second = _turns(engine)
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

    async def go():
        await engine.generate(first, sampling).final()
        assert len(engine._prefix) == 1
        assert await engine.load_weights(path) == 1
        await _idle(engine)
        return await _turn2(engine, second, sampling)

    cached, gen, scored = run(go())
    assert gen.version == 1 and cached == (len(first) if rewarm else 0)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_a_failing_lookup_fails_its_request_only(tiny_model_dir):
    """The lookup copies a prefix, which can run out of memory on a GPU: that request gets an
    EngineFailure and the stream already running goes on."""
    from clawr1.core.types import EngineFailure

    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False))
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


async def _idle(engine: LocalEngine) -> None:
    """Until the engine has re-warmed everything it queued (it does so only while idle)."""
    for _ in range(6000):
        if engine.rewarming == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{engine.rewarming} re-warms still queued after 60 s")


@pytest.mark.parametrize("rewarm", [8, 0])
def test_after_swaps_idle_time_reprefills_the_replaced_versions_prompts_under_the_new_weights(
        tiny_model_dir, tmp_path, rewarm):
    """v1 serves turn 1; v2 replaces it and v3 replaces v2 at once (copied into v1's slot), before or
    while v2 re-warms turn 1. Once idle, turn 2 under v3 starts from turn 1's KV computed by v3 (its
    logprobs equal v3's one-pass `score`); with `prefix_rewarm = 0` it is cold."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, max_batch=8, prefill_chunk=16,
                                                           prefix_rewarm=rewarm))
    versions = {v: make_adapter(tiny_model_dir, tmp_path, v, seed=v) for v in (1, 2, 3)}
    first, second = _turns(engine)
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

    async def go():
        await engine.load_adapter("policy", versions[1])
        await engine.generate(first, sampling, adapter="policy").final()
        await engine.load_adapter("policy", versions[2])
        await engine.load_adapter("policy", versions[3])
        await _idle(engine)
        before = dict(engine.stats)
        gen = await engine.generate(second, sampling, adapter="policy").final()
        scored = await engine.score(second, gen.token_ids, adapter="policy", temperature=0.8)
        await engine.close()
        return before, gen, scored

    before, gen, scored = run(go())
    cached = engine.stats["prefix_cached_tokens"] - before.get("prefix_cached_tokens", 0)
    assert gen.version == 3 and cached == (len(first) if rewarm else 0)
    assert (before.get("prefix_rewarmed_tokens", 0) >= len(first)) == bool(rewarm)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_unloading_a_version_stops_the_reprefills_queued_for_it(tiny_model_dir, tmp_path):
    """A long prompt re-warms 16 tokens a step; unloading its adapter mid-way drops the rest and
    leaves nothing of it in the cache (a retired slot's KV is never looked up)."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, prefill_chunk=16))
    versions = {v: make_adapter(tiny_model_dir, tmp_path, v, seed=v) for v in (1, 2)}
    long = engine.render([{"role": "user", "content": "Tell me about rivers and mountains. " * 60}])

    async def go():
        await engine.load_adapter("cand", versions[1])
        await engine.generate(long, SamplingParams(max_tokens=1), adapter="cand").final()
        await engine.load_adapter("cand", versions[2])
        await engine.unload_adapter("cand")
        left = engine.rewarming
        await engine.close()
        return left

    assert len(long) > 20 * 16
    assert run(go()) == 0 and len(engine._prefix) == 0


def test_a_request_is_served_before_the_reprefills_queued_ahead_of_it(tiny_model_dir, tmp_path):
    """Re-warms use idle time only: a request arriving behind eight long ones waits for one chunk,
    not for all of them."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, prefill_chunk=16))
    versions = {v: make_adapter(tiny_model_dir, tmp_path, v, seed=v) for v in (1, 2)}
    prompts = [engine.render([{"role": "user", "content": f"Story {i}: " + "rivers and mountains, " * 70}])
               for i in range(8)]

    async def go():
        await engine.load_adapter("policy", versions[1])
        for prompt in prompts:
            await engine.generate(prompt, SamplingParams(max_tokens=1), adapter="policy").final()
        await engine.load_adapter("policy", versions[2])
        gen = await engine.generate(prompts[0][:8], SamplingParams(max_tokens=4), adapter="policy").final()
        left = engine.rewarming
        await _idle(engine)
        slot = engine._adapters["policy"][0]
        covered = [engine._prefix.lookup(slot, prompt, whole=True)[0] for prompt in prompts]
        await engine.close()
        return gen, left, covered

    gen, left, covered = run(go())
    assert gen.version == 2 and gen.finish_reason in ("stop", "length")
    assert left > 0  # the request was answered while re-warms still waited
    assert covered == [len(p) for p in prompts]  # and then all eight were re-warmed under v2


def test_a_replaced_versions_half_done_rewarm_restarts_from_nothing_under_the_new_one(tiny_model_dir):
    """Its KV so far is the old weights': the new version's re-warm of the same prompt starts empty,
    and the old one's partial entry (a prefix of that prompt) takes no place of its own."""
    from clawr1.engine.requests import Rewarm as _Rewarm

    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, prefix_rewarm=2))
    ids = list(range(10, 40))

    def on_scheduler():
        engine._rewarm.append(_Rewarm("old", ids, cache=kv(8), done=8))
        engine._queue_rewarm("old", "new", [ids[:8], [1, 2, 3]])
        jobs = [(job.key, job.ids, job.cache, job.done) for job in engine._rewarm]
        engine._rewarm.clear()  # "new" is no real slot: never run it
        return jobs

    async def go():
        jobs = await engine._call(on_scheduler)
        await engine.close()
        return jobs

    assert run(go()) == [("new", [1, 2, 3], None, 0), ("new", ids, None, 0)]


def test_a_request_starting_from_a_half_done_rewarm_has_exact_logprobs(tiny_model_dir, tmp_path):
    """One 16-token chunk of turn 1 is re-warmed under v2, then the rest is dropped: turn 2 starts
    from those 16 tokens of v2's KV and its logprobs equal v2's one-pass `score`."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, prefill_chunk=16, prefix_rewarm=0))
    versions = {v: make_adapter(tiny_model_dir, tmp_path, v, seed=v) for v in (1, 2)}
    first, second = _turns(engine)
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

    def one_chunk():
        engine.config = engine.config.model_copy(update={"prefix_rewarm": 8})
        engine._queue_rewarm("v1's retired slot", engine._adapters["policy"][0], [first])
        engine._rewarm_chunk()
        engine._rewarm.clear()

    async def go():
        await engine.load_adapter("policy", versions[1])
        await engine.generate(first, sampling, adapter="policy").final()
        await engine.load_adapter("policy", versions[2])  # prefix_rewarm = 0: nothing queued
        await engine._call(one_chunk)
        return await _turn2(engine, second, sampling, "policy")

    cached, gen, scored = run(go())
    assert gen.version == 2 and cached == 16
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_a_rewarm_whose_prompt_a_request_cached_meanwhile_ends_without_a_chunk(tiny_model_dir):
    """The agent's next turn arrived mid-way and filed a prompt extending it: nothing is left to do."""
    from clawr1.engine.requests import Rewarm as _Rewarm

    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False))
    ids = list(range(10, 40))
    forwards = []
    engine._forward = lambda *args, **kwargs: forwards.append(kwargs["input_ids"].shape)

    def on_scheduler():
        engine._prefix.store("slot", ids + [7, 7], kv(len(ids) + 2))  # what the request filed
        engine._rewarm.append(_Rewarm("slot", ids, cache=kv(8), done=8))
        engine._rewarm_chunk()
        return engine.rewarming, engine.stats["prefix_rewarmed_tokens"], forwards

    async def go():
        left = await engine._call(on_scheduler)
        await engine.close()
        return left

    assert run(go()) == (0, 0, [])


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_a_finished_reply_is_cached_with_its_prompt_so_the_next_turn_prefills_only_its_new_message(
        tiny_model_dir, finish):
    """The next turn resends turn 1's prompt and reply: it starts from their KV (all but the reply's
    last token, which was sampled and never fed), computed while decoding in a batch beside another
    request, and its logprobs equal a one-pass `score`."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, max_batch=8))
    first, _ = _turns(engine)
    other = engine.render([{"role": "user", "content": "Count to twenty, slowly. " * 12}])  # longer: turn 1's row is padded

    prober = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, score_from_prefix=False, prefix_cache_mb=0))  # caches nothing here

    async def go():
        probe = await prober.generate(first, SamplingParams(max_tokens=12, temperature=0)).final()
        await prober.close()
        stop = engine.tokenizer.decode(probe.token_ids[5:7]) if finish == "stop" else None
        sampling = SamplingParams(max_tokens=12, temperature=0, stop=(stop,) if stop else ())
        beside = engine.generate(other, SamplingParams(max_tokens=30, temperature=1.0, seed=1))
        reply = await engine.generate(first, sampling).final()
        assert len((await beside.final()).token_ids) > len(reply.token_ids)  # turn 1 decoded beside it, padded
        second = first + reply.token_ids + engine.render([{"role": "user", "content": "Why?"}])
        before = engine.stats["prefix_cached_tokens"]
        gen = await engine.generate(second, SamplingParams(max_tokens=6, temperature=0.8, seed=3)).final()
        scored = await engine.score(second, gen.token_ids, temperature=0.8)
        await engine.close()
        return reply, engine.stats["prefix_cached_tokens"] - before, gen, scored

    reply, cached, gen, scored = run(go())
    assert reply.finish_reason == finish and len(reply.token_ids) >= 2 and len(other) > len(first) + 12
    assert cached == len(first) + len(reply.token_ids) - 1
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_a_score_starts_from_the_cached_prompt_and_equals_the_one_pass_score(tiny_model_dir):
    """`engine.score_from_prefix` (the default): scoring a reply to a prompt the engine has cached
    runs only the uncached rest, and gives the one-pass score and the sampled logprobs."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, prefill_chunk=16))
    first, second = _turns(engine)
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

    async def go():
        await engine.generate(first, sampling).final()
        gen = await engine.generate(second, sampling).final()
        before = engine.stats["score_cached_tokens"]
        cached = await engine.score(second, gen.token_ids, temperature=0.8)
        used = engine.stats["score_cached_tokens"] - before
        engine.config.score_from_prefix = False
        one_pass = await engine.score(second, gen.token_ids, temperature=0.8)
        unused = engine.stats["score_cached_tokens"] - before - used
        await engine.close()
        return gen, cached, one_pass, used, unused

    gen, cached, one_pass, used, unused = run(go())
    assert used == len(second) - 1 and unused == 0  # all but the prompt's last token came from the cache
    assert max(abs(a - b) for a, b in zip(cached, one_pass)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(gen.logprobs, cached)) <= 1e-3
