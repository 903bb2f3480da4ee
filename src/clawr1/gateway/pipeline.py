"""One request pipeline for every wire format: read and validate -> authenticate -> prepare (render,
context check) -> admit -> generate -> resolve the session -> stream or collect -> record ->
release.

A wire format (`Wire`: chat, completions, Anthropic Messages, Responses) supplies only its parse
(`prepare`) and render functions (`body`, `events`, its error shapes). Everything that must hold
on every path lives here once:

- nothing is admitted before the whole request validated, so an invalid request never reaches the
  engine or the pool;
- the admission ticket is taken and released inside one coroutine (`Exchange.__call__`) whose
  `finally` every path passes through: success, client disconnect, timeout, engine error,
  recording error, a bug. When a request ended with its steps recorded, the release is done
  there and then (nothing left to await); otherwise it runs in a task of its own, so even a
  cancelled request cannot skip it;
- no exception leaves the ASGI call: before the response started, it is answered in the route's
  error shape; after, the stream ends with the format's error event and a clean end of body;
- with `gateway.durable_reply`, the step is committed before the reply's last byte (the JSON body,
  or the final SSE events), so a reply the client saw is never lost to a crash.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from clawr1.core.records import Step
from clawr1.core.types import ContextLengthError, EngineError, Generation, ParsedCompletion, SamplingParams, TokenEvent
from clawr1.datapool.schema import dumps as stored_json
from clawr1.engine.base import GenerationStream
from clawr1.gateway import schema
from clawr1.gateway.body import read_json
from clawr1.gateway.errors import APIError, public, validate
from clawr1.gateway.memory import Recall
from clawr1.gateway.service import Caller, Gateway, Ticket, client_of
from clawr1.gateway.sessions import Turn
from clawr1.gateway.stream_text import safe_text
from clawr1.gateway.streaming import TimedOut, events

log = logging.getLogger(__name__)
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class Stalled(Exception):
    """The client took no data for `gateway.send_timeout_s`, or past the request's deadline."""


@dataclass
class Job:
    """A validated request, ready to run: what `Wire.prepare` returns."""

    req: Any  # the wire's validated request model, for rendering
    reply_id: str  # `chatcmpl-...`, `cmpl-...`, `msg_...`, `resp_...`: prefixes the step ids
    prompts: list[list[int]]  # one turn per prompt (several only on /v1/completions)
    samplings: list[SamplingParams]  # one choice per sampling, for every prompt
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat-shaped, stored with the step
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    watch_tools: bool = False  # hold back tool-call markup while streaming
    affinity: str | None = None  # keeps a session on one engine replica
    base: bool = False  # `X-Policy-Version: 0` on a side turn: the base model answers (evaluation)
    created: int = field(default_factory=lambda: int(time.time()))
    # The user's memory (`gateway/memory.py`): the messages as served, system prompt with the memory
    # (what the step stores; `messages` stay the client's, which sessions are matched by), and its record.
    recall: Recall | None = None

    def stored_bytes(self) -> int:
        """About what this request's steps add to the pool before their replies: each stores the
        messages and tools (as rendered: see `schema`) and its prompt's token ids (4 bytes each)."""
        shared = len(_compact(self.messages)) + (len(_compact(self.tools)) if self.tools else 0)
        return len(self.samplings) * sum(shared + 4 * len(prompt) for prompt in self.prompts)


_compact = stored_json  # as the pool stores JSON (its encoder built once, not one a call)


class Wire(ABC):
    """A wire format: its request model, how it turns into a `Job`, and how replies and errors look."""

    request_model: type[BaseModel]

    def token(self, request: Request) -> str:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth.startswith("Bearer ") else ""

    def messages(self, req: Any) -> list[dict[str, Any]]:
        """The request's conversation, chat-shaped (what sessions are matched and recorded by)."""
        return req.chat_messages()

    @abstractmethod
    def prepare(self, gw: Gateway, req: Any, caller: Caller, headers: dict[str, str],
                path_ids: tuple[str, str] | None) -> Job:
        """The request as a `Job`: translated, rendered and context-checked; raise 400s here."""

    @abstractmethod
    def body(self, ex: Exchange, gens: list[Generation], parsed: list[ParsedCompletion]) -> dict[str, Any]: ...

    @abstractmethod
    def events(self, ex: Exchange) -> AsyncIterator[str]:
        """The SSE events of a streamed reply; `await ex.finish()` records the step (and, with
        `durable_reply`, commits it) and must come before the last events."""

    def error_body(self, exc: APIError | EngineError) -> dict[str, Any]:
        return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}

    @abstractmethod
    def stream_error(self, ex: Exchange, exc: APIError | EngineError) -> str:
        """The event that ends a stream which failed after it started."""

    def error_response(self, exc: APIError | EngineError) -> JSONResponse:
        return JSONResponse(self.error_body(exc), status_code=exc.status)


