"""The local engine: PyTorch + transformers (+ peft), continuous batching on one scheduler thread.

One thread owns the model. Callers on the asyncio side submit work through a command queue and
read results from per-request asyncio queues, so the event loop never runs a forward pass.
Each loop iteration: run queued commands (adapter loads, scores), admit waiting requests (batch-1
prefill, then join the running batch), and decode one token for every running sequence. A prompt
longer than `prefill_chunk` is prefilled a chunk per iteration, so the running streams, a cancel
and `close()` never wait for a whole long prompt (nor does a weights load cut one in two: it waits
for it). A request never waits for another to finish, only for a free slot when `max_batch` are
running. A prompt that extends a recent one under the same weights starts from its cached KV
(engine/prefix.py) and prefills only the rest; after new weights, the scheduler's idle time
re-prefills the prompts the replaced version had cached (`engine.prefix_rewarm`).

Adapters live in peft "slots" (engine/slots.py); a batch mixes them per row through peft's
`adapter_names` (`__base__` = adapter disabled). A swap puts the new version into a slot beside
the old one, then flips the name -> (slot, version) map under a lock: requests already submitted
keep the slot they resolved, new ones get the new one, and the old slot is released (reused by a
later version) once no request holds it.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import queue
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from clawr1.core.config import EngineConfig
from clawr1.core.types import (
    AdapterError,
    ContextLengthError,
    EngineFailure,
    EngineOverloadedError,
    Generation,
    InvalidRequestError,
    SamplingParams,
    UnknownAdapterError,
)
from clawr1.engine import adapters as store
from clawr1.engine.batch import KVBatch
from clawr1.engine.frontend import Frontend, model_json
from clawr1.engine.prefix import PrefixCache
from clawr1.engine.requests import LocalStream, Prefill, Request, Rewarm
from clawr1.engine.sampling import processed_logprobs, sample
from clawr1.engine.slots import AdapterSlots, Read
from clawr1.engine.text import Advance
from clawr1.engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXIT_JOIN_S = 60.0  # at interpreter exit, the longest wait for the step in progress to end


class LocalEngine(Frontend):
    """Serves one HF causal LM on this machine. Build with `LocalEngine.load(path, config)`."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, generation: dict[str, Any] | None = None):
        """`generation`: the model directory's `generation_config.json` (end-of-turn ids, the
        recommended sampling); without it, the loaded model's end-of-turn ids and no sampling advice."""
        self.config = config
        if generation is None:
            generation = {"eos_token_id": getattr(model.generation_config, "eos_token_id", None)}
        self.hold(tokenizer, config.max_context or int(getattr(model.config, "max_position_embeddings", 2048)),
                  generation)
        self._base = model.eval()
        self._slots = AdapterSlots(self._base)
        self._adapters: dict[str, tuple[str, int]] = {}  # name -> (peft key, version)
        self._retired: set[str] = set()
        self._holds: collections.Counter[str] = collections.Counter()  # slot -> requests using it
        self._lock = threading.Lock()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._prefill: Prefill | None = None  # the request being admitted, chunk by chunk
        self._batch = KVBatch(self._base.device)
        self._prefix = PrefixCache(config.prefix_cache_mb * 2**20)
        self._rewarm: collections.deque[Rewarm] = collections.deque()  # idle-time work, oldest first
        self._pending = 0  # submitted but not yet finished, for backpressure
        self._seeds = random.Random()
        self._weights_version = 0
        self._weights_pending: tuple[dict[str, torch.Tensor], int, list[Future]] | None = None
        self._closed = False
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="clawr1-engine", daemon=True)
        self._thread.start()
        atexit.register(self._stop, EXIT_JOIN_S)

    @classmethod
    def load(cls, path: Path, config: EngineConfig) -> LocalEngine:
        if config.threads:
            torch.set_num_threads(config.threads)
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[config.dtype]).to(config.device)
        generation = {"eos_token_id": getattr(model.generation_config, "eos_token_id", None),
                      **model_json(Path(path), "generation_config.json")}
        return cls(model, tokenizer, config, generation)

    # ---- the contract (render and parse: `Frontend`) ---------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None = None,
                 affinity: str | None = None) -> LocalStream:
        """Start a generation. Bad input raises here, before anything streams."""
        if self._closed:
            raise EngineFailure("the engine is closed")
        self._check_prompt(prompt_ids)
        room = self.room(prompt_ids)
        if self._pending >= self.config.max_queue + self.config.max_batch:
            raise EngineOverloadedError(f"the engine has {self._pending} requests in flight; retry shortly")
        key, version = self._resolve(adapter)
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        loop = asyncio.get_running_loop()
        request = Request(
            prompt_ids=list(prompt_ids), sampling=sampling, key=key,
            gen=Generation(prompt_ids=list(prompt_ids), adapter=adapter, version=version, **sampling.recorded),
            loop=loop, out=asyncio.Queue(), generator=torch.Generator().manual_seed(seed),
            advance=Advance(self.tokenizer, self.eos_ids, sampling.stop, min(sampling.max_tokens, room)),
        )
        with self._lock:
            self._pending += 1
        self._commands.put(lambda: self._waiting.append(request))
        return LocalStream(request)

    async def score(self, prompt_ids: list[int], completion_ids: list[int], adapter: str | None = None,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
        """Teacher-forced logprob of each completion token given the prompt (and what precedes it),
        under the distribution `temperature`, `top_k` and `top_p` sample from (`engine/sampling.py`),
        with each completion token kept in it: a token the settings would have cut is scored, not
        impossible. A sample's own settings reproduce its logprobs exactly."""
        self._check_prompt(prompt_ids)
        if not completion_ids:
            raise InvalidRequestError("completion_ids must not be empty", "completion_ids")
        if len(prompt_ids) + len(completion_ids) > self.max_context:
            raise ContextLengthError(f"prompt + completion exceed the context of {self.max_context} tokens")
        if not 0 < temperature <= 2:
            raise InvalidRequestError(f"temperature must be in (0, 2], got {temperature}", "temperature")
        key, _ = self._resolve(adapter)
        try:
            return await self._call(lambda: self._score(prompt_ids, completion_ids, key, temperature, top_k, top_p))
        finally:
            self._release_hold(key)

    async def load_adapter(self, name: str, path: Path) -> int:
        """Load a published adapter directory under `name`; returns its version. Atomic swap."""
        meta = store.read_marker(Path(path))
        version = int(meta["version"])
        read = await asyncio.to_thread(AdapterSlots.read, Path(path))  # the disk, off the scheduler thread
        await self._call(lambda: self._load(name, Path(path), version, read))
        return version

    async def load_weights(self, path: Path) -> int:
        """Full fine-tuning: the scheduler stops admitting, lets the running batch finish on the old
        weights, copies the new ones in, and resumes; queued requests wait, none fail.

        A load queued while another still waits for the batch to drain joins it: the newest version
        of the two is the one copied in (copying the older first would only be overwritten), and
        every caller gets the version that was applied (or the error that stopped it)."""
        if self._closed:
            raise EngineFailure("the engine is closed")
        version = int(store.read_weights_marker(Path(path))["version"])
        state = await asyncio.to_thread(load_file, str(Path(path) / "model.safetensors"))
        future: Future = Future()
        self._commands.put(lambda: self._queue_weights(state, version, future))
        return await asyncio.wrap_future(future)

    def weights_version(self) -> int:
        return self._weights_version

    async def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded", "model")
            key, _ = self._adapters.pop(name)
        await self._call(lambda: self._retire(key))

    @property
    def rewarming(self) -> int:
        """Prompts still to re-prefill under new weights (`engine.prefix_rewarm`)."""
        return len(self._rewarm)

    def adapters(self) -> dict[str, int]:
        with self._lock:
            return {name: version for name, (_, version) in self._adapters.items()}

    async def close(self) -> None:
        self._closed = True  # new requests are refused from here on, not once the thread is reached
        await asyncio.to_thread(self._stop)
        atexit.unregister(self._stop)  # a closed engine is not kept alive for exit

    def _stop(self, timeout: float | None = None) -> None:
        """Stop the scheduler thread after its step in progress: on `close()`, and at interpreter exit
        when `close()` did not end. A daemon thread still in a forward pass when Python finalizes
        is unwound inside torch's C++ code and the process aborts (SIGABRT, "terminate called
        without an active exception"): what a process interrupted before `close()` ended did."""
        self._closed = True
        self._commands.put(lambda: None)
        self._thread.join(timeout=timeout)

    # ---- helpers on the caller's side ---------------------------------------------------
    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self._base.config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")

    def _resolve(self, adapter: str | None) -> tuple[str, int]:
        if adapter is None:
            return BASE, self._weights_version
        with self._lock:
            if adapter not in self._adapters:
                raise UnknownAdapterError(f"adapter {adapter!r} is not loaded (loaded: {sorted(self._adapters)})", "model")
            # Held from resolution on, so a swap racing this request cannot recycle its slot.
            self._holds[self._adapters[adapter][0]] += 1
            return self._adapters[adapter]

    def _release_hold(self, key: str) -> None:
        if key != BASE:  # the base model is never released, so it is not counted
            with self._lock:
                self._holds[key] -= 1

    async def _call(self, fn: Callable[[], Any]) -> Any:
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting caller, not swallowed
                future.set_exception(exc)

        self._commands.put(run)
        return await asyncio.wrap_future(future)

    # ---- the scheduler thread -----------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while not self._closed:
                self._drain(block=not (self._running or self._waiting or self._prefill or self._rewarm))
                try:
                    if self._weights_pending is not None and not self._running and self._prefill is None:
                        self._apply_weights()
                    self._forget_cancelled()
                    self._admit()
                    if self._running:
                        self._step()
                    elif self._rewarm and not (self._waiting or self._prefill or self._weights_pending):
                        self._rewarm_chunk()  # idle: nothing waits or runs
                except Exception as exc:  # a failed decode step fails the batch it ran, not the engine
                    log.exception("engine step failed; failing %d running requests", len(self._running))
                    for request in self._running:
                        if request.gen.finish_reason is None:  # one that finished was answered (and released) already
                            self._settle(request, EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}"))
                    self._running, self._batch = [], KVBatch(self._base.device)
                self._collect_retired()
        self._drain(block=False)  # requests submitted just before close still get an answer
        prefilling = [self._prefill.request] if self._prefill else []
        for request in self._running + prefilling + list(self._waiting):
            request.cancelled = True
            self._finish(request, "aborted")
        if self._weights_pending is not None:  # its callers are answered too, never left waiting
            _answer(self._weights_pending[2], error=EngineFailure("the engine closed before the weights were loaded"))
            self._weights_pending = None

    def _drain(self, block: bool) -> None:
        """Run queued commands; wait for one only when there is nothing to decode."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        command()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _forward(self, keys: list[str], **kwargs: Any) -> Any:
        if self._slots.peft is not None:
            kwargs["adapter_names"] = keys
        return self._slots.model(use_cache=True, **kwargs)

    def _forward_chunk(self, key: str, prompt_ids: list[int], cache: DynamicCache, start: int, end: int) -> Any:
        """Run prompt tokens [start, end) into `cache` (which holds the ones before), under `key`'s weights."""
        ids = torch.tensor([prompt_ids[start:end]], device=self._base.device)
        return self._forward([key], input_ids=ids, cache=cache, logits_to_keep=1,
                             position_ids=torch.arange(start, end, device=ids.device)[None])

    def _live_prefix(self) -> PrefixCache:
        """The prefix cache under the configured budget, read live (as `prefill_chunk` is)."""
        self._prefix.resize(self.config.prefix_cache_mb << 20)
        return self._prefix

    def _forget_cancelled(self) -> None:
        """Queued requests whose clients went away leave the queue now, not when their turn comes
        (with every row busy, that can be long): meanwhile they would count against `max_queue`,
        so new requests were refused, and keep their adapter slot held."""
        if any(request.cancelled for request in self._waiting):
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                self._finish(request, "aborted")

    def _admit(self) -> None:
        while (self._prefill or self._waiting) and len(self._running) < self.config.max_batch and not self._closed:
            if self._weights_pending is not None and self._prefill is None:
                break  # draining: new weights go in once the running batch has finished on the old
            if self._running:  # between two prefills, a queued command (an adapter swap) waits one prefill, not all
                self._drain(block=False)
                if not (self._prefill or self._waiting):
                    break
            if self._prefill is None:
                request = self._waiting.popleft()
                if request.cancelled:
                    self._finish(request, "aborted")
                    continue
                if request.key == BASE:  # it is sampled by the weights of now, whatever it was queued under
                    request.gen.version = self._weights_version
                self._prefill = Prefill(request, None)
            if not self._prefill_chunk():
                break  # a long prompt: the running batch decodes one token before its next chunk
        self._drop_finished()

    def _prefill_chunk(self) -> bool:
        """Prefill the next `prefill_chunk` tokens of the request being admitted; True once it is
        done with (joined the batch, failed, or cancelled), False while chunks remain. Chunks bound
        what one long prompt costs the streams already running, a cancel, and `close()`."""
        prefill, request = self._prefill, self._prefill.request
        if request.cancelled:
            self._prefill = None
            self._finish(request, "aborted")
            return True
        try:
            if prefill.cache is None:  # its first chunk: start from the longest cached prefix, if any
                self._live_prefix()
                prefill.done, cache = self._prefix.lookup(request.key, request.prompt_ids)
                prefill.cache = cache or DynamicCache()
                self.stats["prefix_cached_tokens"] += prefill.done
            start, end = prefill.done, min(prefill.done + self.config.prefill_chunk, len(request.prompt_ids))
            out = self._forward_chunk(request.key, request.prompt_ids, prefill.cache, start, end)
        except Exception as exc:  # e.g. out of memory on a long prompt: fail this request only
            log.exception("prefill of %d tokens failed", len(request.prompt_ids))
            self._prefill = None
            self._settle(request, EngineFailure(f"prefill failed: {type(exc).__name__}: {exc}"))
            return True
        self.stats["prefill_tokens"] += end - start
        prefill.done = end
        if end < len(request.prompt_ids):
            return False
        self._prefill = None
        self._running.append(request)  # first: a join or store that fails (out of memory) fails it with the batch
        if request.key not in self._retired:  # a retired slot's KV would never be looked up again
            self._prefix.store(request.key, request.prompt_ids, prefill.cache)  # before the batch takes the cache
        self._batch.add(prefill.cache, end)
        self._accept(request, out.logits[0, -1].float())
        return True

    def _rewarm_chunk(self) -> None:
        """Prefill the next `prefill_chunk` tokens of the oldest re-warm, and file what it holds so
        far in the prefix cache: a request that arrives meanwhile starts from there (having waited
        for one chunk at most). A failure (out of memory) drops that re-warm only."""
        if self._live_prefix().budget <= 0:  # turned off: there is nowhere to file them
            self._rewarm.clear()
            return
        job = self._rewarm[0]
        if job.done and self._prefix.covers(job.key, job.ids):  # a request got there first (its next turn)
            self._rewarm.popleft()
            return
        try:
            if job.cache is None:  # its first chunk: another re-warm may have done a shared prefix
                job.done, cache = self._prefix.lookup(job.key, job.ids, whole=True)
                job.cache = cache or DynamicCache()
            start, end = job.done, min(job.done + self.config.prefill_chunk, len(job.ids))
            if start < end:
                self._forward_chunk(job.key, job.ids, job.cache, start, end)
                self._prefix.store(job.key, job.ids[:end], job.cache)
        except Exception:
            log.exception("re-prefilling a cached prompt of %d tokens failed; dropping it", len(job.ids))
            self._rewarm.popleft()
            return
        self.stats["prefix_rewarmed_tokens"] += end - start
        job.done = end
        if end == len(job.ids):
            self._rewarm.popleft()

    def _queue_rewarm(self, old: str, new: str, prompts: list[list[int]]) -> None:
        """Re-warm under `new` the prompts `old` had cached (`prompts`, most recent first) and those its
        own unfinished re-warms were prefilling, at most `engine.prefix_rewarm` of them."""
        pending = [job.ids for job in self._rewarm if job.key == old]
        self._rewarm = collections.deque(job for job in self._rewarm if job.key != old)
        candidates = prompts + pending
        # A half-done re-warm's entry is a prefix of its own prompt (in `pending`): the whole one serves both.
        wholes = [ids for ids in candidates
                  if not any(len(other) > len(ids) and other[:len(ids)] == ids for other in candidates)]
        queued: list[list[int]] = []
        for ids in wholes:
            if len(queued) < self.config.prefix_rewarm and ids not in queued:
                queued.append(ids)
        self._rewarm.extend(Rewarm(new, ids) for ids in queued)

    def _forget_rewarm(self, key: str) -> None:
        """`key`'s weights are gone: its re-warms would fill the cache with KV nobody looks up."""
        self._rewarm = collections.deque(job for job in self._rewarm if job.key != key)

    def _step(self) -> None:
        mask, positions = self._batch.step_inputs()
        ids = torch.tensor([[r.last_token] for r in self._running], device=self._base.device)
        out = self._forward([r.key for r in self._running], input_ids=ids, attention_mask=mask,
                            position_ids=positions, cache=self._batch.cache)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(self._running)
        logits = out.logits[:, -1].float()
        for row, request in enumerate(self._running):
            if not request.cancelled:
                self._accept(request, logits[row])
        self._drop_finished()

    def _accept(self, request: Request, logits: torch.Tensor) -> None:
        """Append one sampled token, stream its visible text, and finish the request if done."""
        s = request.sampling
        token, logprob = sample(logits, s.temperature, s.top_k, s.top_p, request.generator)
        request.last_token = token
        events, reason = request.advance.events(request.gen, token, logprob)  # none while text is held back
        for event in events:
            request.send(event)
        if reason:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        if request.gen.finish_reason is None:
            if request.cancelled:
                # The exact text of what was sampled before it; the text held back (no stop matched)
                # is streamed on the last token's event, as a finish would (it was dropped before).
                for event in request.advance.end(request.gen):
                    request.send(event)
            request.gen.finish_reason = "aborted" if request.cancelled else reason
            self._settle(request, request.gen)

    def _settle(self, request: Request, outcome: Generation | EngineFailure) -> None:
        """The one exit of every request: free its queue place and adapter slot, then answer it."""
        request.gen.finish_reason = request.gen.finish_reason or "aborted"
        with self._lock:
            self._pending -= 1
        self._release_hold(request.key)
        request.send(outcome)

    def _drop_finished(self) -> None:
        for request in self._running:
            if request.cancelled:
                self._finish(request, "aborted")
        keep = [i for i, r in enumerate(self._running) if r.gen.finish_reason is None]
        if len(keep) != len(self._running):
            for row, request in enumerate(self._running):
                if request.gen.finish_reason is not None:
                    self._keep_reply(row, request)
            self._batch.keep(keep)
            self._running = [self._running[i] for i in keep]

    def _keep_reply(self, row: int, request: Request) -> None:
        """File a finished request's prompt and reply (all but the last token, never fed) in the prefix
        cache: the agent's next turn resends both, and without this it prefilled the reply again."""
        if request.gen.finish_reason not in ("stop", "length") or len(request.gen.token_ids) < 2 \
                or request.key in self._retired:
            return
        self._live_prefix()
        n = self._batch.length(row)
        ids = (request.prompt_ids + request.gen.token_ids)[:n]
        if n * self._batch.column_bytes() > self._prefix.budget or self._prefix.covers(request.key, ids):
            return  # it would not be kept: spare the copy
        try:
            self._prefix.store(request.key, ids, self._batch.row(row), prompt=len(request.prompt_ids))
        except Exception:  # e.g. out of memory for the copy: the reply is answered all the same
            log.exception("keeping a finished reply's KV failed; its next turn prefills it again")

    def _queue_weights(self, state: dict[str, torch.Tensor], version: int, future: Future) -> None:
        """On the scheduler thread: wait for the drain, merged with a load already waiting (the
        newer version wins, both callers are answered)."""
        waiters = [future]
        if self._weights_pending is not None:
            pending_state, pending_version, pending_waiters = self._weights_pending
            waiters = pending_waiters + waiters
            if pending_version > version:
                state, version = pending_state, pending_version
        self._weights_pending = (state, version, waiters)

    def _apply_weights(self) -> None:
        state, version, waiters = self._weights_pending
        self._weights_pending = None
        try:
            self._copy_weights(state, version)
        except Exception as exc:  # noqa: BLE001 - delivered to the callers; serving goes on with the old weights
            _answer(waiters, error=exc)
            return
        _answer(waiters, version)

    def _copy_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        if self._slots.peft is not None:
            raise AdapterError("LoRA adapters are loaded: full weights would change the base under them")
        # With no adapter loaded, every cached prompt and re-warm is the base's; all restart under the new weights.
        cached = self._prefix.prompts(BASE, self.config.prefix_rewarm) + [job.ids for job in self._rewarm]
        self._prefix.drop()  # first: a load that fails partway has changed some weights already
        self._rewarm.clear()
        missing, unexpected = self._base.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self._base.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise AdapterError(f"the weights do not fit this model (missing {sorted(set(missing) - tied)[:3]}, "
                               f"unexpected {sorted(unexpected)[:3]})")
        self._weights_version = version
        self.stats["weight_swaps"] += 1
        self._queue_rewarm(BASE, BASE, cached)

    def _score(self, prompt_ids: list[int], completion_ids: list[int], key: str, temperature: float,
               top_k: int, top_p: float) -> list[float]:
        # The cached prefix is at most all but the prompt's last token, whose logits score the first
        # completion token; the KV is the same weights' (a slot's entries drop when its weights change).
        done, cache = self._prefix.lookup(key, prompt_ids) if self.config.score_from_prefix else (0, None)
        self.stats["score_cached_tokens"] += done
        whole = prompt_ids + completion_ids
        ids = torch.tensor([whole[done:]], device=self._base.device)
        out = self._forward([key], input_ids=ids, cache=cache or DynamicCache(),
                            position_ids=torch.arange(done, len(whole), device=ids.device)[None])
        logits = out.logits[0, len(prompt_ids) - 1 - done:-1].float() / temperature
        target = torch.tensor(completion_ids, device=logits.device)
        n = len(completion_ids)
        logp = processed_logprobs(logits, [top_k] * n, [top_p] * n, keep=target)
        return logp.gather(1, target[:, None]).squeeze(1).tolist()

    def _load(self, name: str, path: Path, version: int, read: Read) -> None:
        with self._lock:
            current = self._adapters.get(name)
        if current and current[1] == version:
            return
        key = self._slots.load(path, read)
        self._prefix.drop(key)  # KV computed by the slot's earlier occupant
        self._forget_rewarm(key)
        with self._lock:
            self._adapters[name] = (key, version)
        self.stats["adapter_swaps"] += 1
        if current:
            self._queue_rewarm(current[0], key, self._prefix.prompts(current[0], self.config.prefix_rewarm))
            self._retire(current[0])

    def _retire(self, key: str) -> None:
        self._prefix.drop(key)
        self._forget_rewarm(key)
        self._retired.add(key)
        self._collect_retired()

    def _collect_retired(self) -> None:
        """Release retired slots that no request holds any more."""
        if not self._retired:
            return
        with self._lock:
            held = {key for key, count in self._holds.items() if count > 0}
            live = {key for key, _ in self._adapters.values()}
        for key in [k for k in self._retired if k not in held and k not in live]:
            self._retired.discard(key)
            self._slots.release(key, in_use=(held | live | self._retired) - {BASE})


def _answer(waiters: list[Future], version: int | None = None, error: BaseException | None = None) -> None:
    """Resolve the futures of callers waiting on a weights load (one whose caller was cancelled, and
    so its future too, is skipped: resolving it would raise in the scheduler thread)."""
    for future in waiters:
        if future.set_running_or_notify_cancel():
            if error is None:
                future.set_result(version)
            else:
                future.set_exception(error)
