"""An aborted request's stream adds up to its content, as a finished one's does: text held back
while the reply ran (what could begin a stop sequence, half a UTF-8 character) is released when it
ends without a stop having matched, whether it ended by finishing, by an abort, or by the server.

Before, an abort decoded the text in full into the Generation and dropped the delta that released
it, so a stream's text stopped short of `gen.content` by what was held (the local engine's
`_finish` and the remote engine's cancel and server-end paths)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from clawr1.core.config import EngineConfig
from clawr1.core.types import Generation, SamplingParams
from clawr1.engine import local
from clawr1.engine.remote import RemoteEngine
from clawr1.engine.text import Advance
from tests.conftest import run

WAIT_S = 30.0


def prompt(engine):
    return engine.render([{"role": "user", "content": "Tell me a story."}])


def held_case(engine, case: str) -> tuple[int, tuple[str, ...]]:
    """(tokens to abort after, stop sequences) for greedy decoding of `prompt`, such that text is
    held back at that point: the whole reply could still begin the stop, or the last token ends in
    half a character."""
    ids = prompt(engine)
    full = run(generate(engine, ids, SamplingParams(max_tokens=60, temperature=0)))
    if case == "stop":
        return 3, (full.text + "\x07never",)  # every character so far could begin it
    decode = engine.tokenizer.decode
    cut = next((k for k in range(2, len(full.token_ids))
                if decode(full.token_ids[:k], skip_special_tokens=True).endswith("\ufffd")), None)
    if cut is None:
        pytest.skip("the tiny model's greedy reply splits no character across tokens")
    return cut, ()


async def generate(engine, ids, sampling):
    return await engine.generate(ids, sampling).final()


async def stream_text(stream) -> tuple[list, str]:
    events = [e async for e in stream]
    return events, "".join(e.text for e in events)


@pytest.mark.parametrize("case", ["stop", "half-character"])
def test_an_aborted_running_request_streams_the_text_it_held_back(engine, monkeypatch, case):
    ids = prompt(engine)
    after, stops = held_case(engine, case)
    sampling = SamplingParams(max_tokens=60, temperature=0, stop=stops)
    finished = run(generate(engine, ids, SamplingParams(max_tokens=after, temperature=0, stop=stops)))
    reached, resume = threading.Event(), threading.Event()

    class Pausing(Advance):
        """Holds the scheduler thread once `after` tokens are sampled, until the test has cancelled:
        the abort lands after exactly that many tokens, whatever the machine's speed."""

        def __call__(self, gen, token, logprob):
            out = super().__call__(gen, token, logprob)
            if len(gen.token_ids) == after:
                reached.set()
                resume.wait(WAIT_S)
            return out

    monkeypatch.setattr(local, "Advance", Pausing)

    async def go():
        stream = engine.generate(ids, sampling)
        try:
            assert await asyncio.to_thread(reached.wait, WAIT_S)
            stream.cancel()
        finally:
            resume.set()
        events, text = await stream_text(stream)
        return events, text, stream.generation

    events, text, gen = run(go())
    assert gen.finish_reason == "aborted" and len(gen.token_ids) == after
    assert gen.text == engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    assert gen.stop_match is None and gen.content == gen.text != ""
    assert [e.token_id for e in events] == gen.token_ids
    # What was held is streamed at the end, as when the reply finishes at that token (length).
    assert text == gen.content == finished.content
    assert finished.finish_reason == "length" and finished.token_ids == gen.token_ids


class ScriptedServer(RemoteEngine):
    """A remote engine whose server samples `tokens`, then goes on generating (`cancel`) or ends
    the reply itself (an EOS it does not return: `server end`)."""

    def __init__(self, model_dir, tokens: list[int], ends: bool):
        super().__init__(model_dir, EngineConfig(backend="vllm", url="http://127.0.0.1:9"))
        self.tokens, self.ends = tokens, ends
        self.sampled = asyncio.Event()

    async def _sample(self, prompt_ids, sampling, max_tokens, served, gen):
        for token in self.tokens:
            yield token, -0.5
        self.sampled.set()
        if not self.ends:
            await asyncio.Event().wait()  # still generating until the request is cancelled

    async def _score(self, ids, start, served):
        raise NotImplementedError

    async def _load(self, served, path):
        raise NotImplementedError

    async def _unload(self, served):
        raise NotImplementedError


@pytest.mark.parametrize("how", ["cancel", "server end"])
@pytest.mark.parametrize("case", ["stop", "half-character"])
def test_a_remote_stream_that_ends_without_a_token_streams_the_text_it_held_back(tiny_model_dir, engine, case, how):
    tokenizer = engine.tokenizer
    if case == "stop":
        tokens, stops = tokenizer.encode("Hello there, wor", add_special_tokens=False), ("world!",)
    else:
        ids = tokenizer.encode("Hello 日本語", add_special_tokens=False)
        cut = next((k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")), None)
        assert cut is not None, "SmolLM2's tokenizer splits these characters across byte tokens"
        tokens, stops = ids[:cut], ()

    async def go():
        server = ScriptedServer(tiny_model_dir, tokens, ends=how == "server end")
        try:
            stream = server.generate([1, 2, 3], SamplingParams(max_tokens=50, temperature=0, stop=stops))
            if how == "cancel":
                await asyncio.wait_for(server.sampled.wait(), WAIT_S)
                stream.cancel()
            events, text = await stream_text(stream)
            return events, text, stream.generation
        finally:
            await server.close()

    events, text, gen = run(go())
    assert gen.finish_reason == ("aborted" if how == "cancel" else "stop")
    assert gen.token_ids == tokens and [e.token_id for e in events] == tokens
    assert gen.text == tokenizer.decode(tokens, skip_special_tokens=True) and gen.stop_match is None
    assert text == gen.content == gen.text != ""


def test_the_events_of_a_reply_cut_anywhere_add_up_to_its_content(engine):
    """The rule itself (`Advance.events` / `end`), for a reply ended after every one of its tokens
    with no token of its own: one event per token, in order, and their text is the content."""
    tokenizer = engine.tokenizer
    for text, stops in (("Hello there, world! The answer is 42.", ("world?", "42!")),
                        ("café 日本語のテキスト 🙂 end", ("テキスト!",)), ("a b c d e f", ("c d e g",))):
        ids = tokenizer.encode(text, add_special_tokens=False)
        for cut in range(1, len(ids) + 1):
            advance, gen = Advance(tokenizer, frozenset(), stops, 10_000), Generation(prompt_ids=[1])
            events = []
            for token in ids[:cut]:
                ready, reason = advance.events(gen, token, -0.5)
                events += ready
                assert reason is None
            events += advance.end(gen)
            assert [e.token_id for e in events] == ids[:cut]
            assert "".join(e.text for e in events) == gen.content == gen.text
            assert gen.text == tokenizer.decode(ids[:cut], skip_special_tokens=True)
