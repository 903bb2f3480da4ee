"""Engine behaviour on the tiny model: token faithfulness, determinism, streaming, errors."""

import asyncio

import pytest
import torch

from clawr1.core.types import ContextLengthError, InvalidRequestError, SamplingParams, UnknownAdapterError
from tests.conftest import run


def prompt(engine, text="Tell me a story."):
    return engine.render([{"role": "user", "content": text}])


async def generate(engine, ids, **kw):
    return await engine.generate(ids, SamplingParams(**kw)).final()


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_equal_score_alone(engine, temperature):
    async def go():
        ids = prompt(engine)
        gen = await generate(engine, ids, max_tokens=24, temperature=temperature, seed=1)
        scored = await engine.score(ids, gen.token_ids, temperature=gen.temperature)
        return gen, scored

    gen, scored = run(go())
    assert len(gen.token_ids) == len(gen.logprobs) == len(scored) > 0
    assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3
    assert engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True) == gen.text


def test_logprobs_equal_score_in_a_batch_of_8(engine):
    """Eight concurrent requests of different lengths share one left-padded batch."""
    async def go():
        prompts = [prompt(engine, "word " * (i * 7 + 1)) for i in range(8)]
        gens = await asyncio.gather(*[generate(engine, p, max_tokens=8 + 3 * i, temperature=0.9, seed=i)
                                      for i, p in enumerate(prompts)])
        scores = [await engine.score(p, g.token_ids, temperature=0.9) for p, g in zip(prompts, gens)]
        return gens, scores

    before = engine.stats["decode_steps"]
    gens, scores = run(go())
    # Batched: far fewer decode steps than tokens generated.
    assert engine.stats["decode_steps"] - before < sum(len(g.token_ids) for g in gens) / 2
    for gen, scored in zip(gens, scores):
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3
        assert engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True) == gen.text


def test_the_batch_cache_grows_in_place_and_stays_exact(engine, monkeypatch):
    """Decode steps append into spare capacity (no copy of the whole cache a step); with 2 columns
    of headroom the buffers grow every other step while rows join and leave, and every logprob
    still equals a one-pass `score`."""
    from clawr1.engine import batch

    monkeypatch.setattr(batch, "HEADROOM", 2)
    grown = []
    original = batch.GrowingLayer.__init__

    def counted(self, parts, coming=0):
        grown.append(coming)
        original(self, parts, coming)

    monkeypatch.setattr(batch.GrowingLayer, "__init__", counted)

    async def go():
        prompts = [prompt(engine, "word " * (i * 5 + 1)) for i in range(4)]
        gens = await asyncio.gather(*[generate(engine, p, max_tokens=6 + 5 * i, temperature=0.8, seed=i)
                                      for i, p in enumerate(prompts)])
        return prompts, gens

    prompts, gens = run(go())
    steps = max(len(g.token_ids) for g in gens)
    growths = sum(1 for coming in grown if coming)  # builds made because the headroom ran out
    assert 0 < growths <= steps  # 2 layers, each growing every other step at most (a copy a step: 2 a step)
    for p, gen in zip(prompts, gens):
        scored = run(engine.score(p, gen.token_ids, temperature=0.8))
        assert len(gen.token_ids) > 2
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_a_growing_layer_writes_in_place_never_rewrites_a_column_and_pads_with_zeros():
    import torch

    from clawr1.engine.batch import HEADROOM, GrowingLayer

    a, b = torch.randn(1, 2, 3, 4), torch.randn(2, 2, 5, 4)
    layer = GrowingLayer([(a, a + 1, 2), (b, b + 1, 0)])  # a padded to b's length
    assert layer.keys.shape == (3, 2, 5, 4)
    assert torch.equal(layer.keys[:1, :, :2], torch.zeros(1, 2, 2, 4))
    assert torch.equal(layer.keys[:1, :, 2:], a) and torch.equal(layer.values[1:], b + 1)
    earlier, buffers = layer.keys, {layer._k.data_ptr()}
    snapshot = earlier.clone()
    for _ in range(HEADROOM + 3):  # past the headroom: the buffers move once, and only once
        new = torch.randn(3, 2, 1, 4)
        keys, _ = layer.update(new, new)
        assert torch.equal(keys[:, :, -1:], new)
        buffers.add(layer._k.data_ptr())
    assert len(buffers) == 2  # written in place until the headroom ran out
    assert layer.keys.shape[-2] == 5 + HEADROOM + 3
    assert torch.equal(earlier, snapshot)  # a view taken before kept its content
    assert torch.equal(layer.keys[:, :, :5], snapshot)
    many = torch.randn(3, 2, HEADROOM + 7, 4)  # more columns at once than any headroom left
    keys, values = layer.update(many, many)
    assert keys.shape[-2] == 5 + 2 * HEADROOM + 10 and torch.equal(keys[:, :, -many.shape[-2]:], many)
    assert torch.equal(keys[:, :, :5], snapshot) and torch.equal(values[:, :, -many.shape[-2]:], many)
    for rows in ([2, 1, 0], [2, 0]):  # inherited methods replace `keys` by a copy: re-buffered, not lost
        layer.batch_select_indices(torch.tensor(rows))
        kept, one = layer.keys.clone(), torch.ones(len(rows), 2, 1, 4)
        keys, _ = layer.update(one, one)
        assert torch.equal(keys[:, :, :-1], kept) and torch.equal(keys[:, :, -1:], one)


