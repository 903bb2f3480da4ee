"""Where the roles run: agent environments and the Ray deployment."""

from __future__ import annotations

from pydantic import Field

from clawr1.core.config._base import _Section


class EnvsConfig(_Section):
    wall_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one sandboxed command; past it every process of the command is killed
    (the tool message says `killed: wall time`)."""

    cpu_s: int = Field(10, ge=1, le=3600)
    """CPU seconds one process of a sandboxed command may use (RLIMIT_CPU; SIGXCPU, then SIGKILL)."""

    memory_mb: int = Field(1024, ge=64, le=1_048_576)
    """Address space of one process of a sandboxed command (RLIMIT_AS): larger allocations fail."""

    max_procs: int = Field(64, ge=8, le=4096)
    """Processes and threads a sandboxed command may have at once (RLIMIT_NPROC, enforced because
    the command never runs as the host's root): a fork bomb stalls here until the wall limit."""

    disk_mb: int = Field(128, ge=1, le=65_536)
    """Size of the workspace and of the private /tmp (each a tmpfs inside the sandbox), and the
    largest file a command may write; the host's disk never sees more than this per episode."""

    output_chars: int = Field(4000, ge=100, le=1_000_000)
    """Head of stdout and of stderr kept in the tool message; the rest is cut, and the message
    says how much."""

    allow_unsandboxed: bool = False
    """Run commands without isolation (only the resource limits) where no sandbox mechanism works.
    Off: such a machine refuses to run commands at all (`SandboxUnavailable`)."""

    max_turns: int = Field(16, ge=1, le=1000)
    """Agent turns (model calls) per episode."""


class RayConfig(_Section):
    replicas: int = Field(2, ge=1, le=256)
    """Engine replicas under `clawr1 up --ray`, each a whole engine in its own Ray actor; the gateway
    keeps a session on one (its prefix cache) and routes around a replica that died."""

    replica_cpus: float = Field(1.0, gt=0, le=256)
    """CPUs Ray reserves for each engine replica."""

    replica_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for each engine replica (a fraction shares one GPU)."""

    judge_workers: int = Field(1, ge=1, le=64)
    """Reward-worker actors; each judges its own share of the turns (by step id)."""

    trainer_ranks: int = Field(1, ge=1, le=256)
    """Data-parallel trainer rank actors (`trainer/ranks.py`): they form a `torch.distributed`
    group themselves (NCCL on GPUs, gloo on CPUs); a rank that dies restarts the whole group."""

    trainer_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for each trainer rank (1: a GPU each, as `cuda:0` inside the actor)."""

    namespace: str = Field("clawr1", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    """Ray namespace of the actors (`clawr1-engine-0`, ..., `clawr1-pool`, `clawr1-trainer`)."""
