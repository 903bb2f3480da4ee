"""The data pool's contracts: `PoolQueue`, the writes and the training queue the gateway, the
reward stage, the guard and the trainer use; `PoolReadModel`, the reads of the dashboard, the CLI
and export; `DataPool`, both over one database.

SQLite (`SQLitePool`) is the embedded implementation; a Ray actor or another database can stand
behind the same methods later. Writes return after they are durable, never before: a `True` from
`append_step` means the step survives a crash of this process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

from clawr1.core.records import DEFAULT_TENANT, Hint, Lease, Reward, Step

TRAINED = "trained"  # the status of the trainer's row for a version in the version log (its metrics as scores)


class PoolFullError(Exception):
    """The writer's queue is full; the caller should shed load (the gateway answers 429)."""


class UnknownStepError(KeyError):
    """A reward, hint or read named a step id the pool has not stored."""


class UnknownSessionError(KeyError):
    """A session id (for that tenant) the pool has not stored."""


class UnknownLeaseError(KeyError):
    """An ack named a lease id this pool never handed out."""


ExportFormat = Literal["jsonl", "parquet", "hf"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("jsonl", "parquet", "hf")


@dataclass(frozen=True)
class ExportFilter:
    """Which main turns an export takes. Every bound is optional; they combine with AND. Times are
    unix seconds of the step's recording, `[since, until)`; reward and version bounds are inclusive,
    and a reward bound keeps only rewarded samples (an unrewarded one has no reward to compare)."""

    tenant: str | None = None
    since: float | None = None
    until: float | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    rewarded_only: bool = False
    min_version: int | None = None
    max_version: int | None = None

    def __post_init__(self) -> None:
        for low, high in (("since", "until"), ("min_reward", "max_reward"), ("min_version", "max_version")):
            a, b = getattr(self, low), getattr(self, high)
            if a is not None and b is not None and a > b:
                raise ValueError(f"export filter: {low} ({a}) is after {high} ({b})")
        for name in ("min_version", "max_version"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"export filter: {name} must be >= 0")


class PoolQueue(ABC):
    """The write-and-queue contract the gateway, the judges, the guard and the trainer use: a
    durable event log of steps, rewards, hints and session events, and the training queue.

    A main-turn step becomes a sample (PENDING); a non-zero reward (or `mark_ready`) makes it
    READY; `lease` hands READY samples to a trainer (LEASED); `ack` consumes them (CONSUMED); an
    expired lease returns them to READY. Samples beyond the staleness bound, the masked last
    turn of a session closed without an outcome, and a sample whose training failed
    `pool.max_lease_attempts` times (`poison`) are DROPPED with the reason recorded. Side turns
    are stored but never become samples.
    """

    # -- writing -------------------------------------------------------------------------------

    @abstractmethod
    def submit_step(self, step: Step) -> Future[bool]:
        """Queue a step for the next group commit.

        Returns:
            A future resolved after COMMIT with True if the step is new, False for a replay of a
            stored step id. Async callers: `await asyncio.wrap_future(pool.submit_step(step))`.
        Raises:
            PoolFullError: the write queue is full.
        """

    def append_step(self, step: Step) -> bool:
        """Store a step durably; True if new, False if its step id was already stored.

        When main turn t+1 of a session arrives, turn t gets it as its next state (the messages
        after turn t's reply), whatever order the two arrive in.
        """
        return self.submit_step(step).result()

    def append_steps(self, steps: Iterable[Step]) -> list[bool]:
        """Store many steps; they share transactions (group commit). One bool per step."""
        futures = [self.submit_step(step) for step in steps]
        return [future.result() for future in futures]

    @abstractmethod
    def close_session(self, session_id: str, outcome_reward: float | None = None, *,
                      tenant: str = DEFAULT_TENANT, reason: str = "closed", step_weight: float = 0.0) -> bool:
        """Close a session. With an outcome reward, the last main turn is rewarded with it (source
        `outcome`); without, a last turn still unrewarded is masked (dropped, reason `masked`).

        Step-wise rewards (`step_weight` w > 0, with an outcome): every earlier main turn judged
        from its next state trains with (1 - w) * judge + w * outcome (source `stepwise`, its parts
        in the evidence), whether the judge scored it before this close or scores it later;
        turns with explicit feedback keep the feedback.

        Returns:
            True if it was open, False if already closed (closing twice is harmless).
        Raises:
            UnknownSessionError: no step of that session was stored.
        """

    @abstractmethod
    def open_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT, key_hash: str | None = None) -> bool:
        """Create a session before its first step, optionally bound to the sha256 of its own API key
        (`session_by_key` finds it again after a restart). False if it already existed."""

    @abstractmethod
    def close_idle(self, idle_s: float, keep: Iterable[tuple[str, str]] = (),
                   mine: Callable[[str], bool] | None = None) -> list[tuple[str, str]]:
        """Close (as `close_session` without outcome, reason `idle`) every open session with no
        stored activity for `idle_s` seconds, except the (tenant, session_id)s in `keep` (a gateway
        passes those with a request in flight) and, given `mine`, those whose id it refuses (with
        `gateway.workers`, each process closes only the sessions it serves); returns the ones closed."""

    @abstractmethod
    def add_feedback(self, *, tenant: str = DEFAULT_TENANT, session_id: str | None = None,
                     turn_index: int | None = None, completion_id: str | None = None,
                     score: float | None = None, correction: str | None = None) -> list[str]:
        """Explicit feedback on a completion's choices (`completion_id`), a session's turn, or its
        latest main turn: a reward with source `feedback` and/or the correction as a hint, for each.

        Returns:
            The step ids it was recorded for.
        Raises:
            UnknownSessionError, UnknownStepError: nothing matches (nothing is recorded).
        """

    @abstractmethod
    def submit_reward(self, reward: Reward) -> Future[None]:
        """Queue a reward for the next group commit; the future resolves after COMMIT (or raises
        UnknownStepError). See `add_reward`."""

    def add_reward(self, reward: Reward) -> None:
        """Record a reward; the step's sample takes its score (latest wins) and is READY when it is
        non-zero, PENDING when zero (unless already leased, consumed or dropped). A judge's score
        never overrides feedback, an outcome or a step-wise mix, nor a step-wise mix feedback: those
        are kept as history only. A judge score for an earlier turn of a session closed with an
        outcome and a step weight also records the step-wise mix (see `close_session`)."""
        self.submit_reward(reward).result()

    @abstractmethod
    def submit_judgement(self, reward: Reward, hint: Hint | None) -> Future[None]:
        """Queue a judge's verdict, its reward and its hint (if any), as one write for the next
        group commit: a zero score with a hint also makes the sample READY (distillation material
        without a reward). All or nothing: a stop between the parts would leave a reward without
        its hint, and a judged turn is never judged again. See `add_reward`."""

    def add_judgement(self, reward: Reward, hint: Hint | None) -> None:
        """`submit_judgement`, waiting for its commit."""
        self.submit_judgement(reward, hint).result()

    @abstractmethod
    def add_hint(self, hint: Hint) -> None:
        """Record a textual hint for a step (its sample's state is unchanged; see `mark_ready`)."""

    @abstractmethod
    def judge_failed(self, step_id: str, error: str, max_attempts: int, retry_s: float) -> bool:
        """Record a failed judging attempt of a main turn, with its error. The turn is judged again
        no sooner than `retry_s * 2**(attempts - 1)` seconds later; the `max_attempts`-th failure
        gives up on it (the sample keeps `judge_gave_up_at` and the last error as the reason) and
        `unjudged` never returns it again. Feedback and outcomes still apply to it.

        Returns:
            True if this failure gave up on the turn.
        Raises:
            UnknownStepError: no main turn with that step id.
        """

    @abstractmethod
    def hold_out(self, tenant: str | None, n: int) -> list[str]:
        """Take up to `n` recent main turns of `tenant` out of training (reason `probe`), one per
        session, among those nothing has trained on yet; returns their step ids. The guard asks
        each candidate version these requests (as side turns), so its probe set is held out."""

    @abstractmethod
    def record_version(self, adapter: str, version: int, status: str, reason: str, scores: dict[str, Any]) -> None:
        """Append an event of a policy version (the trainer's `trained`, with its metrics as the
        scores; the guard's `promoted` / `rejected`, an admin's `pinned` / `rolled_back`), with why
        and the scores it was based on."""

    @abstractmethod
    def forget_memory(self, entry_id: int | None = None, *, tenant: str | None = None,
                      user: str | None = None) -> list[int]:
        """Forget a memory entry (`entry_id`, within `tenant` when given) or every active entry of
        one user (`tenant` and `user` both): status `forgotten`, kept for its provenance (steps that
        carried it name it), never added to a prompt again. Returns the ids forgotten."""

    @abstractmethod
    def check_memory(self, version: int, gaps: dict[int, dict[str, Any]], retire_gap: float, return_gap: float,
                     min_tokens: int, retire: bool = True, source: str = "trained") -> dict[str, list[int]]:
        """A consolidation measure of memory entries on the served `version` (`gaps`: entry id ->
        `gap`, nats a token between the version reminded of the entry and not; `tokens`; `steps`,
        the step ids): recorded per entry (`checks`, with its `source`: `trained`, the trainer's
        rows, or `probes`, the guard's held-out probes), an active entry with a small enough gap on
        enough tokens `retired` (it leaves the prompts) unless `retire` is False, a retired one with
        a large gap `restored`. Returns the ids of both."""

    @abstractmethod
    def memory_recheck(self, tenant: str | None = None, limit: int = 8) -> list[dict[str, Any]]:
        """Retired entries to measure again (id, user_id, `steps`: the step ids it retired on), the
        longest unchecked first."""

    @abstractmethod
    def switch_memory(self, tenant: str, user: str = "", off: bool = True) -> bool:
        """Turn the memory off (`off`) or on again for one user of a tenant, or (`user` "") for the
        whole tenant: no entry is made for them or added to their prompts while it is off. True if
        that changed anything."""

    @abstractmethod
    def memory_changes(self, entries_since: int = 0, switches_since: int = 0) -> dict[str, Any]:
        """The memory's changes after the given change numbers (0: the active entries and every
        switch): `entries` (id, tenant, user_id, text, status, created_at, rev), `switches`
        (tenant, user_id, off, rev), and `entries_rev` / `switches_rev` to ask from next time. The
        gateway polls it (`memory.refresh_s`): a read of the index, nothing when nothing changed."""

    @abstractmethod
    def mark_ready(self, step_id: str) -> bool:
        """Make a PENDING sample READY (e.g. a hint-only sample for distillation); False if it was
        not pending or the step is a side turn."""

    # -- training ------------------------------------------------------------------------------

    @abstractmethod
    def lease(self, n: int, max_staleness: int | None = None, current_version: int = 0,
              tenant: str | None = None) -> Lease:
        """Lease up to n READY samples until `expires_at`; with `tenant`, only that tenant's (a
        per-tenant adapter trains on nothing else).

        Samples more than `max_staleness` versions behind `current_version` are dropped or
        down-weighted first (reason `stale`); the rest are mixed fresh/off-policy by the configured
        fraction, newest version first, oldest first within a version.
        """

    @abstractmethod
    def ack(self, lease: Lease | str) -> int:
        """Consume a lease's samples; returns how many. Acking twice returns 0 the second time; a
        late ack consumes those of its samples that were not leased again meanwhile."""

    @abstractmethod
    def release(self, lease: Lease | str, failed: dict[str, str] | None = None) -> int:
        """Give an open lease back now, unacknowledged (the trainer could not train it): its
        samples return to READY. `failed`: step id -> why its training failed (out of memory, a
        non-finite gradient); each counts against the sample's `pool.max_lease_attempts`, as an
        expiry does for every sample of the lease, and the last attempt drops it as `poison`.
        Returns how many samples went back to READY (0 for a lease acknowledged or expired)."""

    @abstractmethod
    def expire_leases(self) -> int:
        """Return the samples of every expired, unacknowledged lease to READY, each counting a failed
        attempt (see `release`); returns how many went back to READY."""

    # -- reading -------------------------------------------------------------------------------

    @abstractmethod
    def get_steps(self, step_ids: Iterable[str]) -> list[Step]:
        """The stored steps, in the order asked (with `next_state` when linked)."""

    @abstractmethod
    def last_turn(self, session_id: str, tenant: str = DEFAULT_TENANT) -> int | None:
        """The highest stored turn index of a session (None if it has no step): where a restarted
        gateway resumes numbering."""

    @abstractmethod
    def session_by_key(self, key_hash: str) -> tuple[str, str, str] | None:
        """(tenant, session_id, status) of the session whose API key hashes to `key_hash`."""

    @abstractmethod
    def ready_state(self, tenant: str | None = None) -> tuple[int, float | None]:
        """(number of READY samples, epoch time the oldest of them became READY), of one tenant or all."""

    @abstractmethod
    def ready_tenants(self) -> list[str]:
        """The tenants that have READY samples (a per-tenant trainer's work list)."""

    @abstractmethod
    def hints(self, step_ids: Iterable[str]) -> dict[str, str]:
        """The hint each of these steps trains with (explicit feedback before the judge's)."""

    @abstractmethod
    def previous_turns(self, step_ids: Iterable[str]) -> dict[str, str]:
        """For each of these main turns that has one, the main turn before it in its session (the
        turn whose next state it holds): step id -> that turn's step id."""

    @abstractmethod
    def unjudged(self, limit: int = 64, shard: tuple[int, int] = (0, 1)) -> list[str]:
        """Step ids of main turns whose next state has arrived and that have no reward yet, of one
        judge shard: with `shard = (i, n)`, those whose `schema.shard_key(step_id) % n == i` (n judge
        workers share the turns, none judged twice, and a stuck shard holds up no other). Turns the
        judge gave up on, or waiting to be retried after a failure (`judge_failed`), are left out."""

    def pending_writes(self) -> int:
        """Writes queued and not yet committed (the gateway sheds load before this reaches the cap)."""
        return 0

    def write_error(self) -> str | None:
        """Why the pool cannot write now: the error of the last commit if it failed (disk full, an
        I/O error, a lock held past `busy_timeout_s`), cleared by the next commit that stores
        something or by a successful `check_writable`. None while writes succeed. Cheap (no I/O):
        the gateway asks on every request and answers 503 while it is set."""
        return None

    def check_writable(self) -> str | None:
        """Try a tiny real write now (committed, so it reaches the disk); None if it succeeded,
        which clears `write_error`, else why not. The gateway's half-open probe: it runs this (in a
        thread, every few seconds at most) while `write_error` is set, and admits again on None."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Finish queued writes and release the database."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolReadModel(ABC):
    """The read model the dashboard, the CLI and export use: counts, listings, one step or session
    in full, the guard's decision log, training sets. Nothing on a request's or a training step's
    path reads through it."""

    @abstractmethod
    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Counts: sessions, steps, rewards, hints, samples by status, drops by reason, leases; and
        `db_bytes`, the pool's size on disk. With `tenant`, that tenant's counts only."""

    @abstractmethod
    def tenant_usage(self) -> dict[str, int]:
        """What each tenant's steps take in the pool (characters and bytes of their stored fields),
        the measure of `tenants.storage_quota_bytes`. One small read: the gateway polls it."""

    @abstractmethod
    def sessions(self, limit: int = 100, tenant: str | None = None) -> list[dict[str, Any]]:
        """The most recently active sessions (of one tenant or all), newest first."""

    @abstractmethod
    def samples(self, limit: int = 50, status: str | None = None, tenant: str | None = None) -> list[dict[str, Any]]:
        """The most recently changed samples (the training queue), newest first: step, session, turn,
        version, status, reward, weight, reason (why dropped or down-weighted), lease, times."""

    @abstractmethod
    def versions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Per policy version that served main turns, oldest first: `version`, `turns` served,
        `rewarded`, `mean_reward`, `approved` (reward > 0), `corrected` (reward < 0), and
        `first_served_at` (when its first reply, of any tenant, was recorded)."""

    @abstractmethod
    def lease_ready_times(self, lease_ids: Iterable[str]) -> dict[str, list[float]]:
        """For each lease, when each of its samples became READY (its reward arrived): with the
        trainer's lease-to-version log this gives the feedback-to-serving latency."""

    @abstractmethod
    def show(self, ident: str, tenant: str | None = None, kind: Literal["step", "session"] | None = None) -> dict[str, Any]:
        """One step (with sample, rewards, hints) or one session (with its steps and events), in
        `tenant` when given; `kind` says which (`None`: whichever `ident` names, for a person)."""

    @abstractmethod
    def export(self, path: Path, format: ExportFormat = "jsonl", *, rewarded_only: bool = False,
               filters: ExportFilter | None = None) -> int:
        """Write main-turn samples in TRL's conversational form: `prompt` (the messages), `completion`
        (the assistant reply as a one-message list), with `reward`, `hint` (the one it trains with),
        `session_id`, `turn_index`, `policy_version`, `tenant`, `created_at`, provenance, and
        `memory` (JSON text: the memory entries the prompt carried and the text they added). Returns
        the row count. `jsonl`/`parquet` write one file (`datasets.load_dataset("json"|"parquet")`);
        `hf` a `datasets.Dataset.save_to_disk` directory (`datasets.load_from_disk`; needs the
        `datasets` package, refuses an existing path). `rewarded_only` is `filters.rewarded_only`.
        Atomic: nothing appears at `path` until the export is complete."""

    @abstractmethod
    def memory(self, tenant: str | None = None, user: str | None = None, status: str | None = None,
               limit: int = 100) -> list[dict[str, Any]]:
        """Memory entries, newest first (of one tenant, user, status, or all): the text, its topic,
        status (and why: a refusal's reason; `replaced_by`), where it came from (`source`, the
        corrected `step_id`, its `session_id`, the user's `correction`) and when."""

    @abstractmethod
    def memory_entry(self, entry_id: int, tenant: str | None = None) -> dict[str, Any]:
        """One memory entry as `memory` lists it, with the entries it `replaced`; KeyError if none."""

    @abstractmethod
    def memory_switches(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Where the memory is off at run time (`switch_memory`): tenant, user_id ("" = the whole
        tenant), since when."""

    @abstractmethod
    def policy_versions(self, adapter: str | None = None) -> list[dict[str, Any]]:
        """Every recorded version event (of one adapter or all), oldest first: `adapter`, `version`,
        `status`, `reason`, `scores`, `decided_at`."""

    def trained_versions(self, adapter: str | None = None) -> list[dict[str, Any]]:
        """The trainer's metrics per version, oldest first, from the version log (the `trained`
        rows `record_version` got from the trainer, wherever it ran): the newest row of a version
        wins (a resumed trainer may record one again); `time` is when it was recorded (after
        publication)."""
        by_version = {row["version"]: {**row["scores"], "time": row["decided_at"]}
                      for row in self.policy_versions(adapter) if row["status"] == TRAINED}
        return [by_version[v] for v in sorted(by_version)]


class DataPool(PoolQueue, PoolReadModel):
    """A whole pool: the queue contract and the read model over one database (`SQLitePool`,
    `PostgresPool`, the Ray deployment's `RayPool`)."""
