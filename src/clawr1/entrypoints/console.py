"""Status lines of the long-running commands: rich markup on a terminal, JSON log records under
`log_format = "json"` (so every line a log shipper reads is JSON)."""

from __future__ import annotations

import logging

from rich.console import Console

from clawr1.core.config import Config

err_console = Console(stderr=True)


def say(config: Config, markup: str, message: str, **fields: object) -> None:
    """A status line: `markup` on a terminal; under `log_format = "json"` a log record `message`
    with `fields` instead."""
    if config.log_format == "json":
        logging.getLogger("clawr1.cli").info(message, extra=fields)
    else:
        err_console.print(markup)
