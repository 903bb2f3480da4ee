"""Where the roles run: agent environments and the Ray deployment."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from clawr1.core.config._base import _Section


class EnvsConfig(_Section):
    wall_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one sandboxed command; past it every process of the command is killed
    (the tool message says `killed: wall time`)."""

    cpu_s: int = Field(10, ge=1, le=3600)
    """CPU seconds one process of a sandboxed command may use (RLIMIT_CPU; SIGXCPU, then SIGKILL)."""

    memory_mb: int = Field(1024, ge=64, le=1_048_576)
    """Address space of one process of a sandboxed command (RLIMIT_AS): larger allocations fail."""

    total_memory_mb: int = Field(2048, ge=64, le=1_048_576)
    """Resident memory of all the processes of one sandboxed command together, summed by the host
    every 0.1 s; past it every one is killed (the tool message says `killed: memory`). `memory_mb`
    bounds each process; this bounds the command, which may run `max_procs` of them."""

    max_procs: int = Field(64, ge=8, le=4096)
    """Processes and threads a sandboxed command may have at once (RLIMIT_NPROC, enforced because
    the command never runs as the host's root): a fork bomb stalls here until the wall limit."""

    disk_mb: int = Field(128, ge=1, le=65_536)
    """Size of the workspace and of the private /tmp (each a tmpfs inside the sandbox), and the
    largest file a command may write; the host's disk never sees more than this per episode."""

    output_chars: int = Field(4000, ge=100, le=1_000_000)
    """Head of stdout and of stderr kept in the tool message; the rest is cut, and the message
    says how much."""

    tool_paths: list[Path] = Field(default_factory=list, max_length=64)
    """Host directories (or files) a sandboxed command may read and run besides the system's own
    (/usr, /bin, /lib*, a few files of /etc): a toolchain, a virtual environment. Lent read-only,
    with what is mounted under them; nothing else of the host is there (no home directory, data
    dir, config or socket), so never name one of those."""

    allow_unsandboxed: bool = False
    """Run commands without isolation (only the resource limits) where no sandbox mechanism works.
    Off: such a machine refuses to run commands at all (`SandboxUnavailable`)."""

    max_turns: int = Field(16, ge=1, le=1000)
    """Agent turns (model calls) per episode."""

    @field_validator("tool_paths")
    @classmethod
    def _tool_paths(cls, paths: list[Path]) -> list[Path]:
        for path in paths:
            if not path.is_absolute() or path == Path("/"):
                raise ValueError(f"envs.tool_paths: {str(path)!r} must be an absolute path other than /")
        return paths


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

    trainer_gpus: float | None = Field(None, ge=0, le=64)
    """GPUs Ray reserves for the trainer and for each trainer rank, each seeing its own as `cuda:0`.
    Unset: 1 when the trainer runs on a GPU (`trainer.device` is `cuda...`, or `auto` on a cluster
    with GPUs), else 0. Ray 2.60 leaves every GPU visible to an actor that asked for none: it would
    take `cuda:0` beside engine replica 0, and several ranks would all take it (NCCL then fails on
    the duplicate GPU); so with 0 the trainer's actors see no GPU at all, `trainer.device = "cuda"`
    is refused, and several ranks on GPUs need at least 1 each (`cluster/launch.py`)."""

    namespace: str = Field("clawr1", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    """Ray namespace of the actors (`clawr1-engine-0`, ..., `clawr1-pool`, `clawr1-trainer`)."""
