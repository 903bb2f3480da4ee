"""Continuous batching state: one left-padded KV cache for every running sequence, and sampling.

Rows join after a batch-1 prefill (no padding inside a prompt, so no all-masked query rows and
no NaNs) and leave the moment they finish; the cache is re-laid only when the batch changes.
Position ids are per row (count of real tokens), so padding never shifts RoPE positions.

The running batch's cache appends in place (`GrowingLayer`): transformers' `DynamicLayer`
concatenates, so every decode step copied the whole [B, H, T, D] cache of every layer, which at an
agent's context (2k-token prompts, 4 rows) was a quarter of the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

HEADROOM = 256  # columns allocated ahead: a cache grows (one copy) once per 256 decode steps. Per row
# that is layers x 2 x KV heads x head dim x 256 x element size: 11.8 MB for SmolLM2-135M in
# float32, 33.5 MB for an 8B Llama in bfloat16.


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that writes new columns into spare capacity instead of concatenating.
    `keys` / `values` are views of the first T columns of [B, H, capacity, D] buffers. Columns are
    written once, in order, and never again, so a view taken earlier keeps its content."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, int]], coming: int = 0) -> None:
        """The rows of `parts` stacked along the batch dimension, each part `(keys, values, pad)`
        with `pad` zero columns in front of it (left padding: zeros, never uninitialised memory,
        which a masked score could turn into NaN) so that all are as long; and room for `coming`
        columns plus the headroom."""
        super().__init__()
        k0, v0, pad0 = parts[0]
        rows, length = sum(k.shape[0] for k, _, _ in parts), pad0 + k0.shape[-2]
        self._k = k0.new_empty(rows, k0.shape[1], length + coming + HEADROOM, k0.shape[3])
        self._v = v0.new_empty(rows, v0.shape[1], length + coming + HEADROOM, v0.shape[3])
        row = 0
        for keys, values, pad in parts:
            assert pad + keys.shape[-2] == length, "parts of one layer must be as long with their padding"
            rows_of = slice(row, row + keys.shape[0])
            self._k[rows_of, :, :pad].zero_()
            self._v[rows_of, :, :pad].zero_()
            self._k[rows_of, :, pad:length] = keys
            self._v[rows_of, :, pad:length] = values
            row += keys.shape[0]
        self.lazy_initialization(k0, v0)
        self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.keys.numel() == 0:  # reset (or never filled): start over from these
            self.__init__([(key_states, value_states, 0)])
            return self.keys, self.values
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        # Out of room, or `keys` is no longer a view of the buffers (an inherited method such as
        # `batch_select_indices` replaced it): new buffers with fresh headroom (one copy).
        if end > self._k.shape[-2] or self.keys.data_ptr() != self._k.data_ptr() \
                or self.keys.shape[0] != self._k.shape[0]:
            grown = GrowingLayer([(self.keys, self.values, 0)], coming=end - start)
            self._k, self._v = grown._k, grown._v
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values


def growing(layers: Iterable[DynamicLayer]) -> DynamicCache:
    """A `DynamicCache` (what the model's masking and attention code expect) over growing layers."""
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layers=list(layers))
    return cache


def _layer(parts: list[tuple[torch.Tensor | None, torch.Tensor | None, int]]) -> DynamicLayer:
    """A growing layer of `parts`; an empty `DynamicLayer` for a layer that holds no KV (a model
    whose layers share KV leaves some unfilled), as `DynamicCache` itself keeps one."""
    if any(keys is None for keys, _, _ in parts):
        return DynamicLayer()
    return GrowingLayer(parts)


def rebuild(cache: DynamicCache, rows: torch.Tensor | None = None, start: int = 0, pad: int = 0) -> DynamicCache:
    """A new cache with the given batch rows, time columns from `start`, and `pad` zero columns in front."""
    layers = []
    for keys, values, _ in cache:
        if keys is not None and rows is not None:
            keys, values = keys[rows], values[rows]
        layers.append(_layer([(keys if keys is None else keys[:, :, start:],
                               values if values is None else values[:, :, start:], pad)]))
    return growing(layers)


def concat(a: DynamicCache, b: DynamicCache, pad_a: int = 0, pad_b: int = 0) -> DynamicCache:
    """Stack two caches along the batch dimension, each after its own left padding (one copy)."""
    return growing(_layer([(ka, va, pad_a), (kb, vb, pad_b)]) for (ka, va, _), (kb, vb, _) in zip(a, b))


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
        if self.cache is None:  # copied into growing buffers: the prefill's tensors may be in the prefix cache
            self.cache, self.mask = rebuild(cache), row_mask
            return
        width = self.mask.shape[1]
        pad_batch, pad_row = max(length - width, 0), max(width - length, 0)  # the shorter side is padded
        self.cache = concat(self.cache, cache, pad_batch, pad_row)
        self.mask = torch.cat([F.pad(self.mask, (pad_batch, 0)), F.pad(row_mask, (pad_row, 0))])

    def length(self, index: int) -> int:
        """Real (unpadded) columns of row `index`."""
        return int(self.mask[index].sum())

    def column_bytes(self) -> int:
        """Bytes of one row's KV per column, over every layer."""
        return sum(2 * keys.shape[1] * keys.shape[3] * keys.element_size() for keys, _, _ in self.cache)

    def row(self, index: int) -> DynamicCache:
        """A copy of row `index`'s KV without its padding: a finished request's prompt and reply, for
        the prefix cache. `DynamicCache` concatenates what it is given onto empty layers, so these
        are fresh tensors, not views that would keep the whole batch's buffers alive."""
        n = self.length(index)
        return DynamicCache(ddp_cache_data=[(keys[index:index + 1, :, -n:], values[index:index + 1, :, -n:])
                                            for keys, values, _ in self.cache])

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
