"""The gateway: an OpenAI-compatible HTTP surface that serves through the engine and records every
call, token for token, into the data pool without making the reply wait for the write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from clawr1.core.config import Config
from clawr1.core.records import DEFAULT_TENANT, Step
from clawr1.core.types import Generation
from clawr1.datapool.base import DataPool, PoolFullError
from clawr1.engine.base import Engine
from clawr1.gateway import errors, schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.sessions import SessionResolver, Turn

log = logging.getLogger(__name__)
POLICY = "policy"  # the adapter name the trainer publishes; served when loaded, else the base model
TOOL_OPEN = "<tool_call>"


class Gateway:
    def __init__(self, engine: Engine, pool: DataPool, config: Config):
        self.engine, self.pool, self.config = engine, pool, config
        self.sessions = SessionResolver()
        self.pending = 0  # requests admitted whose steps are not yet handed to the pool

    # ---- request plumbing -----------------------------------------------------------------
    async def read(self, request: Request) -> schema.ChatRequest:
        raw = await request.body()
        if len(raw) > self.config.gateway.max_body_bytes:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of "
                                f"{self.config.gateway.max_body_bytes}", code="request_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        try:
            return schema.ChatRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from exc

    def authenticate(self, request: Request) -> str:
        keys = self.config.gateway.api_keys
        if not keys:
            return DEFAULT_TENANT
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer ") or auth[7:].strip() not in keys:
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return DEFAULT_TENANT

    def admit(self) -> None:
        if self.pending >= self.config.gateway.max_pending:
            raise APIError(429, f"{self.pending} requests are being served or recorded; retry shortly",
                           code="rate_limit_exceeded")
        self.pending += 1

    def record(self, turn: Turn, req: schema.ChatRequest, gen: Generation, step_id: str, started: float) -> None:
        """Hand the step to the pool's bounded queue; the write completes after the reply."""
        step = Step(step_id=step_id, tenant=turn.tenant, session_id=turn.session_id, prompt_id=turn.prompt_id,
                    turn_index=turn.turn_index, turn_type=turn.turn_type, messages=req.messages,
                    tools=req.tool_dicts(), prompt_ids=gen.prompt_ids, token_ids=gen.token_ids,
                    logprobs=gen.logprobs, text=gen.text, policy_version=gen.version, adapter=gen.adapter,
                    finish_reason=gen.finish_reason or "aborted", temperature=gen.temperature,
                    timings={"total_s": time.perf_counter() - started})
        try:
            future = self.pool.submit_step(step)
        except PoolFullError:
            log.error("pool queue full: step %s not recorded", step_id)
            return
        future.add_done_callback(lambda f: _log_failure(f, step_id))

    # ---- chat completions -----------------------------------------------------------------
    async def chat(self, request: Request, path_ids: tuple[str, str] | None) -> Any:
        started = time.perf_counter()
        tenant = self.authenticate(request)
        req = await self.read(request)
        if req.stream and req.n > 1:
            raise APIError(400, "n > 1 is not supported with stream=true", param="n")
        tools = req.tool_dicts()
        prompt_ids = self.engine.render(req.messages, tools)
        samplings = [req.sampling(self.config.engine.default_max_tokens, i) for i in range(req.n)]
        adapter = POLICY if POLICY in self.engine.adapters() else None
        self.admit()
        try:
            streams = [self.engine.generate(prompt_ids, s, adapter) for s in samplings]
        except BaseException:
            self.pending -= 1
            raise
        headers = {k.lower(): v for k, v in request.headers.items()}
        turn = self.sessions.resolve(tenant, req.messages, headers, path_ids)
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(self.stream(req, streams[0], turn, cid, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            gens = await asyncio.gather(*[s.final() for s in streams])
        finally:
            for s in streams:
                s.cancel()
            self.pending -= 1
        parsed = [self.engine.parse(g.content) for g in gens]
        for i, gen in enumerate(gens):
            self.record(turn, req, gen, f"{cid}-{i}", started)
        self.sessions.record(turn, req.messages, schema.message_of(parsed[0]))
        return JSONResponse(schema.completion_body(cid, req.model, gens, parsed, req.logprobs, self.engine.tokenizer))

    async def stream(self, req: schema.ChatRequest, stream: Any, turn: Turn, cid: str,
                     started: float) -> AsyncIterator[str]:
        """SSE: role chunk, content deltas (tool-call markup held back), tool calls, finish, usage."""
        version = stream.version
        sent = ""  # content already streamed
        logprobs: list[dict[str, Any]] = []  # entries not yet sent (their text may be held back)
        watch_tools = req.tool_dicts() is not None
        keepalive = self.config.gateway.keepalive_s
        gen: Generation | None = None
        step: asyncio.Future | None = None
        try:
            yield _sse(schema.chunk(cid, req.model, version, {"role": "assistant", "content": ""}))
            iterator = stream.__aiter__()
            visible = ""
            while True:
                step = asyncio.ensure_future(iterator.__anext__())
                while not step.done():
                    done, _ = await asyncio.wait({step}, timeout=keepalive)
                    if not done:  # queued behind other requests: an empty delta resets client idle timers
                        yield _sse(schema.chunk(cid, req.model, version, {}))
                try:
                    event = step.result()
                except StopAsyncIteration:
                    break
                visible += event.text
                if req.logprobs:
                    logprobs.append(schema.token_logprob(self.engine.tokenizer.decode([event.token_id]), event.logprob))
                delta = _safe_text(visible, sent, watch_tools)
                if delta:
                    sent += delta
                    lp, logprobs = ({"content": logprobs} if logprobs else None), []
                    yield _sse(schema.chunk(cid, req.model, version, {"content": delta}, logprobs=lp))
            gen = stream.generation
            parsed = self.engine.parse(gen.content)
            if parsed.tool_calls:
                calls = schema.message_of(parsed)["tool_calls"]
                yield _sse(schema.chunk(cid, req.model, version,
                                        {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
            elif len(gen.content) > len(sent):
                yield _sse(schema.chunk(cid, req.model, version, {"content": gen.content[len(sent):]}))
            yield _sse(schema.chunk(cid, req.model, version, {}, finish=schema.finish_reason(gen, parsed),
                                    logprobs={"content": logprobs} if logprobs else None))
            if req.stream_options and req.stream_options.include_usage:
                body = schema.chunk(cid, req.model, version, {})
                body["choices"], body["usage"] = [], schema.usage(len(gen.prompt_ids), len(gen.token_ids))
                yield _sse(body)
            yield "data: [DONE]\n\n"
            self.sessions.record(turn, req.messages, schema.message_of(parsed))
        finally:
            # Normal end, client disconnect (the generator is closed) or error: stop the engine and
            # record what was sampled; an interrupted step is stored as `aborted`.
            stream.cancel()
            self.pending -= 1
            if step is not None and not step.done():
                step.cancel()
            if gen is None:
                gen = await stream.final()
            self.record(turn, req, gen, f"{cid}-0", started)


def _log_failure(future: Any, step_id: str) -> None:
    if future.exception() is not None:
        log.error("recording %s failed: %s", step_id, future.exception())


def _sse(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"


def _safe_text(visible: str, sent: str, watch_tools: bool) -> str:
    """New content that is safe to stream: with tools on, nothing from a `<tool_call>` on (and no
    suffix that could start one), since it may turn into a structured tool call at the end."""
    end = len(visible)
    if watch_tools:
        at = visible.find(TOOL_OPEN)
        if at >= 0:
            end = at
        else:
            for n in range(min(len(TOOL_OPEN) - 1, end), 0, -1):
                if visible.endswith(TOOL_OPEN[:n]):
                    end -= n
                    break
    return visible[len(sent):end] if end > len(sent) else ""


def create_app(engine: Engine, pool: DataPool, config: Config) -> FastAPI:
    app = FastAPI(title="Claw-R1 gateway", docs_url=None, redoc_url=None)
    gateway = Gateway(engine, pool, config)
    app.state.gateway = gateway
    errors.install(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "adapters": engine.adapters()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.authenticate(request)
        ids = [config.engine.model] + sorted(engine.adapters())
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "clawr1"} for i in ids]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await gateway.chat(request, None)

    @app.post("/{session_id}/{prompt_id}/v1/chat/completions")
    async def chat_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
        return await gateway.chat(request, (session_id, prompt_id))

    return app