async def handle(request: Request, wire: Wire, path_ids: tuple[str, str] | None, bare: bool = False,
                 session: str | None = None) -> Response:
    """The route handler every generation route calls: validation here, the rest in `Exchange`.
    `bare`: a route with path ids and no /v1 (`/{session}/{prompt}/chat/completions`), which would
    also catch a /v1 URL under a prefix (`/api/v1/chat/completions`); an id "v1" is such a URL: 404.
    `session`: a session the URL names by itself (rLLM's `/sessions/{id}/v1`), taken as the
    `X-Session-Id` header would be (its turns are numbered and grouped as any online session's)."""
    gw: Gateway = request.app.state.gateway
    try:
        if bare and path_ids is not None and "v1" in path_ids:
            raise APIError(404, f"no route {request.url.path}", code="unknown_route")
        if path_ids is not None:
            for name, value in zip(("session_id", "prompt_id"), path_ids):
                schema.check_id(value, name)
        caller = await gw.caller(wire.token(request), client_of(request))
        body = await read_json(request, gw.config.gateway.max_body_bytes, gw.config.gateway.max_json_depth)
        req = validate(wire.request_model, body)
        headers = body_session_fields(body, {k.lower(): v for k, v in request.headers.items()})
        if not caller.rates:  # an agent's session key does not decide its session's end (its last turn's fate)
            headers.pop("x-session-done", None)
        if session is not None:
            headers["x-session-id"] = session
        if headers.get("x-session-id") is not None:
            schema.check_id(headers["x-session-id"], "X-Session-Id")
        named = path_ids[0] if path_ids is not None else headers.get("x-session-id")
        if caller.session_id is not None and named is not None and named != caller.session_id:
            # A per-session key's requests belong to its session, whatever they name (as on /close).
            raise APIError(403, "this session key belongs to another session", code="permission_denied")
        job = wire.prepare(gw, req, caller, headers, path_ids)
        job.base = _wants_base(gw, caller, headers)
        check_context(gw, job)
        gw.check_storage(caller.tenant, job.stored_bytes())
    except (APIError, EngineError) as exc:
        return wire.error_response(public(exc))
    return Exchange(gw, wire, job, caller, headers, path_ids)


def check_context(gw: Gateway, job: Job) -> None:
    """Every prompt of `job` leaves room for at least one completion token, else 400."""
    for prompt in job.prompts:
        if len(prompt) >= gw.engine.max_context:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; this model's context is {gw.engine.max_context} "
                "and at least one completion token must fit", "messages" if job.messages else "prompt")


def _internal(exc: Exception) -> APIError:
    return APIError(500, f"internal error ({type(exc).__name__}); see the server log", code="internal_error")


# OpenClaw-RL's clients name the session in the body as well as in headers: the same three fields.
BODY_SESSION_FIELDS = (("session_id", "x-session-id"), ("turn_type", "x-turn-type"),
                       ("session_done", "x-session-done"))


def body_session_fields(body: Any, headers: dict[str, str]) -> dict[str, str]:
    """`headers` (lower-cased) with `session_id`, `turn_type` and `session_done` from the request
    body added as the `X-Session-Id`, `X-Turn-Type` and `X-Session-Done` headers they stand for;
    a header that is there wins. A field of the wrong type is a 400."""
    if not isinstance(body, dict):
        return headers
    for name, header in BODY_SESSION_FIELDS:
        value = body.get(name)
        if value is None or header in headers:
            continue
        if name == "session_done" and isinstance(value, bool):
            value = "true" if value else "false"
        elif name == "session_id" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise APIError(400, f"{name} must be a {'boolean' if name == 'session_done' else 'string'}",
                           param=name, code="invalid_type")
        headers[header] = value
    return headers


