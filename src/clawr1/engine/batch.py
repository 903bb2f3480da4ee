"""Continuous batching state: one left-padded KV cache for every running sequence, and sampling.

Rows join after a batch-1 prefill (no padding inside a prompt, so no all-masked query rows and
no NaNs) and leave the moment they finish; the cache is re-laid only when the batch changes.
Position ids are per row (count of real tokens), so padding never shifts RoPE positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def rebuild(cache: DynamicCache, rows: torch.Tensor | None = None, start: int = 0, pad: int = 0) -> DynamicCache:
    """A new cache with the given batch rows, time columns from `start`, and `pad` zero columns in front."""
    layers = []
    for keys, values, _ in cache:
        if rows is not None:
            keys, values = keys[rows], values[rows]
        keys, values = keys[:, :, start:], values[:, :, start:]
        if pad:
            keys, values = F.pad(keys, (0, 0, pad, 0)), F.pad(values, (0, 0, pad, 0))
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)


def concat(a: DynamicCache, b: DynamicCache) -> DynamicCache:
    """Stack two caches of equal length along the batch dimension."""
    return DynamicCache(ddp_cache_data=[
        (torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va, _), (kb, vb, _) in zip(a, b)
    ])


class KVBatch:
    """The running batch: cache [B, H, T, D] and attention mask [B, T] (0 = left padding)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def add(self, cache: DynamicCache, length: int) -> None:
        """Append one prefilled sequence (cache of `length` real tokens) as the last row."""
        row_mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        if self.cache is None:
            self.cache, self.mask = cache, row_mask
            return
        width = self.mask.shape[1]
        if length < width:
            cache, row_mask = rebuild(cache, pad=width - length), F.pad(row_mask, (width - length, 0))
        elif length > width:
            self.cache, self.mask = rebuild(self.cache, pad=length - width), F.pad(self.mask, (length - width, 0))
        self.cache = concat(self.cache, cache)
        self.mask = torch.cat([self.mask, row_mask])

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask and position ids for feeding one new token per row."""
        positions = self.mask.sum(dim=1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones(self.size, 1, dtype=torch.long, device=self.device)], dim=1)
        return self.mask, positions

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in `rows`, then trim columns that are padding in every kept row."""
        if not rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = self.mask[index]
        start = int((mask.sum(dim=0) > 0).nonzero()[0])
        self.cache, self.mask = rebuild(self.cache, index, start), mask[:, start:]


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> tuple[int, float]:
    """Sample one token from a row of logits; return it with its logprob.

    The logprob is under the temperature-scaled distribution (temperature 1 for greedy), the same
    one `score` computes, so importance ratios compare like with like. top_p only restricts which
    tokens may be drawn.
    """
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logp))
        return token, float(logp[token])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])