def test_without_headroom_every_step_copies_and_stays_exact(monkeypatch):
    """`HEADROOM = 0` (what `bench engine` compares against: a copy a step, as `DynamicLayer`)."""
    import torch

    from clawr1.engine import batch

    monkeypatch.setattr(batch, "HEADROOM", 0)
    first = torch.randn(2, 2, 3, 4)
    layer = batch.GrowingLayer([(first, first, 0)])
    columns = [first]
    for _ in range(3):
        new = torch.randn(2, 2, 1, 4)
        keys, _ = layer.update(new, new)
        columns.append(new)
        assert torch.equal(keys, torch.cat(columns, dim=-2))


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(engine):
    ids = prompt(engine)
    a = run(generate(engine, ids, max_tokens=20, temperature=0))
    b = run(generate(engine, ids, max_tokens=20, temperature=0))
    assert a.token_ids == b.token_ids
    s1 = run(generate(engine, ids, max_tokens=20, temperature=1.0, seed=42))
    s2 = run(generate(engine, ids, max_tokens=20, temperature=1.0, seed=42))
    s3 = run(generate(engine, ids, max_tokens=20, temperature=1.0, seed=43))
    assert s1.token_ids == s2.token_ids
    assert s1.token_ids != s3.token_ids


def test_streamed_text_is_the_content_and_stop_is_held_back(engine):
    ids = prompt(engine)
    full = run(generate(engine, ids, max_tokens=30, temperature=0))
    assert full.finish_reason in ("length", "stop")
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert len(stop) == 3

    async def go():
        stream = engine.generate(ids, SamplingParams(max_tokens=30, temperature=0, stop=(stop,)))
        events = [e async for e in stream]
        return events, stream.generation

    events, gen = run(go())
    assert gen.finish_reason == "stop" and gen.stop_match == stop
    assert "".join(e.text for e in events) == gen.content == full.text[: full.text.find(stop)]
    assert [e.token_id for e in events] == gen.token_ids
    assert gen.token_ids == full.token_ids[: len(gen.token_ids)]


def test_max_tokens_gives_length(engine):
    gen = run(generate(engine, prompt(engine), max_tokens=3, temperature=0))
    assert len(gen.token_ids) <= 3
    assert gen.finish_reason == ("length" if len(gen.token_ids) == 3 else "stop")
    assert gen.version == 0 and gen.adapter is None


def test_cancel_aborts_and_keeps_what_was_sampled(engine):
    async def go():
        stream = engine.generate(prompt(engine), SamplingParams(max_tokens=400, temperature=0))
        async for _ in stream:
            stream.cancel()
            break
        return await stream.final()

    gen = run(go())
    assert gen.finish_reason == "aborted"
    assert 1 <= len(gen.token_ids) < 400 and len(gen.logprobs) == len(gen.token_ids)


def test_bad_input_raises_documented_errors(engine):
    async def go(ids, adapter=None, **kw):
        return engine.generate(ids, SamplingParams(**kw), adapter=adapter)

    ids = prompt(engine)
    with pytest.raises(UnknownAdapterError, match="nope"):
        run(go(ids, adapter="nope"))
    with pytest.raises(InvalidRequestError, match="empty"):
        run(go([]))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        run(go(ids, max_tokens=0))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        run(go(ids, max_tokens=-5))
    with pytest.raises(InvalidRequestError, match="temperature"):
        run(go(ids, temperature=3.0))
    with pytest.raises(InvalidRequestError):
        run(go([10**9]))
    with pytest.raises(ContextLengthError) as info:
        run(go(ids * 200))
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthError):
        run(engine.score(ids * 100, ids * 100))
    with pytest.raises(InvalidRequestError):
        run(engine.score(ids, []))


def test_max_tokens_is_clamped_to_the_context(engine):
    ids = prompt(engine)
    room = engine.max_context - len(ids)
    long_prompt = (ids * 40)[: engine.max_context - 2]
    gen = run(generate(engine, long_prompt, max_tokens=1000, temperature=0))
    assert len(gen.token_ids) <= 2 and room > 2