class Exchange(Response):
    """One admitted request, from admission to release. A Starlette response whose `__call__` runs
    the generation itself, so the admission ticket never outlives the ASGI call that took it."""

    def __init__(self, gw: Gateway, wire: Wire, job: Job, caller: Caller, headers: dict[str, str],
                 path_ids: tuple[str, str] | None):
        self.gw, self.wire, self.job, self.caller = gw, wire, job, caller
        self.headers_in, self.path_ids = headers, path_ids
        self.background = None
        self.started = time.perf_counter()
        self.streams: list[GenerationStream] = []
        self.turns: list[Turn] = []
        self.recorded = False
        self.gone = False  # the client disconnected (or took no data in time: `stalled`)
        self.stalled = False
        self.response_started = self.response_done = False
        self._ticket: Ticket | None = None
        self.status_code = 500  # the status sent (`HotRoutes` counts it): 500 until a response starts
        self.state: Any = None  # a wire format's own per-stream state (Responses: its event counter)
        self._held: list[str] = []  # stream events not sent yet: the engine had the next one ready
        self._head: dict[str, Any] | None = None  # a stream's `http.response.start`, until its first events
        self.deadline = 0.0  # the loop's time past which the request is cut short (`request_timeout_s`)

    @property
    def n(self) -> int:
        return len(self.job.samplings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        self.deadline = asyncio.get_running_loop().time() + self.gw.config.gateway.request_timeout_s
        watcher: asyncio.Future[None] | None = None
        try:
            self._ticket = self.gw.admission.acquire(len(self.job.prompts) * self.n, self.caller.tenant)
            self.streams = self._start()
            self.turns = [await self.gw.resolve(self.caller, self.job.messages, self.headers_in, self.path_ids)
                          for _ in self.job.prompts]
            watcher = asyncio.ensure_future(self._watch(receive))
            if self.job.stream:
                await self._stream()
            else:
                await self._respond(watcher)
        except (APIError, EngineError) as exc:  # refused (429), or the engine failed (502)
            await self._error(public(exc))
        except Stalled:  # the client did not take what was sent in time: as if it had gone
            log.warning("%s: the client took no data for %s s (or past the deadline); dropped", self.job.reply_id,
                        self.gw.config.gateway.send_timeout_s)
        except Exception as exc:  # a bug: answered in the route's shape, never a dropped connection
            log.exception("unhandled error serving %s", self.job.reply_id)
            await self._error(_internal(exc))
        finally:
            if watcher is not None:
                watcher.cancel()
            if not self._settled_at_once():
                # A task of its own: if this call is cancelled, the settle (and the release) runs on.
                await asyncio.shield(self.gw.spawn(self._settle()))

    # ---- generation ----------------------------------------------------------------------
    def _start(self) -> list[GenerationStream]:
        adapter = None if self.job.base else self.gw.served_adapter(self.caller.tenant)
        streams: list[GenerationStream] = []
        try:
            for prompt in self.job.prompts:
                for sampling in self.job.samplings:
                    stream = self.gw.engine.generate(prompt, sampling, adapter, self.job.affinity)
                    streams.append(self.gw.metrics.timed(stream))
        except BaseException:
            for stream in streams:  # nothing was served: stop what started, record nothing
                stream.cancel()
            raise
        return streams

    async def _watch(self, receive: Receive) -> None:
        """Stop the engine the moment the client goes away (the body is read: only
        `http.disconnect` is left to receive)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        for stream in self.streams:
            stream.cancel()

    def tokens(self, i: int = 0) -> AsyncIterator[TokenEvent | None]:
        """Stream i's tokens, None for a keep-alive tick; raises `TimedOut` past the deadline.
        `events` itself, not a generator around it: each layer costs every token a hop."""
        config = self.gw.config.gateway
        return events(self.streams[i], config.keepalive_s, config.request_timeout_s)

    async def deltas(self) -> AsyncIterator[str | None]:
        """Content that is safe to show as it is sampled (tool-call markup held back), None for a
        keep-alive tick."""
        sent = visible = ""
        async for event in self.tokens():
            if event is None:
                yield None
                continue
            visible += event.text
            delta = safe_text(visible, sent, self.job.watch_tools)
            if delta:
                sent += delta
                yield delta

    async def finish(self) -> tuple[Generation, ParsedCompletion]:
        """Streaming, after the last token: the generation, parsed and recorded (committed first
        with `durable_reply`)."""
        await self._flush()  # the last tokens before the commit, not after it
        gen = await self.streams[0].final()  # drained: returns at once (the Engine contract)
        parsed = self.gw.engine.parse(gen.content, self.job.tools)
        await self.record([gen], [parsed])
        return gen, parsed

    async def _collect(self, watcher: asyncio.Future[None]) -> tuple[list[Generation], str]:
        """Whole generations, or the outcome `disconnected` / `timeout` (the work is cancelled)."""
        # One stream (n = 1, the common case) needs no gather around it.
        finals = asyncio.ensure_future(self.streams[0].final() if len(self.streams) == 1
                                       else asyncio.gather(*[s.final() for s in self.streams]))
        done, _ = await asyncio.wait({finals, watcher}, timeout=self.gw.config.gateway.request_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if finals in done:
            return [finals.result()] if len(self.streams) == 1 else list(finals.result()), "ok"
        for stream in self.streams:
            stream.cancel()
        await finals
        return [], "disconnected" if watcher in done else "timeout"

    # ---- recording -----------------------------------------------------------------------
    async def record(self, gens: list[Generation], parsed: list[ParsedCompletion],
                     render: Callable[[], bytes] | None = None) -> bytes | None:
        """Hand every step to the pool (room was reserved at admission), teach the history matcher
        the reply, and with `durable_reply` wait for the commit (a failed commit raises 503).
        `render`: the reply's body, made while the pool's writer commits (it is returned)."""
        futures = self._submit(gens)
        rendered = render() if render is not None else None
        if self.gw.config.gateway.durable_reply:
            try:
                await committed(futures)
            except Exception as exc:  # its text (a path, the database's words) is the log's, not the client's
                log.error("%s: the data pool could not store the reply: %r", self.job.reply_id, exc)
                raise APIError(503, "the data pool could not store this reply; nothing was kept, retry",
                               code="pool_unavailable") from exc
        # After the commit: a reply the client never gets (503) must not be matched as history.
        if parsed and self.job.messages:
            self.gw.sessions.record(self.turns[0], self.job.messages, schema.message_of(parsed[0]))
        return rendered

    def _submit(self, gens: list[Generation]) -> list[Any]:
        self.recorded = True
        futures = []
        recall = self.job.recall
        messages, memory = (self.job.messages, None) if recall is None else (recall.messages, recall.record)
        for index, gen in enumerate(gens):
            turn = self.turns[index // self.n]
            self.gw.metrics.generation_done(gen)
            step = Step(step_id=f"{self.job.reply_id}-{index}", tenant=turn.tenant, session_id=turn.session_id,
                        prompt_id=turn.prompt_id, turn_index=turn.turn_index, turn_type=turn.turn_type,
                        messages=messages, tools=self.job.tools, prompt_ids=gen.prompt_ids,
                        token_ids=gen.token_ids, logprobs=gen.logprobs, text=gen.text, policy_version=gen.version,
                        adapter=gen.adapter, finish_reason=gen.finish_reason or "aborted",
                        temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                        timings={"total_s": time.perf_counter() - self.started}, memory=memory)
            try:
                future = self.gw.pool.submit_step(step)
            except Exception as exc:  # noqa: BLE001 - refused at once (queue or disk full): a failed write like any other
                future = concurrent.futures.Future()
                future.set_exception(exc)
            future.add_done_callback(lambda f, sid=step.step_id: _log_failure(f, sid))
            futures.append(future)
        if self._ticket is not None:
            self._ticket.release()  # handed to the pool's queue: its room is the queue's now
        return futures

    def _settled_at_once(self) -> bool:
        """The common end (every step recorded, no session to close): `_settle` would not await
        anything, so it runs here and now, without a task of its own. False: nothing was done."""
        if not self.recorded or any(turn.done for turn in self.turns):
            return False
        for stream in self.streams:
            stream.cancel()  # a no-op for finished streams
        if self._ticket is not None:
            self._ticket.release()  # a no-op when `_submit` got through; not when it failed half-way
        return True

    async def _settle(self) -> None:
        """Every path ends here: stop the engine, record what was sampled and not yet recorded
        (as `aborted` when cut short), close an `X-Session-Done` session, release the ticket."""
        try:
            for stream in self.streams:
                stream.cancel()  # a no-op for finished streams
            if self.streams and not self.recorded:
                gens = await asyncio.gather(*[stream.final() for stream in self.streams], return_exceptions=True)
                if len(self.turns) < len(self.job.prompts):
                    # The session lookup failed after generation started: no session to file the
                    # steps under, and the client got that error.
                    log.warning("%s: the session could not be resolved; nothing to record", self.job.reply_id)
                elif all(isinstance(g, Generation) for g in gens):
                    self._submit(gens)  # type: ignore[arg-type]
                else:  # the engine failed: there is no generation to store
                    log.warning("%s: the engine failed; nothing to record", self.job.reply_id)
            for turn in self.turns:
                if turn.done:  # queued behind the steps, so the last turn is stored first
                    await self.gw.close_session(turn.tenant, turn.session_id, None, "done")
        finally:
            if self._ticket is not None:
                self._ticket.release()

    # ---- answering -----------------------------------------------------------------------
    async def _respond(self, watcher: asyncio.Future[None]) -> None:
        gens, outcome = await self._collect(watcher)
        if outcome == "disconnected":
            await self._send_body(499, b"", [])  # nobody is listening; the steps are stored as aborted
            return
        if outcome == "timeout":
            await self._error(APIError(504, f"the engine did not finish within "
                                            f"{self.gw.config.gateway.request_timeout_s} s", code="timeout"))
            return
        parsed = [self.gw.engine.parse(g.content, self.job.tools) for g in gens]
        body = await self.record(gens, parsed, lambda: json_body(self.wire.body(self, gens, parsed)))
        assert body is not None
        await self._send_body(200, body, [(b"content-type", b"application/json")])

    async def _stream(self) -> None:
        self.status_code = 200
        # The head goes out with the first events (`_out`), as aiohttp sends its headers: the role
        # event is ready at once, so a client sees them no later, and is woken once for both.
        self._head = {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
        self.response_started = True
        chunks = self.wire.events(self)
        # Events are held while the engine's next one is already there (`ready`), and the ones
        # held go out in one write: a burst of tokens costs one send, not one each. Any event the
        # engine made us wait for goes out at once, and `finish` sends what is held before it
        # waits for the commit, so no sampled text waits on the pool.
        try:
            async for chunk in chunks:
                if self.gone:
                    break
                self._held.append(chunk)
                if not self.streams[0].ready():
                    await self._flush()
        except TimedOut:
            self._held.append(self.wire.stream_error(self, APIError(
                504, f"the engine did not finish within {self.gw.config.gateway.request_timeout_s} s", code="timeout")))
        except (APIError, EngineError) as exc:
            self._held.append(self.wire.stream_error(self, public(exc)))
        except Stalled:
            raise
        except Exception:  # a bug: what was ready before it still goes out, then its error event
            await self._flush()
            raise
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        # The last events go with the end of the body, in one message: one write, not two (the
        # bytes on the wire are the same). Each write is a send on the socket: profiled, a quarter
        # of a streamed reply's time was in uvicorn's `send`.
        text, self._held = "".join(self._held), []
        await self._end(text)

    async def _flush(self) -> None:
        """Send the held events in one write (none once the client is gone)."""
        if self._held and not self.gone:
            text, self._held = "".join(self._held), []
            await self._chunk(text)

    async def _chunk(self, text: str) -> None:
        await self._out({"type": "http.response.body", "body": text.encode(), "more_body": True})

    async def _end(self, text: str = "") -> None:
        """The end of the body, after `text` (none once the client is gone)."""
        if not self.response_done and not self.gone:
            self.response_done = True
            await self._out({"type": "http.response.body", "body": text.encode(), "more_body": False})

    async def _send_body(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        headers = headers + [(b"content-length", str(len(body)).encode())]
        self.status_code = status
        self.response_started = self.response_done = True
        await self._out({"type": "http.response.start", "status": status, "headers": headers},
                        {"type": "http.response.body", "body": body, "more_body": False})

    async def _out(self, *messages: dict[str, Any]) -> None:
        """Send `messages`, waiting for the client to take them at most `send_timeout_s` and never
        past the request's deadline: a client that reads nothing (its socket's buffers full) would
        otherwise hold its admission slot for ever. Past either it is taken as gone (`Stalled`).
        One timer handle for the lot, not a timeout context per message (a third of the cost)."""
        if self._head is not None:  # a stream's head, not sent yet: first
            messages, self._head = (self._head, *messages), None
        loop = asyncio.get_running_loop()
        until = min(self.deadline, loop.time() + self.gw.config.gateway.send_timeout_s)
        timer = loop.call_at(until, self._stall, asyncio.current_task())
        try:
            for message in messages:
                await self._send(message)
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            raise Stalled from None
        finally:
            timer.cancel()

    def _stall(self, task: asyncio.Task | None) -> None:
        self.stalled = self.gone = True
        for stream in self.streams:
            stream.cancel()
        if task is not None:
            task.cancel()

    async def _error(self, exc: APIError | EngineError) -> None:
        """Before the response started: the route's error shape. After (a stream): its error
        event, then the end of the body."""
        if self.gone:
            return  # nobody to tell (a bug after a stall is still logged by the caller)
        if not self.response_started:
            body = json_body(self.wire.error_body(exc))
            await self._send_body(exc.status, body, [(b"content-type", b"application/json")])
        elif not self.response_done:
            await self._chunk(self.wire.stream_error(self, exc))
            await self._end()


def committed(futures: list[concurrent.futures.Future]) -> asyncio.Future[None]:
    """A future of the running loop, done when every one of the pool's `futures` is (with the
    first error, if any). It stands for `asyncio.shield(asyncio.wrap_future(f))` (or a gather of
    those), which cost a plain request two futures, a task-free shield and three callbacks a hop
    (measured, ~5% of its CPU). A request cancelled while it waits (shutdown, a hang-up) cancels
    only this future, never the pool's, which the writer must still resolve: what the shield was
    for. The pool's futures resolve in its writer thread: one `call_soon_threadsafe` each."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    left = len(futures)

    def arrived(future: concurrent.futures.Future) -> None:  # on the loop
        nonlocal left
        left -= 1
        if waiter.done():  # cancelled, or an earlier future failed
            return
        error = asyncio.CancelledError() if future.cancelled() else future.exception()
        if error is not None:
            waiter.set_exception(error)
        elif not left:
            waiter.set_result(None)

    def done(future: concurrent.futures.Future) -> None:  # in the writer's thread (or at once, if done)
        if not loop.is_closed():
            loop.call_soon_threadsafe(arrived, future)

    for future in futures:
        future.add_done_callback(done)
    return waiter


