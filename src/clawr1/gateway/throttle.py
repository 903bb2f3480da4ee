"""Failed key checks per client address: past `gateway.auth_failures_per_minute` in a minute, every
request from that address is refused (429) for the rest of that minute, whatever key it carries, so
guessing keys (agent keys, per-session keys, the admin key, the dashboard's sign-in) costs an
attacker a minute per handful of guesses and the gateway a dict lookup per request. A request with a
right key never counts. Both tables are bounded (oldest addresses dropped first), so a flood of
spoofed addresses costs memory no more than `MOST` entries.

The address is the socket's peer; behind the front (`gateway.workers` > 1) the front's
`X-Forwarded-For`, which the workers trust from the front only.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

from clawr1.gateway.errors import APIError

MOST = 65_536  # addresses remembered in each table
WINDOW_S = 60.0


class Throttle:
    def __init__(self, limit: int):
        self.limit = limit
        self.blocked: dict[str, float] = {}  # address -> monotonic time its block ends
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()  # address -> (window start, count)

    def check(self, client: str | None) -> None:
        """429 while `client` is blocked (callers skip the call while nobody is: `if throttle.blocked`)."""
        until = self.blocked.get(client or "")
        if until is None:
            return
        left = until - time.monotonic()
        if left <= 0:
            del self.blocked[client or ""]
            return
        raise APIError(429, f"too many failed key checks from this address; retry in {math.ceil(left)} s",
                       code="too_many_failed_attempts")

    def failed(self, client: str | None) -> None:
        """Count a failed key check of `client`; at the limit, block it until its window ends."""
        address, now = client or "", time.monotonic()
        start, count = self._failures.pop(address, (now, 0))
        if now - start >= WINDOW_S:
            start, count = now, 0
        self._failures[address] = (start, count + 1)
        if len(self._failures) > MOST:
            self._failures.popitem(last=False)
        if count + 1 >= self.limit:
            self.blocked.pop(address, None)
            self.blocked[address] = start + WINDOW_S
            if len(self.blocked) > MOST:
                del self.blocked[next(iter(self.blocked))]
