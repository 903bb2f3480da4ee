"""The distribution a token is sampled from, written once for the engine (sampling and `score`) and
the trainer (the policy's logprob in the importance ratio, the teacher's in OPD), so the three
agree to the bit on the same logits.

From a position's logits z: divide by the temperature T, keep the `top_k` most likely tokens (0:
all), then the smallest set of those, most likely first, whose probability (renormalised over the
kept ones) reaches `top_p`, and renormalise over what is kept. This is the order and the meaning of
Hugging Face's warpers and of vLLM's sampler, whose `processed_logprobs` are these same numbers;
the recorded logprob of a token is its log-probability under this distribution, the one it was
drawn from. Greedy decoding (T = 0) takes the argmax of z and records its logprob at T = 1,
untruncated.

A repetition penalty is not offered: it makes a position's distribution depend on every token
before it, which the trainer could not recompute from a position's logits alone.
"""

from __future__ import annotations

import torch


def truncated(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`z` [n, V] (already divided by the temperature) with every token outside the kept set at
    -inf: its log-softmax is the sampling distribution's logprobs. `z` itself when nothing is cut."""
    vocab = z.shape[-1]
    if (top_k <= 0 or top_k >= vocab) and top_p >= 1.0:
        return z
    if 0 < top_k < vocab:
        values, order = torch.topk(z, top_k, dim=-1)  # sorted, most likely first
    else:
        values, order = torch.sort(z, dim=-1, descending=True)
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        # A token is dropped when the tokens before it already reach top_p (the first is always kept).
        values = values.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p, float("-inf"))
    return torch.full_like(z, float("-inf")).scatter_(-1, order, values)


def processed_logprobs(z: torch.Tensor, top_k: list[int], top_p: list[float],
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """[n, V] log-probabilities of the sampling distribution at each of n positions, whose logits
    `z` [n, V] are already divided by their temperature, with `top_k[i]` and `top_p[i]` at
    position i. `keep` [n]: a token per position that stays in the kept set whatever its rank, for
    the trainer, whose logits differ from the engine's by rounding: a token the engine drew at the
    edge of the nucleus must not become impossible (-inf) there."""
    groups: dict[tuple[int, float], list[int]] = {}
    for i, setting in enumerate(zip(top_k, top_p)):
        groups.setdefault(setting, []).append(i)
    if all(k <= 0 and p >= 1.0 for k, p in groups):
        return torch.log_softmax(z, dim=-1)
    out = torch.empty_like(z)
    for (k, p), rows in groups.items():  # a batch usually shares one setting: one pass
        index = torch.tensor(rows, device=z.device)
        part = z.index_select(0, index)
        cut = truncated(part, k, p)
        if keep is not None and cut is not part:
            picked = keep.index_select(0, index)[:, None]
            cut.scatter_(-1, picked, part.gather(-1, picked))
        out.index_copy_(0, index, torch.log_softmax(cut, dim=-1))
    return out


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator) -> tuple[int, float]:
    """Sample one token from a row of logits [V]; return it with its logprob under the distribution
    it was drawn from (see the module docstring)."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logp))
        return token, float(logp[token])
    logp = torch.log_softmax(truncated(logits[None] / temperature, top_k, top_p), dim=-1)[0]
    token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return token, float(logp[token])