# `json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))`, its C encoder
# built once instead of a JSONEncoder and a C encoder on every call (as `datapool.schema.dumps`);
# no circular-reference check (a cycle is a RecursionError, not a ValueError).
_reply_encoder = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, json.JSONEncoder().default, json.encoder.encode_basestring, None, ":", ",", False, False, False)
_reply_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def json_body(content: Any) -> bytes:
    """What `JSONResponse(content).body` is, without building the response around it."""
    if _reply_encoder:
        return "".join(_reply_encoder(content, 0)).encode()
    return _reply_json(content).encode()  # no C encoder (another Python)


def _wants_base(gw: Gateway, caller: Caller, headers: dict[str, str]) -> bool:
    """`X-Policy-Version`: which version answers a side turn, so an evaluation can compare the base
    (`0`) with what is served on the same prompts. Only the base and the served version exist to
    ask for; main turns always get the served version (they are trained on)."""
    asked = headers.get("x-policy-version")
    if asked is None:
        return False
    if headers.get("x-turn-type", "main").strip().lower() != "side":
        raise APIError(400, "X-Policy-Version is only for side turns (X-Turn-Type: side): main turns are trained on "
                            "and always get the served version", param="X-Policy-Version")
    served = gw.served_version(caller.tenant)
    if asked.strip() not in ("0", str(served)):
        raise APIError(404, f"policy version {asked.strip()!r} is not served (the base is 0, the served one {served})",
                       param="X-Policy-Version", code="version_not_found")
    return asked.strip() == "0"


def _log_failure(future: Any, step_id: str) -> None:
    if future.exception() is not None:
        log.error("recording %s failed: %s", step_id, future.exception())
