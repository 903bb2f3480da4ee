"""Ids the gateway makes: unique across processes and restarts, and unguessable.

An id names a session (`s-...`) or prefixes a reply's step ids (`chatcmpl-...`), so knowing one
must say nothing about any other: with a process tag and a counter (until 2026-12-07) every reply
told its reader the tag and the count, and so the ids of other tenants' sessions. Each id is a
keyed hash (BLAKE2b, a PRF) of a counter under a random key of this process: 96 bits no one
without the key can predict, distinct within a process as the counter is, and across processes
and restarts as random 96-bit values are. 0.8 us an id, against 1.4 us for `secrets.token_hex`
(one `getrandom` system call each).
"""

from __future__ import annotations

import hashlib
import itertools
import os

_KEY = os.urandom(32)  # this process's; never leaves it
_count = itertools.count()


def new_id(prefix: str) -> str:
    """`chatcmpl-...`, `cmpl-...`, `s-...`: the prefix and 24 unpredictable hex digits."""
    return prefix + hashlib.blake2b(next(_count).to_bytes(8, "big"), key=_KEY, digest_size=12).hexdigest()
