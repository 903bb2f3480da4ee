"""Ids the gateway makes: unique across processes and restarts without a syscall per id."""

from __future__ import annotations

import itertools
import uuid

_TAG = uuid.uuid4().hex[:12]  # unique per process; a counter makes the rest (no urandom per request)
_count = itertools.count()


def new_id(prefix: str) -> str:
    """`chatcmpl-...`, `cmpl-...`, `s-...`: unique across processes and restarts (they prefix step
    ids, the pool's idempotency keys, and name sessions)."""
    return f"{prefix}{_TAG}{next(_count):012x}"
