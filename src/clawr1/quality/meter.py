"""Measuring replies: the engine scores them against the base, the embedder compares them with
their requests.

Everything that can overlap does: the base model's scoring calls are gathered (the engine batches
or queues them; `concurrency` bounds how many are in flight, for remote engines), and the
embedder, synchronous CPU work, runs in a worker thread meanwhile. Texts are embedded once each,
in batches (a GRPO group shares one request), and empty replies are not embedded at all: their
relevance is 0.

The base is the engine with no adapter (`adapter=None`). With full fine-tuning (`load_weights`)
the engine's own weights are the version, so a separate base engine must be passed instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from clawr1.engine.base import Engine
from clawr1.quality.calibration import Calibration, calibrate
from clawr1.quality.measures import (
    Quality,
    Reply,
    echoes,
    entropy_estimate,
    fluency,
    foreign_script,
    kl_estimate,
    refuses,
    repetition,
    request_text,
)
from clawr1.reward.embed import Embedder

EMBED_BATCH = 64
# Requests this similar are the same question (users of one assistant ask alike): pairing a reply
# with them would not be "another question", and would raise the chance edge past on-topic replies.
SAME_TOPIC = 0.7


class QualityMeter:
    """Measures batches of replies against the base model (`engine` with no adapter)."""

    def __init__(self, engine: Engine, embedder: Embedder, concurrency: int = 16, embed_batch: int = EMBED_BATCH):
        self.engine = engine
        self.embedder = embedder
        self.embed_batch = embed_batch
        self.concurrency = concurrency

    @classmethod
    def load(cls, engine: Engine, concurrency: int = 16) -> QualityMeter:
        """A meter with the bundled MiniLM embedder (raises if its package is not installed)."""
        return cls(engine, Embedder.shared(), concurrency)

    async def measure(self, replies: Sequence[Reply], concurrency: int | None = None) -> list[Quality]:
        """The measures of each reply, in order (`concurrency`: scoring calls in flight at most,
        default the meter's)."""
        qualities, _, _ = await self._measure(replies, concurrency)
        return qualities

    async def calibrate(self, base_replies: Sequence[Reply], concurrency: int | None = None,
                        **options: Any) -> tuple[Calibration, list[Quality]]:
        """Measure the base model's own replies and derive their normal range (`options`: see
        `calibrate`; `concurrency` as for `measure`). The chance edge of relevance pairs each reply
        with every request of the set on
        another topic than its own (cosine of the two requests below `SAME_TOPIC`), from embeddings
        already computed."""
        measured, vectors, requests = await self._measure(base_replies, concurrency)
        distinct = list(dict.fromkeys(requests))
        chance = [float(vectors[r.text] @ vectors[other])
                  for r, own in zip(base_replies, requests) if not r.empty
                  for other in distinct if float(vectors[own] @ vectors[other]) < SAME_TOPIC]
        return calibrate(measured, chance or None, **options), measured

    async def _measure(self, replies: Sequence[Reply], concurrency: int | None = None,
                       ) -> tuple[list[Quality], dict[str, torch.Tensor], list[str]]:
        requests = [request_text(r.messages) for r in replies]
        texts = list(dict.fromkeys(requests + [r.text for r in replies if not r.empty]))
        gate = asyncio.Semaphore(concurrency or self.concurrency)  # per call: a semaphore belongs to one event loop
        vectors, scores = await asyncio.gather(asyncio.to_thread(self._embed, texts),
                                               asyncio.gather(*(self._score(r, gate) for r in replies)))
        out = []
        for reply, request, (plain, base) in zip(replies, requests, scores):
            relevance = 0.0 if reply.empty else float(vectors[request] @ vectors[reply.text])
            kl = entropy = None
            if reply.logprobs is not None and reply.token_ids:
                kl = kl_estimate(reply.logprobs, base)
                entropy = entropy_estimate(reply.logprobs)
            out.append(Quality(relevance=relevance, fluency=fluency(plain) if plain else None,
                               repetition=repetition(reply.text), empty=reply.empty,
                               n_tokens=len(reply.token_ids), kl=kl, entropy=entropy,
                               echo=not reply.tool_call and echoes(reply.text, request),
                               refusal=not reply.tool_call and refuses(reply.text, request),
                               foreign=foreign_script(reply.text, request), tool_call=reply.tool_call))
        return out, vectors, requests

    def _embed(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """text -> its L2-normalised embedding (a 1-d tensor), in batches of `embed_batch`."""
        out = {}
        for start in range(0, len(texts), self.embed_batch):
            chunk = texts[start:start + self.embed_batch]
            out.update(zip(chunk, self.embedder(chunk)))
        return out

    async def _score(self, reply: Reply, gate: asyncio.Semaphore) -> tuple[list[float], list[float]]:
        """The base's logprobs of the reply, teacher-forced: (under the base's own distribution,
        temperature 1 and uncut: fluency; under the reply's own sampling settings, each reply token
        kept in the cut: drift, whose KL estimate needs the base under the distribution the version
        sampled from). One pass when the reply was sampled at temperature 1, uncut.

        Fluency is "would the base model say this at all", not "is it what the base would most
        likely say": under a sharpened distribution (Qwen's recommended 0.7 with top_k 20 and top_p
        0.8) the base's own replies score near 0 nats a token and a fluent reply in a style the
        users asked for (prose where the base writes a list) falls below their narrow range. In a
        Qwen demo run the guard rejected such versions (probe sane rate 0.33-0.67) on fluency
        alone; at temperature 1 their replies score -0.85 against the base's -0.70 and word salad
        still scores far below."""
        if not reply.token_ids:
            return [], []
        natural = reply.temperature == 1.0 and reply.top_k <= 0 and reply.top_p >= 1.0
        async with gate:
            plain = await self.engine.score(reply.prompt_ids, reply.token_ids, adapter=None)
            if natural:
                return plain, plain
            sampled = await self.engine.score(reply.prompt_ids, reply.token_ids, adapter=None,
                                              temperature=reply.temperature, top_k=reply.top_k, top_p=reply.top_p)
        return plain, sampled
