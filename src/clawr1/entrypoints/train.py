"""`clawr1 train`: the trainer process (one, or N data-parallel ranks: this command launches N
copies of itself as ranks), training until SIGTERM or Ctrl-C finishes the current step."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from clawr1.core.config import Config, ranks_device_error
from clawr1.entrypoints.console import err_console, say


def cmd_train(args: argparse.Namespace, config: Config) -> int:
    import threading

    from clawr1.datapool import open_pool
    from clawr1.trainer.checkpoint import exists as checkpoint_exists
    from clawr1.trainer.loop import Trainer, train_until
    from clawr1.trainer.ranks import Ranks, group_timeout
    from clawr1.trainer.tenants import TenantTrainers

    if args.resume and not checkpoint_exists(config.data_dir):
        err_console.print(f"[red]error:[/red] --resume: no trainer checkpoint under {config.data_dir}")
        return 1
    if args.nproc > 1 and config.trainer.backend == "tinker":
        err_console.print("[red]error:[/red] --nproc > 1 is for local ranks; trainer.backend = \"tinker\" trains on "
                          "the service")
        return 2
    if args.nproc > 1 and config.tenants.adapter_per_tenant:
        err_console.print("[red]error:[/red] --nproc > 1 trains the shared adapter; per-tenant adapters train "
                          "in one process")
        return 2
    error = ranks_device_error(config.trainer.device, args.nproc)
    if error:
        err_console.print(f"[red]error:[/red] {error}")
        return 2
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # the launcher: N copies of this command as ranks
        from clawr1.trainer.ranks import launch

        return launch([sys.executable, "-m", "clawr1.cli.main", *args.argv], args.nproc)
    ranks = Ranks.from_env(config.trainer.device, group_timeout(config.guard.decision_timeout_s))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # finish the current step, then exit
    with open_pool(config) as pool:
        with err_console.status("Loading the policy ..."):
            if config.trainer.backend == "tinker":
                from clawr1.trainer.tinker import TinkerTrainer

                trainer = TinkerTrainer(config, pool)
            else:
                trainer = (TenantTrainers(config, pool) if config.tenants.adapter_per_tenant
                           else Trainer(config, pool, ranks=ranks))
        where = (f"one adapter per tenant, resumed {trainer.versions()}" if isinstance(trainer, TenantTrainers)
                 else f"at step {trainer.step_count}, policy v{trainer.version}")
        if ranks.lead:
            say(config, f"[green]trainer[/green] method={config.trainer.method} batch={config.trainer.batch_size} "
                f"{where}{f', {ranks.world} ranks' if ranks.world > 1 else ''}; waiting for READY samples",
                "trainer waiting for READY samples", method=config.trainer.method,
                batch_size=config.trainer.batch_size, where=where, ranks=ranks.world)
        def published(metrics: dict[str, Any]) -> None:
            who = f"{metrics['tenant']} " if "tenant" in metrics else ""
            say(config, f"{who}v{metrics['version']}: {metrics['lease']} samples, loss {metrics['loss']:+.4f}, "
                f"reward {metrics['reward_mean']:+.2f}, hints {metrics['hint_rate']:.0%}, "
                f"clip {metrics['clip_frac']:.2f}, {metrics['total_s']:.1f} s",
                f"published policy v{metrics['version']}", metrics=metrics)

        try:
            train_until(trainer, stop, ranks, config.trainer.poll_s, on_version=published)
        except KeyboardInterrupt:
            pass
        finally:
            trainer.close()  # flush TensorBoard, finish the W&B run
            ranks.close()
    return 0
