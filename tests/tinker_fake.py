"""An in-process stand-in for a Tinker-compatible training service, backed by the tiny torch model.

It has the SDK clients' methods as the `tinker` SDK (0.38) documents them, and uses the SDK's own
types for what crosses the wire (`Datum`, `ModelInput`, `AdamParams`, `SamplingParams`):
- futures with `.result(timeout)` that can also be awaited;
- `forward_backward(datums, "ppo", {"clip_low_threshold", "clip_high_threshold"})`: per target
  token, ratio = exp(logprob - sampling logprob), objective min(ratio * A, clip(ratio) * A), and
  the loss is minus the objective summed over every token (the service sums token losses);
- `optim_step(AdamParams)`: torch's AdamW (Tinker documents its Adam as identical to it), with
  `grad_clip_norm` as the gradient-norm clip;
- `save_state` / `create_training_client_from_state_with_optimizer`, `save_weights_for_sampler`,
  `create_sampling_client(model_path=... | base_model=...)` with `sample` and `compute_logprobs`.
Every call is recorded (`calls`) so tests can read exactly what was sent.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from clawr1.core.config import TrainerConfig
from clawr1.trainer.policy import Policy, pack


class Done:
    """A completed SDK future."""

    def __init__(self, value: Any):
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value

    def __await__(self):
        async def value() -> Any:
            return self.value
        return value().__await__()


class FakeService:
    def __init__(self, model_dir: Path, config: TrainerConfig):
        self.model_dir, self.config = model_dir, config
        self.states: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}
        self.samplers: dict[str, dict[str, torch.Tensor]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.fail: set[str] = set()  # method names that raise, as a failing service would
        self.sampler_model = Policy(model_dir, config)  # one model for every sampling client
        self.training: FakeTrainingClient | None = None

    def _check(self, method: str) -> None:
        self.calls.append((method, None))
        if method in self.fail:
            raise RuntimeError(f"service unavailable ({method})")

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    **_: Any) -> Done:
        self._check("create_lora_training_client")
        config = self.config.model_copy(update={"lora_rank": rank, "seed": seed or 0})
        self.training = FakeTrainingClient(self, Policy(self.model_dir, config))
        return Done(self.training)

    def create_training_client_from_state_with_optimizer(self, path: str, **_: Any) -> Done:
        client = self.create_lora_training_client("base", self.config.lora_rank, self.config.seed).result()
        weights, optimizer = self.states[path]
        client.load(weights, optimizer)
        return Done(client)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               **_: Any) -> Done:
        self._check("create_sampling_client")
        return Done(FakeSamplingClient(self, self.samplers[model_path] if model_path else None))


class FakeTrainingClient:
    def __init__(self, service: FakeService, policy: Policy):
        self.service, self.policy = service, policy
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.policy.named_trainable().items()}

    def load(self, weights: dict[str, torch.Tensor], optimizer: dict) -> None:
        with torch.no_grad():
            for name, param in self.policy.named_trainable().items():
                param.copy_(weights[name])
        self.optimizer.load_state_dict(copy.deepcopy(optimizer))

    def forward_backward(self, data: list[Any], loss_fn: str, loss_fn_config: dict[str, float] | None = None) -> Done:
        self.service._check("forward_backward")
        self.service.calls[-1] = ("forward_backward", (data, loss_fn, loss_fn_config))
        assert loss_fn == "ppo", loss_fn
        low, high = loss_fn_config["clip_low_threshold"], loss_fn_config["clip_high_threshold"]
        total = torch.zeros(())
        for datum in data:
            ids = datum.model_input.to_ints()
            targets = datum.loss_fn_inputs["target_tokens"].tolist()
            rows = pack([[ids[0]]], [targets], [1.0], self.policy.pad_id)  # logprob of every target token
            logp = self.policy.stats(rows, rows.mask, reference=False)[0][0]
            sampling = torch.tensor(datum.loss_fn_inputs["logprobs"].tolist())
            advantage = torch.tensor(datum.loss_fn_inputs["advantages"].tolist())
            ratio = torch.exp(logp - sampling)
            objective = torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
            loss = -objective.sum()
            loss.backward()
            total = total + loss.detach()
        return Done(SimpleNamespace(metrics={"loss:sum": float(total)}, loss_fn_outputs=[]))

    def optim_step(self, params: Any) -> Done:
        self.service._check("optim_step")
        self.service.calls[-1] = ("optim_step", params)
        for group in self.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        if params.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), params.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return Done(SimpleNamespace())

    def save_state(self, name: str, **_: Any) -> Done:
        self.service._check("save_state")
        path = f"tinker://fake/{name}/state"
        self.service.states[path] = (self.weights(), copy.deepcopy(self.optimizer.state_dict()))
        return Done(SimpleNamespace(path=path))

    def save_weights_for_sampler(self, name: str, **_: Any) -> Done:
        self.service._check("save_weights_for_sampler")
        path = f"tinker://fake/{name}/sampler"
        self.service.samplers[path] = self.weights()
        return Done(SimpleNamespace(path=path))


class FakeSamplingClient:
    """The base model (`weights` None) or a saved sampler's LoRA weights on the shared model."""

    def __init__(self, service: FakeService, weights: dict[str, torch.Tensor] | None):
        self.service, self.weights = service, weights

    def _load(self) -> Policy:
        policy = self.service.sampler_model
        if self.weights is not None:
            with torch.no_grad():
                for name, param in policy.named_trainable().items():
                    param.copy_(self.weights[name])
        return policy

    @torch.no_grad()
    def _logprobs(self, ids: list[int], temperature: float = 1.0) -> list[float]:
        policy = self._load()
        rows = pack([[ids[0]]], [ids[1:]], [temperature], policy.pad_id)
        if self.weights is None:
            with policy.adapter_off():
                return policy.logprobs(rows)[0].tolist()
        return policy.logprobs(rows)[0].tolist()

    def compute_logprobs(self, prompt: Any, prompt_logprobs_last_n: int | None = None) -> Done:
        self.service._check("compute_logprobs")
        ids = prompt.to_ints()
        out: list[float | None] = [None, *self._logprobs(ids)]
        if prompt_logprobs_last_n is not None:
            out = [None] * (len(ids) - prompt_logprobs_last_n) + out[-prompt_logprobs_last_n:]
        return Done(out)

    @torch.no_grad()
    def sample(self, prompt: Any, num_samples: int, sampling_params: Any, **_: Any) -> Done:
        self.service._check("sample")
        policy, ids = self._load(), list(prompt.to_ints())
        generator = torch.Generator().manual_seed(sampling_params.seed or 0)
        temperature = sampling_params.temperature or 1.0
        tokens: list[int] = []
        eos = policy.tokenizer.eos_token_id
        for _ in range(sampling_params.max_tokens):
            with policy.adapter_off() if self.weights is None else contextlib.nullcontext():
                logits = policy.causal_lm(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            logp = torch.log_softmax(logits.float() / temperature, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            tokens.append(token)
            ids.append(token)
            if token == eos:
                break
        logprobs = self._logprobs(list(prompt.to_ints()) + tokens, temperature)[-len(tokens):]
        stop = "stop" if tokens[-1] == eos else "length"
        return Done(SimpleNamespace(sequences=[SimpleNamespace(tokens=tokens, logprobs=logprobs, stop_reason=stop)]))
