"""Data-parallel training over `torch.distributed`: N trainer ranks, one per GPU (NCCL) or CPU
process (gloo), training one LoRA together, or one fully fine-tuned model whose decoder layers are
sharded across them (FSDP2, `sharded.py`).

Rank 0 is the only one that talks to the pool and the disk (lease, publish, checkpoint, ack, the
guard's verdict); it broadcasts each lease's samples, and every rank trains on its share, split by
tokens (`share`). Before each optimizer step the gradient sums and the token count are all-reduced,
so every rank takes the same step from the same sum as one process would: the weights never
diverge and need no broadcast. Gradients are reduced by hand (one flat all-reduce of the LoRA
gradients, what DDP does) rather than through the DDP wrapper, because a version accumulates
across leases and micro-batches of unequal sizes, and a rank may have no sample in a lease.

A rank that dies breaks the collective: the others fail, the launcher (`launch`) stops them all,
and the leases of the version in the making expire and return (nothing was acknowledged), so
nothing is lost and nothing is trained twice, exactly as when the single trainer crashes.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from clawr1.core.config import ranks_device_error

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Ranks:
    """This process's place in the trainer group (rank 0 of 1 when not distributed)."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str, timeout_s: float = 600.0) -> Ranks:
        """Join the group `launch` (or torchrun, or a Ray actor) described in the environment;
        alone without `WORLD_SIZE` > 1. NCCL when the trainer is on CUDA, else gloo. `timeout_s`:
        the longest any collective may wait; the others wait in one while rank 0 waits for the
        guard's verdict, so it must outlast `guard.decision_timeout_s` (`group_timeout`)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        error = ranks_device_error(device, world)
        if error:  # before joining: every rank refuses alone, none waits for the others
            raise ValueError(error)
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size())

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (any picklable object)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, lengths: list[int]) -> list[int]:
        """The indices of the samples this rank trains on: longest first, each to the rank with the
        fewest tokens so far (ties to the lower rank), so the ranks' work is even and every rank
        computes the same split."""
        if self.world == 1:
            return list(range(len(lengths)))
        load = [0] * self.world
        mine = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            to = min(range(self.world), key=lambda r: (load[r], r))
            load[to] += lengths[i]
            if to == self.rank:
                mine.append(i)
        return sorted(mine)

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Every rank's gradients summed into each rank's `.grad` (one flat all-reduce). Sharded
        parameters (FSDP2 under full fine-tuning, `sharded.py`) are left out: FSDP has already
        reduced their gradients, each rank keeping the sum of its own shard."""
        params = [p for p in params if not isinstance(p, DTensor)]
        if self.world == 1 or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n

    def most(self, count: int) -> int:
        """The largest `count` over the ranks."""
        if self.world == 1:
            return count
        # NCCL reduces CUDA tensors only; gloo CPU ones.
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        value = torch.tensor([count], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)

    def sum_dicts(self, values: dict[str, float]) -> dict[str, float]:
        """Key-wise sums of every rank's `values` (a rank may lack keys another has)."""
        if self.world == 1:
            return values
        every: list[dict[str, float]] = [{} for _ in range(self.world)]
        dist.all_gather_object(every, values)
        out: dict[str, float] = {}
        for d in every:
            for key, value in d.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (any picklable object), in rank order."""
        if self.world == 1:
            return [value]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, value)
        return every

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(command: list[str], nproc: int, poll_s: float = 0.5) -> int:
    """Run `command` as `nproc` ranks on this host (the environment torchrun would give them) and
    wait. When one rank exits, the others are given 30 s to follow (they finish or fail on the
    broken collective), then stopped; the exit code is the first non-zero one, else 0."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: Any) -> None:  # `up` stopping us: every rank finishes its step
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(poll_s)
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    failed = [c for c in codes if c]
    if failed:
        print(f"trainer ranks exited with {codes}", file=sys.stderr)
    return failed[0] if failed else 0


def group_timeout(decision_timeout_s: float) -> float:
    """A collective's timeout for the trainer's ranks: past the guard's longest wait for a verdict
    (during which rank 0 is out of the collectives the others wait in), with room to spare, and
    never under torch's default of 10 minutes."""
    return max(600.0, decision_timeout_s + 300.0)