def test_a_late_request_joins_the_running_batch_and_leaves_first(engine):
    """Continuous batching: a short request admitted mid-decode finishes while a long one runs on,
    and both keep exact logprobs (the join re-pads the cache on either side)."""
    async def go():
        long_prompt = prompt(engine, "short")
        late_prompt = prompt(engine, "a much longer question " * 6)
        long = engine.generate(long_prompt, SamplingParams(max_tokens=120, temperature=0.9, seed=5))
        await anext(aiter(long))
        late = engine.generate(late_prompt, SamplingParams(max_tokens=6, temperature=0.9, seed=6))
        late_gen = await late.final()
        long_running = long.generation is None and len(long._request.gen.token_ids) < 120
        long_gen = await long.final()
        scores = [await engine.score(p, g.token_ids, temperature=0.9)
                  for p, g in ((long_prompt, long_gen), (late_prompt, late_gen))]
        return long_running, [long_gen, late_gen], scores

    long_running, gens, scores = run(go())
    assert long_running
    for gen, scored in zip(gens, scores):
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


def test_generate_after_close_fails_fast(tiny_model_dir):
    from clawr1.core.config import EngineConfig
    from clawr1.core.types import EngineFailure
    from clawr1.engine.local import LocalEngine

    closed = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1))
    run(closed.close())

    async def go():
        return closed.generate(prompt(closed), SamplingParams(max_tokens=2))

    with pytest.raises(EngineFailure, match="closed"):
        run(go())


@pytest.fixture
def chunked(tiny_model_dir):
    """An engine that prefills 16 prompt tokens per scheduler step (and caches no prefix, so every
    prompt is prefilled whole)."""
    from clawr1.core.config import EngineConfig
    from clawr1.engine.local import LocalEngine

    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8, prefill_chunk=16, prefix_cache_mb=0))
    yield engine
    run(engine.close())


def test_a_long_prompt_prefills_in_chunks_while_the_batch_decodes(chunked):
    """A 10-chunk prompt joins a running stream: that stream gains a token between every two of its
    chunks instead of stalling for the whole prompt, and both keep exact logprobs (the chunked
    cache equals the one-pass `score`)."""
    async def go():
        running_prompt, long_prompt = prompt(chunked, "short"), prompt(chunked, "word " * 160)[:160]
        running = chunked.generate(running_prompt, SamplingParams(max_tokens=200, temperature=0.9, seed=1))
        await anext(aiter(running))
        before = len(running._request.gen.token_ids)
        late = chunked.generate(long_prompt, SamplingParams(max_tokens=4, temperature=0.9, seed=2))
        await anext(aiter(late))
        during = len(running._request.gen.token_ids) - before
        gens = [await running.final(), await late.final()]
        scores = [await chunked.score(p, g.token_ids, temperature=0.9) for p, g in zip((running_prompt, long_prompt), gens)]
        return during, gens, scores

    during, gens, scores = run(go())
    assert during >= 9  # one decode step between each two of the 10 chunks
    for gen, scored in zip(gens, scores):
        assert len(gen.token_ids) == len(scored) > 0
        assert max(abs(a - b) for a, b in zip(gen.logprobs, scored)) <= 1e-3


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_cancel_or_close_stops_a_long_prefill_between_chunks(chunked, how):
    """Neither a client hanging up nor shutdown waits for a long prompt's whole prefill."""
    long_prompt = prompt(chunked, "word " * 480)[:480]
    before = chunked.stats["prefill_tokens"]

    async def go():
        stream = chunked.generate(long_prompt, SamplingParams(max_tokens=4))
        while chunked.stats["prefill_tokens"] == before:  # its first chunk is in
            await asyncio.sleep(0.001)
        if how == "cancel":
            stream.cancel()
        else:
            await chunked.close()
        return await stream.final()

    gen = run(go())
    assert gen.finish_reason == "aborted" and gen.token_ids == []
    assert chunked.stats["prefill_tokens"] - before < len(long_prompt)


def test_a_batch_failure_after_a_row_finished_answers_each_request_once(tiny_model_dir):
    """Re-laying the batch fails (out of memory) right after one request finished: that one keeps its
    answer, the one still decoding fails, and neither is released twice (the queue count stays true)."""
    from clawr1.core.config import EngineConfig
    from clawr1.core.types import EngineFailure, Generation
    from clawr1.engine.local import LocalEngine

    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, prefix_cache_mb=0))
    prompts = [engine.render([{"role": "user", "content": text}]) for text in ("Name three rivers.", "Count to ten.")]

    def no_memory(rows):
        raise torch.OutOfMemoryError("simulated")

    engine._batch.keep = no_memory

    async def answer(stream):
        try:
            return await stream.final()
        except EngineFailure as exc:
            return exc

    async def go():
        streams = [engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0))
                   for prompt, n in zip(prompts, (3, 40))]
        results = await asyncio.gather(*(answer(s) for s in streams))
        pending = engine._pending
        await engine.close()
        return results, pending

    results, pending = run(go())
    answered = [r for r in results if isinstance(r, Generation)]
    assert len(answered) == 1 and isinstance(next(r for r in results if r not in answered), EngineFailure)
    assert pending == 0


