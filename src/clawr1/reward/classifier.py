"""A judge that runs here with no chat model: MiniLM embeddings of the next state and a softmax
regression over {-1, 0, +1}, trained at load time on the shipped `train` set (~1-2 s).

The regression's L2 weight (1e-3) and plain argmax (no abstain threshold) were chosen by
leave-one-out accuracy on the training set, never on the evaluation set. Hints come from
`extract.py` (the user's correction sentences, or the tool's error lines), only for -1.
"""

from __future__ import annotations

import asyncio

import torch

from clawr1.reward.dataset import Item, load_items
from clawr1.reward.embed import Embedder
from clawr1.reward.extract import extract_hint
from clawr1.reward.turn import next_state_text
from clawr1.reward.types import NOT_REQUESTED, HintResult, Judgement, Message

LABELS = (-1, 0, 1)
L2 = 1e-3
TEXT_CHARS = 500


def features_text(next_state: list[Message]) -> str:
    """What is embedded: the next state with its roles (a tool's words differ from a user's)."""
    return next_state_text(next_state, TEXT_CHARS)


class SoftmaxRegression:
    """Multinomial logistic regression with an L2 penalty, fitted by L-BFGS (a few ms here)."""

    def __init__(self, x: torch.Tensor, labels: list[int], l2: float = L2):
        y = torch.tensor([LABELS.index(label) for label in labels])
        self.w = torch.zeros(x.shape[1], len(LABELS), requires_grad=True)
        self.b = torch.zeros(len(LABELS), requires_grad=True)
        opt = torch.optim.LBFGS([self.w, self.b], max_iter=200)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(x @ self.w + self.b, y) + l2 * (self.w**2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        self.w, self.b = self.w.detach(), self.b.detach()

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ self.w + self.b, dim=-1)


class ClassifierJudge:
    name = "classifier"

    def __init__(self, embedder: Embedder, train: list[Item], hint_min_chars: int = 20):
        self.embedder = embedder
        self.hint_min_chars = hint_min_chars
        x = embedder([features_text(item.next_state) for item in train])
        self.model = SoftmaxRegression(x, [item.label for item in train])

    @classmethod
    def load(cls, hint_min_chars: int = 20) -> ClassifierJudge:
        """Load MiniLM from its package and train on the shipped set; raises ModuleNotFoundError
        (with the pip command) when the package is missing."""
        return cls(Embedder.shared(), load_items("train"), hint_min_chars)

    def classify(self, next_state: list[Message]) -> tuple[int, list[float]]:
        """(score, probabilities of -1, 0, +1). Blocking; ~10-40 ms on one core."""
        probs = self.model.probs(self.embedder([features_text(next_state)]))[0]
        return LABELS[int(probs.argmax())], [round(float(p), 3) for p in probs]

    async def hint(self, context: list[Message], reply: str, next_state: list[Message], m: int) -> HintResult:
        return extract_hint(next_state, self.hint_min_chars)

    async def judge(self, context: list[Message], reply: str, next_state: list[Message], m: int,
                    want_hint: bool) -> Judgement:
        # Off the event loop: the forward pass would stall the gateway's requests meanwhile.
        score, probs = await asyncio.to_thread(self.classify, next_state)
        hint = NOT_REQUESTED
        if want_hint:
            # Only a failed reply has a correction to learn from; in "Great, now email it to Bob" the
            # imperative is the next task, not a hint.
            hint = extract_hint(next_state, self.hint_min_chars) if score < 0 else HintResult(None, "no_correction")
        evidence = f"classifier p(-1, 0, +1) = ({probs[0]:.2f}, {probs[1]:.2f}, {probs[2]:.2f})"
        return Judgement(score=score, votes=[score], raw=[evidence], evidence=evidence, source="classifier",
                         hint=hint.hint, hint_reason=hint.reason, hint_raw=hint.raw)
