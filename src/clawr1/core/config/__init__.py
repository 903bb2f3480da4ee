"""Typed configuration: every field has a docstring and a bound.

Resolution order (later wins): defaults, a TOML file, dotted overrides (`engine.threads=1`), then
the CLI's dedicated flags. `clawr1 config` prints the resolved result as TOML, so what a run used
is never a guess.
"""


from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from clawr1.core.config._base import (
    EMBEDDED_MODEL,
    SECRET_FIELDS,
    TENANT_NAME,
    _Section,
    default_data_dir,
    hint_at_for,
)
from clawr1.core.config.deploy import EnvsConfig, RayConfig
from clawr1.core.config.engine import EngineConfig
from clawr1.core.config.gateway import GatewayConfig, TenantsConfig
from clawr1.core.config.memory import MemoryConfig
from clawr1.core.config.pool import PoolConfig
from clawr1.core.config.reward import GuardConfig, RewardConfig
from clawr1.core.config.trainer import TinkerConfig, TrainerConfig, ranks_device_error

__all__ = ["EMBEDDED_MODEL", "SECRET_FIELDS", "TENANT_NAME", "Config", "EngineConfig", "EnvsConfig", "GatewayConfig",
           "GuardConfig", "MemoryConfig", "PoolConfig", "RayConfig", "RewardConfig", "TenantsConfig", "TinkerConfig", "TrainerConfig",
           "apply_override", "default_data_dir", "hint_at_for", "load_config", "public_dump", "ranks_device_error",
           "to_toml"]


class Config(_Section):
    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the model cache, adapters and the data pool (`pool.sqlite3`) live."""

    log_format: Literal["rich", "json"] = "rich"
    """Logs of the long-running commands (`up`, `serve`, `train`): `rich` for a terminal, `json` for a
    log shipper (one object a line: time, level, logger, message, extras; `--log-json`). Top level,
    not under `gateway`: `up` hands the trainer process the same config, so both log alike."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The serving engine."""

    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI-compatible HTTP gateway."""

    pool: PoolConfig = Field(default_factory=PoolConfig)
    """The data pool: durability, group commit, leases, staleness and the fresh/off-policy mix."""

    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The reward stage: judge, votes, hints."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer: method, batch, LoRA, loss bounds."""

    envs: EnvsConfig = Field(default_factory=EnvsConfig)
    """Agent environments: sandbox limits and episode length."""

    tenants: TenantsConfig = Field(default_factory=TenantsConfig)
    """Tenants: whose keys are whose, and whether each tenant trains its own adapter."""

    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    """Per-user memory: corrections that take effect on the user's next turn, through the prompt."""

    guard: GuardConfig = Field(default_factory=GuardConfig)
    """The guard between the trainer and the users: probe sets, bounds, the trainer's wait."""

    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray deployment (`clawr1 up --ray`): engine replicas, judge workers, actor names."""

    tinker: TinkerConfig = Field(default_factory=TinkerConfig)
    """A Tinker-compatible training service (`trainer.backend` / `engine.backend = "tinker"`)."""

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.trainer.finetune == "full" and self.tenants.adapter_per_tenant:
            raise ValueError("trainer.finetune = \"full\" trains one model for everyone: it excludes "
                             "tenants.adapter_per_tenant")
        if self.trainer.finetune == "full" and self.engine.backend == "vllm":
            raise ValueError("trainer.finetune = \"full\" needs an engine that reloads weights from disk "
                             "(local or sglang); vLLM takes them only through its NCCL/IPC weight transfer")
        error = ranks_device_error(self.trainer.device, self.ray.trainer_ranks)
        if error:
            raise ValueError(error)
        remote = self.trainer.backend == "tinker"
        if (remote or self.engine.backend == "tinker") and not self.tinker.base_model:
            raise ValueError("a tinker backend needs tinker.base_model (the service's name of the base model)")
        if remote != (self.engine.backend == "tinker"):
            raise ValueError("trainer.backend = \"tinker\" publishes samplers of the service, which only "
                             "engine.backend = \"tinker\" serves (and it serves nothing else): set both or neither")
        if remote and (self.trainer.finetune != "lora" or self.tenants.adapter_per_tenant):
            raise ValueError("trainer.backend = \"tinker\" trains one shared LoRA adapter")
        if remote and (self.trainer.opd_estimator == "full" or self.trainer.entropy_coef > 0
                       or self.trainer.teacher != "base" or self.trainer.relabel > 0 or self.trainer.stop_coef > 0):
            raise ValueError("trainer.backend = \"tinker\": the service's PPO loss takes per-token advantages "
                             "only, and the teacher is the service's base sampler; trainer.opd_estimator = "
                             "\"full\", entropy_coef > 0, teacher != \"base\", relabel > 0 and stop_coef > 0 "
                             "need the model here (train locally)")
        return self


def public_dump(config: Config) -> dict[str, Any]:
    """The config as plain data with every secret left out (for a run tracker's record of the run)."""
    data = config.model_dump(mode="json")
    for section in data.values():
        if isinstance(section, dict):
            for key in SECRET_FIELDS & section.keys():
                del section[key]
    return data


def _parse_value(raw: str) -> Any:
    """A TOML literal (`2`, `true`, `"x"`, `[1, 2]`), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply `a.b.c=value` to a nested dict in place."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {assignment!r} is not of the form key.path=value")
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {assignment!r}: {part!r} is not a section")
    node[leaf] = _parse_value(raw.strip())


def load_config(path: Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file at `path`, then dotted overrides; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        data = tomllib.loads(Path(path).read_text())
    for assignment in overrides:
        apply_override(data, assignment)
    return Config.model_validate(data)


def to_toml(config: Config, secrets: bool = False) -> str:
    """Render a config as TOML, one `[section]` per nested model, each key with its docstring.
    Secrets are redacted unless `secrets` (only for a child process: a file only this user can
    read, or a pipe)."""
    lines: list[str] = []

    def emit(model: BaseModel, header: str | None) -> None:
        scalars = [(k, f) for k, f in type(model).model_fields.items() if not isinstance(getattr(model, k), BaseModel)]
        nested = [k for k in type(model).model_fields if isinstance(getattr(model, k), BaseModel)]
        if header:
            lines.extend(["", f"[{header}]"])
        for name, field in scalars:
            doc = " ".join((field.description or "").split())
            if doc:
                lines.append(f"# {doc}")
            value = getattr(model, name)
            if value is None:
                lines.append(f"# {name} is unset")
            elif name in SECRET_FIELDS and value and not secrets:
                lines.append(f"# {name} is set (redacted)")  # keys never reach logs or terminals
            else:
                lines.append(f"{name} = {_toml_literal(value)}")
        for name in nested:
            emit(getattr(model, name), f"{header}.{name}" if header else name)

    emit(config, None)
    return "\n".join(lines).strip() + "\n"


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{_toml_literal(str(k))} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
