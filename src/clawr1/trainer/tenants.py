"""Per-tenant adapters (`tenants.adapter_per_tenant`): one `Trainer` per tenant, all on one base
model in this process (an adapter each), taking turns round-robin so a busy tenant cannot starve a
quiet one. A tenant appears when it first has READY samples; tenants with a checkpoint resume."""

from __future__ import annotations

from typing import Any

from clawr1.core.config import Config
from clawr1.datapool.base import PoolQueue
from clawr1.trainer.checkpoint import state_dir
from clawr1.trainer.loop import Trainer
from clawr1.trainer.policy import Policy


class TenantTrainers:
    def __init__(self, config: Config, pool: PoolQueue):
        self.config, self.pool = config, pool
        self.trainers: dict[str, Trainer] = {}
        self._policy: Policy | None = None
        self._next = 0  # round-robin position among the tenants with READY samples
        known = state_dir(config.data_dir) / "tenants"
        for folder in sorted(known.iterdir()) if known.is_dir() else ():
            self.trainer(folder.name)

    def trainer(self, tenant: str) -> Trainer:
        if tenant not in self.trainers:
            trainer = Trainer(self.config, self.pool, tenant=tenant, policy=self._policy)
            self._policy = trainer.policy  # every later tenant adds its adapter to this base
            self.trainers[tenant] = trainer
        return self.trainers[tenant]

    def run_once(self, stop: Any = None) -> dict[str, Any] | None:
        """One step for the next tenant (in turn) whose batch is due; its metrics carry `tenant`."""
        # Tenants with READY samples, and those whose version in the making may be due by time.
        tenants = sorted({*self.pool.ready_tenants(), *(t for t, tr in self.trainers.items() if tr.accumulated)})
        for i in range(len(tenants)):
            tenant = tenants[(self._next + i) % len(tenants)]
            metrics = self.trainer(tenant).run_once(stop)
            if metrics is not None:
                self._next += i + 1
                return {**metrics, "tenant": tenant}
        return None

    def versions(self) -> dict[str, int]:
        return {tenant: t.version for tenant, t in self.trainers.items()}

    def close(self) -> None:
        for trainer in self.trainers.values():
            trainer.close()
