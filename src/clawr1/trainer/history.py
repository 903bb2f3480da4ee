"""The trainer's per-version log, `<data_dir>/trainer/metrics.jsonl`: one JSON object per published
version (its metrics, the lease it trained on, when it was published). The loop appends it (and
mirrors it to TensorBoard, and to Weights & Biases when configured). Each version's metrics also go
to the pool's version log (`record_in_pool`), where the dashboard and the demo read them
(`pool.trained_versions`) wherever the trainer runs. Reading imports nothing heavy (no torch, no wandb)."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawr1.datapool.base import TRAINED

if TYPE_CHECKING:
    from clawr1.datapool.base import PoolQueue

METRICS_FILE = Path("trainer") / "metrics.jsonl"

# Per-version drift metrics (`Trainer.loss`/`train_step`), beside the learning ones: a policy that
# wins its reward by degenerate output shows it here first.
DRIFT_FIELDS = (
    "entropy",  # the policy's mean per-token entropy over reply positions (nats, whole vocabulary)
    "kl_base",  # KL(policy || base) per reply token over the whole vocabulary, before the update
    "kl_sampler",  # KL(sampler || learner) on the sampled tokens: off-policy data, or an engine/trainer mismatch
    "adv_pos_frac", "adv_neg_frac", "adv_zero_frac",  # shares of reply tokens by advantage sign
    "reward_baseline",  # the online rewards' moving average (`trainer.baseline = "ema"`)
    "lr",  # the learning rate of the step (`trainer.warmup_steps`)
)
log = logging.getLogger(__name__)


def record_in_pool(pool: PoolQueue, adapter: str, metrics: dict[str, Any]) -> None:
    """A published version's metrics as a row of the pool's version log (`policy_versions`, beside
    the guard's decisions), which the dashboard reads (`pool.trained_versions`): status `trained`,
    the metrics as its scores."""
    pool.record_version(adapter, int(metrics["version"]), TRAINED,
                        f"trained on {metrics.get('lease', 0)} samples", metrics)


def metrics_path(data_dir: Path, tenant: str | None = None) -> Path:
    """`trainer/metrics.jsonl`, or `trainer/tenants/<tenant>/metrics.jsonl` for a tenant's adapter."""
    if tenant is None:
        return Path(data_dir) / METRICS_FILE
    return Path(data_dir) / "trainer" / "tenants" / tenant / METRICS_FILE.name


def read_metrics(data_dir: Path, tenant: str | None = None) -> list[dict[str, Any]]:
    """Every complete line of the log (a line still being written is skipped)."""
    return MetricsTail(data_dir, tenant).read()


class MetricsTail:
    """Reads the log incrementally: each `read()` parses only the lines appended since the last one,
    so a dashboard refreshing every few seconds never re-parses a long run's history."""

    def __init__(self, data_dir: Path, tenant: str | None = None):
        self.path = metrics_path(data_dir, tenant)
        self._offset = 0
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # the dashboard reads from worker threads

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._read()

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            self._offset, self._rows = 0, []
            return []
        with open(self.path, "rb") as log:
            log.seek(0, 2)
            if log.tell() < self._offset:  # replaced by a shorter file (a new run in this data dir)
                self._offset, self._rows = 0, []
            log.seek(self._offset)
            chunk = log.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # nothing after the last newline: still being written
        self._offset += len(complete)
        self._rows += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return list(self._rows)


class MetricsLog:
    """Where the trainer's metrics go: always the JSONL log; TensorBoard event files when tensorboard
    is installed (`<data_dir>/trainer/tensorboard`); a Weights & Biases run when `wandb_project` is
    set, resumed under the same id after a restart (`<data_dir>/trainer/wandb-run-id`)."""

    def __init__(self, data_dir: Path, wandb_project: str | None = None, run_config: dict[str, Any] | None = None,
                 tenant: str | None = None):
        self.path = metrics_path(data_dir, tenant)
        self.root = self.path.parent
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard = self._tensorboard()
        self.wandb = self._wandb(wandb_project, run_config or {}) if wandb_project else None

    def _tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional; the JSONL log always exists
            log.info("tensorboard not installed: metrics go to %s only", self.path)
            return None
        return SummaryWriter(str(self.root / "tensorboard"))

    def _wandb(self, project: str, run_config: dict[str, Any]) -> Any:
        try:
            import wandb
        except ImportError as error:  # configured but missing: say so at start, not silently never
            raise ImportError("trainer.wandb_project is set but wandb is not installed: pip install wandb "
                              "(or unset trainer.wandb_project)") from error
        id_file = self.root / "wandb-run-id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:16])
        return wandb.init(project=project, id=id_file.read_text().strip(), resume="allow", dir=str(self.root),
                          config=run_config)

    def write(self, metrics: dict[str, Any], step: int) -> None:
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"time": time.time(), **metrics}) + "\n")
        scalars = {f"trainer/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