@pytest.mark.system  # a whole Python process with the model (~5 s): the system tier's kind of test
def test_a_process_that_exits_while_the_engine_decodes_exits_cleanly(tiny_model_dir, tmp_path):
    """Interrupted before `close()` ended (or never closed), a process used to abort at exit: the
    scheduler thread, a daemon, was unwound inside torch's C++ code ("terminate called without an
    active exception", SIGABRT). The engine now stops its thread before Python finalizes."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(f"""
import asyncio
from clawr1.core.config import EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.engine.local import LocalEngine

engine = LocalEngine.load({str(tiny_model_dir)!r}, EngineConfig(threads=1))
prompt = engine.render([{{"role": "user", "content": "Tell me a story."}}])

async def main():
    streams = [engine.generate(prompt, SamplingParams(max_tokens=400, temperature=1.0)) for _ in range(8)]
    await anext(aiter(streams[0]))  # decoding: leave without close()

asyncio.run(main())
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]


def test_a_stream_is_ready_exactly_when_its_next_event_needs_no_wait():
    """`QueuedStream.ready()` (both engines' stream): the gateway sends held events together and
    skips the keep-alive timer on it, so it must never say ready while `__anext__` would wait."""
    from clawr1.core.types import Generation, TokenEvent
    from clawr1.engine.queued import QueuedStream

    async def go():
        stream = QueuedStream(asyncio.Queue(), Generation(prompt_ids=[1]))
        seen = [stream.ready()]  # nothing sampled yet
        stream.out.put_nowait(TokenEvent(7, -0.5, "a"))
        seen.append(stream.ready())
        await stream.__anext__()
        seen.append(stream.ready())  # consumed: the next one is still to come
        stream.out.put_nowait(Generation(prompt_ids=[1], token_ids=[7], logprobs=[-0.5], text="a", version=0,
                                         temperature=1.0, finish_reason="stop"))
        seen.append(stream.ready())
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        seen.append(stream.ready())  # over: the next call ends at once
        return seen

    assert run(go()) == [False, True, False, True, True]


def test_a_cancelled_queued_request_leaves_the_queue_at_once(tiny_model_dir):
    """With every row busy, a queued request whose client went away must not wait for its turn to
    leave: it held a queue place (new requests were refused as overloaded) and its adapter slot."""
    from clawr1.core.config import EngineConfig
    from clawr1.core.types import EngineOverloadedError
    from clawr1.engine.local import LocalEngine

    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=1, max_queue=2))
    ids = engine.render([{"role": "user", "content": "hi"}])

    async def go() -> list[str]:
        long = engine.generate(ids, SamplingParams(max_tokens=400, temperature=1.0, seed=1))
        await anext(aiter(long))  # the only row is busy
        queued = [engine.generate(ids, SamplingParams(max_tokens=5)) for _ in range(2)]
        for stream in queued:
            stream.cancel()
        reasons = [(await asyncio.wait_for(stream.final(), 10)).finish_reason for stream in queued]
        with pytest.raises(EngineOverloadedError):  # full: the long one, two more queued
            [engine.generate(ids, SamplingParams(max_tokens=5)) for _ in range(3)]
        long.cancel()
        await long.final()
        return reasons

    try:
        assert run(go()) == ["aborted", "aborted"]  # answered while the long one still runs
    finally:
        asyncio.run(engine.close())


def test_a_streams_version_is_the_one_that_samples_it(tiny_model_dir, tmp_path):
    """A base-model request queued while new whole weights wait to load is sampled by them; its
    stream says so (the gateway's fingerprint, the Ray router's record), as its generation does."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from clawr1.core.config import EngineConfig
    from clawr1.engine import adapters as store
    from clawr1.engine.local import LocalEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.9)
    path = store.publish_weights(model, Path(tmp_path) / "w", "policy", 1)
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1))
    ids = engine.render([{"role": "user", "content": "hi"}])

    async def go():
        long = engine.generate(ids, SamplingParams(max_tokens=40, temperature=1.0, seed=1))
        await anext(aiter(long))
        load = asyncio.ensure_future(engine.load_weights(path))
        await asyncio.sleep(0.05)  # queued: the running batch finishes on the old weights first
        queued = engine.generate(ids, SamplingParams(max_tokens=5, temperature=0))
        gen = await queued.final()
        await long.final()
        await load
        return queued.version, gen.version

    try:
        assert run(go()) == (1, 1)
    finally:
        asyncio.run(engine.close())
