"""The one supervisor: a long-running part that must not stay down (the trainer's child process
under `clawr1 up`, the trainer's and the judges' loops on Ray actors) is started again when it
stops, saying why; serving never stops for it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


async def keep_running(name: str, run: Callable[[], Awaitable[Any]], *, again_on_return: bool = False,
                       delay_s: float = 2.0) -> None:
    """Await `run()`, and again `delay_s` later each time it raises (with `again_on_return`, also
    each time it returns: a process that must never end). Cancelled with the server."""
    while True:
        try:
            await run()
            if not again_on_return:
                return
            log.error("%s ended; starting it again", name)
        except Exception as error:  # noqa: BLE001 - a supervisor: whatever stopped it is logged, it starts again
            log.error("%s stopped (%s: %s); starting it again", name, type(error).__name__, error)
        await asyncio.sleep(delay_s)
