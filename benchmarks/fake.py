"""Fast fakes for the gateway benchmark: a model that answers at once, so timings measure the serving path.

- `FakeEngine` implements the `Engine` contract in-process and returns a fixed 16-token reply with
  logprobs; the gateway serves and records it exactly as it would a LocalEngine generation.
- `make_app()` is an OpenAI-compatible HTTP server (aiohttp) returning the same reply, plain or as SSE
  with the same chunks the gateway sends (role, one per token, finish, `[DONE]`). It is the "direct"
  backend and the upstream of the proxies we compare against: `python -m benchmarks.fake --port P`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web

from clawr1.core.types import Generation, ParsedCompletion, SamplingParams, TokenEvent

PIECES = ("Sure", ",", " here", " is", " a", " short", " answer", " from", " the", " fake", " backend", ":",
          " all", " is", " well", ".")
FIRST_ID = 1000  # token ids of the reply are FIRST_ID + index into PIECES
REPLY_IDS = tuple(range(FIRST_ID, FIRST_ID + len(PIECES)))
REPLY_LOGPROBS = tuple(-0.05 * (i + 1) for i in range(len(PIECES)))
REPLY = "".join(PIECES)
# Built once (a TokenEvent is frozen, so one can be handed out any number of times): the fake
# engine should cost the gateway next to nothing a token, as its HTTP twin costs the proxies.
REPLY_EVENTS = tuple(TokenEvent(i, lp, p) for i, lp, p in zip(REPLY_IDS, REPLY_LOGPROBS, PIECES, strict=True))
ROLE_IDS = {"system": 1, "developer": 1, "user": 2, "assistant": 3, "tool": 4}


class FakeTokenizer:
    """Just enough of a Hugging Face tokenizer for the gateway: per-token text for logprobs."""

    eos_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i - FIRST_ID] if FIRST_ID <= i < FIRST_ID + len(PIECES) else "" for i in ids)


class FakeStream:
    """Yields the reply's tokens without waiting; `generation` is set once the last one is out."""

    def __init__(self, gen: Generation, max_tokens: int):
        self.version = gen.version
        self.generation: Generation | None = None
        self._gen = gen
        self._limit = min(max_tokens, len(PIECES))
        self._cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.generation is not None:
            raise StopAsyncIteration
        gen, i = self._gen, len(self._gen.token_ids)
        if self._cancelled or i == self._limit:
            gen.finish_reason = "aborted" if self._cancelled else ("stop" if i == len(PIECES) else "length")
            self.generation = gen
            raise StopAsyncIteration
        # Built token by token, as LocalEngine does, so a cancelled stream holds what was sent.
        gen.token_ids.append(REPLY_IDS[i])
        gen.logprobs.append(REPLY_LOGPROBS[i])
        gen.text += PIECES[i]
        return REPLY_EVENTS[i]

    def ready(self) -> bool:
        return True  # never waits

    async def final(self) -> Generation:
        """The rest of the reply at once: a plain request reads no tokens, and 16 steps of this
        async iterator were most of what the fake engine cost the gateway a request (profiled),
        where the pass-through's backend answers from a prebuilt body in another process."""
        if self.generation is None:
            gen, i = self._gen, len(self._gen.token_ids)
            end = i if self._cancelled else self._limit
            gen.token_ids += REPLY_IDS[i:end]
            gen.logprobs += REPLY_LOGPROBS[i:end]
            gen.text += "".join(PIECES[i:end])
            gen.finish_reason = "aborted" if self._cancelled else ("stop" if end == len(PIECES) else "length")
            self.generation = gen
        return self.generation

    def cancel(self) -> None:
        """Stop early: a stream not yet finished ends with `finish_reason="aborted"`."""
        self._cancelled = True


class FakeEngine:
    """The `Engine` contract with no model: render and generate cost microseconds."""

    def __init__(self, max_context: int = 8192):
        # Imported here so the fake HTTP server (which needs no engine) does not load torch.
        from clawr1.core.types import SamplingDefaults
        from clawr1.engine.chat import ChatFormat

        self.max_context = max_context
        self.tokenizer = FakeTokenizer()
        self.sampling_defaults = SamplingDefaults()
        self.version = 0
        self._parse = ChatFormat.parse  # the real parser: tool-call markup in a reply would be honoured
        self._adapters: dict[str, int] = {}

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Two ids a message (role, content length): cheap, and different conversations differ."""
        ids: list[int] = []
        for message in messages:
            ids += [ROLE_IDS.get(message.get("role", ""), 0), len(str(message.get("content") or ""))]
        return ids

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        return self._parse(text, tools)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None = None,
                 affinity: str | None = None) -> FakeStream:
        version = self._adapters.get(adapter, 0) if adapter else self.version
        gen = Generation(prompt_ids=list(prompt_ids), adapter=adapter, version=version, **sampling.recorded)
        return FakeStream(gen, sampling.max_tokens)

    async def score(self, prompt_ids: list[int], completion_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
        return [-0.5] * len(completion_ids)

    async def load_adapter(self, name: str, path: Path) -> int:
        self.version += 1
        self._adapters[name] = self.version
        return self.version

    async def unload_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    def adapters(self) -> dict[str, int]:
        return dict(self._adapters)

    async def close(self) -> None:
        return None


# ---- the fake OpenAI-compatible server ------------------------------------------------------------

def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()), "model": "fake",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


# Built once: the backend should cost next to nothing, so the comparison measures what is in front of it.
COMPLETION = json.dumps({
    "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop",
                 "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": len(PIECES), "total_tokens": 4 + len(PIECES)},
}, separators=(",", ":")).encode()
STREAM_CHUNKS = ([_chunk({"role": "assistant", "content": ""})] + [_chunk({"content": p}) for p in PIECES]
                 + [_chunk({}, "stop"), b"data: [DONE]\n\n"])


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()  # parsed, as any real backend would
    if not body.get("stream"):
        return web.Response(body=COMPLETION, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in STREAM_CHUNKS:  # one write per chunk, like a server streaming tokens
        await response.write(chunk)
    await response.write_eof()
    return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "created": 0,
                                                          "owned_by": "clawr1"}]})


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    return app


def run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop when it is installed (as uvicorn does), so every server gets the same event loop."""
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


async def serve_forever(app: web.Application, port: int) -> None:
    """Serve on 127.0.0.1:`port` until SIGINT or SIGTERM, then close connections and return."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A fake OpenAI-compatible backend that answers at once.")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    run_loop(serve_forever(make_app(), args.port))


if __name__ == "__main__":
    main()
