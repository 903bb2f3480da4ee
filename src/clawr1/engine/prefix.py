"""The local engine's prefix cache: the KV of recent prompts, reused by prompts that extend them.

An agent resends its whole conversation every turn (OpenClaw's system prompt alone is ~2.7k tokens
of SmolLM2's), so without this each turn re-prefills what the turn before already computed: about
45 s a turn on 2 CPU cores. An entry is one prompt's KV, filed under the weights that computed it
(a peft slot, or the base): the engine drops a slot's entries whenever that slot's weights change,
so a reused KV is always the served version's own and the sampled tokens' logprobs stay exact.
When the engine is idle it prefills the replaced version's most recent prompts again under the new
weights (`engine.prefix_rewarm`), so an agent's next turn after a swap is not a cold one.
vLLM's automatic prefix caching does this by hashed blocks; a few whole prompts under a byte budget
(least recently used out first) are enough for one CPU engine.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass(eq=False)
class _Entry:
    key: int
    owner: str
    ids: torch.Tensor  # the prompt's token ids, [T]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), [1, H, T, D]; never written
    nbytes: int
    prompt: int | None = None  # a finished reply's entry: its prompt's length in `ids`


class PrefixCache:
    """Whole-prompt KV entries under a byte budget, matched by longest common prefix."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.nbytes = 0
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # oldest use first
        self._serial = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, owner: str, prompt_ids: list[int], whole: bool = False) -> tuple[int, DynamicCache | None]:
        """The longest cached prefix of `prompt_ids` computed under `owner`, as (length, a cache holding
        it). At most all but the last token (the last one must be run to give the first token's
        logits) unless `whole`: a re-warm, which wants no logits, may find all of it."""
        if not self._entries or len(prompt_ids) < (1 if whole else 2):
            return 0, None
        prompt = torch.tensor(prompt_ids if whole else prompt_ids[:-1])
        best, best_len = None, 0
        for entry in self._entries.values():
            common = _common(entry.ids, prompt) if entry.owner == owner else 0
            if common > best_len:
                best, best_len = entry, common
        if best is None:
            return 0, None
        self._entries.move_to_end(best.key)
        # The new cache copies the prefix once (DynamicLayer.update concatenates): the entry is never written.
        return best_len, DynamicCache(ddp_cache_data=[(k[:, :, :best_len], v[:, :, :best_len]) for k, v in best.layers])

    def store(self, owner: str, prompt_ids: list[int], cache: DynamicCache, prompt: int | None = None) -> None:
        """File a finished prefill's KV, or a finished reply's with its prompt's (`prompt`: the prompt's
        length in `prompt_ids`). An entry whose prompt this one extends is dropped: every prompt it
        could serve, the new one serves as far or further (a conversation keeps one entry, its latest);
        for the same reason nothing is filed when an entry already extends this prompt. A reply also
        replaces the other replies to its prompt (a group of samples keeps one entry, not one copy
        of the prompt per sample): the prompt part of any of them serves the others' next turns."""
        if self.budget <= 0:
            return
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.budget:
            return
        ids = torch.tensor(prompt_ids)
        for key, entry in list(self._entries.items()):
            if entry.owner != owner:
                continue
            common = _common(entry.ids, ids)
            if prompt is not None and entry.prompt == prompt and common >= prompt:
                self._remove(key)  # another reply to the same prompt (not a later turn that starts with it)
                continue
            if common < min(len(entry.ids), len(ids)):
                continue  # neither prompt is a prefix of the other
            if len(entry.ids) >= len(ids):  # one on file already extends this prompt: it serves it as far
                self._entries.move_to_end(key)
                return
            self._remove(key)
        while self.nbytes + nbytes > self.budget:
            self._remove(next(iter(self._entries)))
        entry = _Entry(next(self._serial), owner, ids, layers, nbytes, prompt)
        self._entries[entry.key] = entry
        self.nbytes += nbytes

    def covers(self, owner: str, prompt_ids: list[int]) -> bool:
        """Whether an entry of `owner` holds all of `prompt_ids` (ids compared, no KV copied)."""
        prompt = torch.tensor(prompt_ids)
        return any(entry.owner == owner and len(entry.ids) >= len(prompt) and _common(entry.ids, prompt) == len(prompt)
                   for entry in self._entries.values())

    def prompts(self, owner: str, most: int) -> list[list[int]]:
        """The prompts of `owner`'s `most` most recently used entries, most recent first: what new
        weights in its place re-prefill when the engine is idle."""
        mine = [entry.ids.tolist() for entry in reversed(self._entries.values()) if entry.owner == owner]
        return mine[:most]

    def resize(self, budget_bytes: int) -> None:
        """A new byte budget (0 = off): the least recently used entries leave until the rest fit."""
        self.budget = budget_bytes
        while self.nbytes > max(self.budget, 0):
            self._remove(next(iter(self._entries)))

    def drop(self, owner: str | None = None) -> None:
        """Forget the entries computed under `owner` (every entry when None): its weights changed."""
        for key, entry in list(self._entries.items()):
            if owner is None or entry.owner == owner:
                self._remove(key)

    def _remove(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two token-id vectors."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n
