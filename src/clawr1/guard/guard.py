"""The guard between the trainer and the users: every published LoRA version is a candidate until
it answered the probe set no worse than the incumbent and the base.

It runs in the gateway process, in place of the plain adapter watcher, one loop for every adapter
(the shared policy, or each tenant's):
1. an admin's rollback (`CONTROL`: serve version N again; the trainer restores N) or pin (serve N
   whatever else is promoted) is applied first;
2. the newest published version, if undecided and trained after the last rollback was applied
   (its marker says so; one the trainer published mid-step on the discarded line is rejected), is
   loaded beside the served one under
   `<name>@candidate` (never served to users), asked every probe, measured (`clawr1.quality`), and
   compared with the incumbent's and the base's replies to the same probes and seeds, other seeds
   than those the base's calibration replies were sampled with (`_draw`);
3. `promoted`: the served name flips to it (requests in flight finish on their version);
   `rejected`: it is unloaded and never served, and the trainer, which waits for the verdict,
   rolls back to the incumbent's weights and optimizer state. Either way the verdict (`VERDICT` in
   the version's directory, read by the trainer) and the pool's decision log say why;
4. when a candidate is rejected and the served version itself is out of the base's range on the
   same probe set (drift that added up below each candidate's bound), the guard rolls back, as an
   admin would, to the newest earlier promoted version within the range (or the base).
Nothing here is in a request's path: a request always gets the served version, which only ever
changes by an atomic flip.

With `guard.enabled = false` the same loop is the serving side's only watcher: step 2 becomes
"promote as published" (no probes, no quality model loaded), so the admin's rollback and pin, the
restart rule and `clawr1 versions` work the same with the guard off. A version that does not load
is then rejected (logged once, never retried).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from clawr1.core.config import GuardConfig
from clawr1.core.records import DEFAULT_TENANT, POLICY, adapter_name
from clawr1.core.types import EngineError
from clawr1.engine import adapters as store
from clawr1.guard.memory import probe_gaps
from clawr1.guard.probes import MIN_PROBES, Probe, ProbeSet, ask, everyday_probes, measure, probes_of, replies_of
from clawr1.quality import Summary, Verdict, not_worse

log = logging.getLogger(__name__)
REFERENCE_SEED = 1_000_003  # added to each probe's seed for the base's reference replies (`_draw`)
TOP_UP_S = 5.0  # how often an incomplete probe set looks for more held-out traffic
FALLBACK_TRIES = 3  # earlier promoted versions asked when the served one has left the base's range


@dataclass
class Line:
    """What the guard knows of one adapter's version line."""

    name: str
    tenant: str | None  # whose traffic its probes come from (None: every tenant's, for the shared policy)
    decided: int = 0  # the newest version with a verdict
    served: int = 0  # what the engine serves under `name` (0: the base)
    held: list[Probe] = field(default_factory=list)  # held-out probes not yet in a set
    probes: ProbeSet | None = None
    rollback_id: str | None = None
    pinned: int | None = None
    topped_up_at: float = 0.0
    waiting_since: float | None = None  # when a candidate first found no probe set


def verdicts(candidate: Summary, incumbent: Summary, base: Summary, config: GuardConfig) -> tuple[Verdict, Verdict]:
    """A candidate's paired verdicts: against the incumbent (sane rate within `sane_bound`, KL from
    the base under `max_kl`) and against the base (within `base_bound`). The KL is the mean over
    the probe replies that have one (`summarize`: an empty reply has no tokens, so none); when no
    reply has one, the bound cannot be checked, and an unchecked bound does not pass. (It was
    dropped whenever any reply lacked a KL: one empty reply waved any drift through.)"""
    unmeasured = candidate.kl is None
    against_incumbent = not_worse(candidate, incumbent, config.sane_bound, None if unmeasured else config.max_kl)
    if unmeasured:
        against_incumbent = Verdict(False, f"{against_incumbent.reason}; KL not measured (no probe reply had "
                                           f"tokens with logprobs): max_kl {config.max_kl:.3f} unchecked")
    return against_incumbent, not_worse(candidate, base, config.base_bound)


class Guard:
    def __init__(self, gw: Any):
        self.gw, self.config = gw, gw.config.guard
        self.root = Path(gw.config.data_dir) / "adapters"
        self.judging = self.config.enabled  # off: each new version is promoted as published (`admit`)
        self.lines: dict[str, Line] = {}
        self.decisions: dict[str, int] = {"promoted": 0, "rejected": 0}  # for /metrics
        # Candidates rejected since the last promotion, per adapter (/metrics, the dashboard): a loop
        # that stops learning (every version rejected) is as useless to a user as one that breaks.
        self.rejected_in_a_row: dict[str, int] = {}
        self.sets = 0

    # ---- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        for name in await asyncio.to_thread(self._names):
            await self._survive(name, self._restore(self._line(name)))
        while True:
            await asyncio.sleep(self.gw.config.gateway.adapter_poll_s)
            for name in await asyncio.to_thread(self._names):
                await self._survive(name, self.step(self._line(name)))

    @staticmethod
    async def _survive(name: str, work: Awaitable[None]) -> None:
        """Run one restore or poll; what fails is logged and the next poll tries again. Ended, the
        guard would leave serving on its version with no swap, rollback or pin until a restart."""
        try:
            await work
        except EngineError as exc:  # a version that does not load
            log.error("guard: %s: %s", name, exc)
        except Exception:  # anything else (a file gone mid-read): with its traceback
            log.exception("guard: %s: this poll failed; the next one tries again", name)

    async def step(self, line: Line) -> None:
        """One poll: two small file reads (`CONTROL`, `LATEST`) unless something changed."""
        control = await asyncio.to_thread(store.control, self.root, line.name)
        rollback = control.get("rollback")
        if rollback and rollback.get("id") != line.rollback_id:
            line.rollback_id = rollback["id"]
            await self._rollback(line, control)
        pinned = control.get("pinned")
        if pinned != line.pinned:
            line.pinned = pinned
            await self._serve_first(line, "pinned" if pinned is not None else "unpinned",
                                    f"admin pinned v{pinned}" if pinned is not None else "admin unpinned")
        newest = await asyncio.to_thread(store.newest, self.root, line.name)
        if newest is None or newest[0] <= line.decided:
            return
        stale = await asyncio.to_thread(store.trained_before_rollback, newest[1], control)
        if stale is not None:  # the trainer published it mid-step, before it applied the rollback
            await asyncio.to_thread(self._record, line.name, newest[0], "rejected", stale, {})
            line.decided = newest[0]
            self.decisions["rejected"] += 1
            log.warning("guard: %s v%d rejected: %s", line.name, newest[0], stale)
            return
        await (self.judge if self.judging else self.admit)(line, *newest, serve=pinned is None)

    async def _rollback(self, line: Line, control: dict[str, Any]) -> None:
        """Serve the rollback's target again, the verdicts as `_supersede` leaves them. The trainer
        restores it itself (it reads the same `CONTROL`)."""
        to, by = int(control["rollback"]["to"]), control["rollback"].get("by", "admin")
        await asyncio.to_thread(self._supersede, line.name, control)
        await self._serve(line, to, "rolled_back", f"{by} rollback to v{to}")

    def _supersede(self, name: str, control: dict[str, Any]) -> None:
        """The verdicts after the rollback in `control`: versions promoted after its target and
        trained before it was applied (their marker names another rollback) no longer count as
        promoted, and the target does (even if it was rejected: the admin chose it), so a restart
        serves it too. Idempotent: a restart repeats it for a rollback asked while no guard ran."""
        request = control["rollback"]
        to, by = int(request["to"]), request.get("by", "admin")
        for version in store.published(self.root, name):
            verdict = store.verdict(self.root, name, version)
            path = store.version_dir(self.root, name, version)
            if version > to and verdict and verdict["status"] == "promoted" \
                    and store.read_marker(path).get("rollback") != request["id"]:
                store.decide(self.root, name, version, "superseded", f"rolled back to v{to} by the {by}",
                             verdict["scores"])
            elif version == to and (verdict or {}).get("status") != "promoted":
                store.decide(self.root, name, version, "promoted", f"the {by} rolled back to it",
                             (verdict or {}).get("scores", {}))

    # ---- judging a candidate -------------------------------------------------------------
    async def judge(self, line: Line, version: int, path: Path, serve: bool = True) -> None:
        probes = await self._probe_set(line, version)
        if probes is None:
            return  # not enough held-out traffic yet: the candidate waits (so does the trainer)
        started = time.perf_counter()
        candidate = f"{line.name}@candidate"
        await self.gw.engine.load_adapter(candidate, path)
        try:
            gens = await ask(self.gw.engine, self.gw.pool, probes.probes, candidate, self._tenant(line),
                             f"v{version}")
            gaps = await probe_gaps(self.gw.engine, probes.probes, gens, candidate)
        finally:
            await self.gw.engine.unload_adapter(candidate)
        sampled = time.perf_counter()
        meter = await self.gw.quality_meter()
        summary = await measure(meter, probes.probes, gens, probes.calibration)
        measured = time.perf_counter()
        incumbent = await self._incumbent(line, probes, meter)
        against_incumbent, against_base = verdicts(summary, incumbent, probes.base, self.config)
        ok = against_incumbent.ok and against_base.ok
        reason = (f"vs v{line.served}: {against_incumbent.reason}; vs base: {against_base.reason}" if ok else
                  "; ".join(f"vs {who}: {v.reason}" for who, v in ((f"v{line.served}", against_incumbent),
                                                                   ("base", against_base)) if not v.ok))
        fallback = None
        if not ok and line.served and line.pinned is None:
            # The served version itself, measured on this (possibly fresh) probe set, may have drifted
            # out of the base's range: small losses a 12-probe set cannot see add up over versions,
            # and a guard that only judges candidates would then serve it for good.
            served = not_worse(incumbent, probes.base, self.config.base_bound)
            if not served.ok:
                fallback = await self._fallback(line, probes, meter)
                reason += f"; the served v{line.served} itself is {served.reason}: rolling back to v{fallback}"
        scores = {"candidate": summary.to_dict(), "incumbent": incumbent.to_dict(), "incumbent_version": line.served,
                  "base": probes.base.to_dict(), "probe_set": probes.number, "probes": len(probes.probes),
                  "from_traffic": sum(not p.step_id.startswith("builtin-") for p in probes.probes),
                  "seconds": round(time.perf_counter() - started, 2), "sample_s": round(sampled - started, 2),
                  "measure_s": round(measured - sampled, 2),
                  "memory_gaps": {str(k): round(v["gap"], 4) for k, v in gaps.items()}}
        status = "promoted" if ok else "rejected"
        await asyncio.to_thread(self._record, line.name, version, status, reason, scores)
        line.decided = version
        self.decisions[status] += 1
        self.rejected_in_a_row[line.name] = 0 if ok else self.rejected_in_a_row.get(line.name, 0) + 1
        if not ok and self.rejected_in_a_row[line.name] >= 3:
            log.warning("guard: %s has had %d versions rejected in a row: it learns nothing that serves (see "
                        "`clawr1 versions` for why)", line.name, self.rejected_in_a_row[line.name])
        if ok:
            probes.summaries[version] = summary
            if gaps:  # the served version's need of each reminder, on prompts it never trained on
                mc = self.gw.config.memory
                changed = await asyncio.to_thread(self.gw.pool.check_memory, version, gaps, mc.retire_gap,
                                                  mc.return_gap, mc.retire_min_tokens, True, "probes")
                if changed["retired"] or changed["restored"]:
                    log.info("guard: %s v%d retired memory entries %s (not needed on its probes), restored %s",
                             line.name, version, changed["retired"], changed["restored"])
            if serve:
                await self._serve(line, version, None, "", path)
        if fallback is not None:  # through the admin's lever: the next poll serves it, the trainer restores it
            await asyncio.to_thread(store.set_control, self.root, line.name,
                                    rollback={"to": fallback, "id": f"guard-{line.name}-v{version}", "by": "guard"})
        log.info("guard: %s v%d %s in %.1f s (%s)", line.name, version, status, scores["seconds"], reason)

    async def admit(self, line: Line, version: int, path: Path, serve: bool = True) -> None:
        """The guard off: promote `version` as published and serve it (unless pinned). One that does
        not load is rejected, so it is neither retried every poll nor served after a restart."""
        status, reason = "promoted", "served as published (guard.enabled = false)"
        if serve:
            try:
                await self._serve(line, version, None, "", path)
            except EngineError as exc:
                status, reason = "rejected", f"did not load: {exc}"
        await asyncio.to_thread(self._record, line.name, version, status, reason, {})
        line.decided = version
        self.decisions[status] += 1
        (log.info if status == "promoted" else log.error)("%s v%d %s: %s", line.name, version, status, reason)

    async def _fallback(self, line: Line, probes: ProbeSet, meter: Any) -> int:
        """The newest version promoted before the served one that is within the base's range on this
        probe set (at most `FALLBACK_TRIES` of them asked, newest first; pruned ones skipped), else
        0: the base."""
        earlier = sorted((v for v in await asyncio.to_thread(self._promoted, line.name) if v < line.served),
                         reverse=True)
        name = f"{line.name}@check"
        for version in earlier[:FALLBACK_TRIES]:
            path = store.version_dir(self.root, line.name, version)
            if not (path / store.MARKER).is_file():
                continue
            await self.gw.engine.load_adapter(name, path)
            try:
                gens = await ask(self.gw.engine, self.gw.pool, probes.probes, name, self._tenant(line), f"v{version}")
            finally:
                await self.gw.engine.unload_adapter(name)
            probes.summaries[version] = await measure(meter, probes.probes, gens, probes.calibration)
            if not_worse(probes.summaries[version], probes.base, self.config.base_bound).ok:
                return version
        return 0

    async def _probe_set(self, line: Line, version: int) -> ProbeSet | None:
        """The current probe set; a new one once `refresh_versions` versions used the old one and
        enough new traffic was held out (until then the old one serves on)."""
        current = line.probes
        due = current is None or version - current.drawn_at_version >= self.config.refresh_versions
        if due and (current is None or time.monotonic() - line.topped_up_at >= TOP_UP_S):
            await self._top_up(line)
        enough = self.config.probes - self.config.everyday_probes  # from traffic; the rest are everyday requests
        if due and len(line.held) < enough and current is None:
            line.waiting_since = line.waiting_since or time.monotonic()
            if time.monotonic() - line.waiting_since >= self.config.fallback_after_s:
                line.held += self._everyday(line, self.config.probes - len(line.held))  # thin traffic: everyday
                enough = min(enough, MIN_PROBES)
        if due and len(line.held) >= enough:
            room = self._everyday_room(line.held[:self.config.probes])
            take = self.config.probes - room
            held, line.held = line.held[:take], line.held[take:]
            held += self._everyday(line, room)
            line.probes = await self._draw(line, held, version)
            line.waiting_since = None
        return line.probes

    def _everyday_room(self, held: list[Probe]) -> int:
        """How many of a set's probes go to everyday requests: `guard.everyday_probes`, less those it
        holds already (a thin-traffic set was filled with them)."""
        return max(0, self.config.everyday_probes - sum(p.step_id.startswith("builtin-") for p in held))

    def _everyday(self, line: Line, n: int) -> list[Probe]:
        """`n` everyday requests in the role the traffic serves (its system prompt), other than any
        the line holds."""
        context = [m for m in (line.held[-1].messages if line.held else []) if m.get("role") in ("system", "developer")]
        have = {p.step_id for p in line.held}
        fresh = [p for p in everyday_probes(self.gw.engine.render, context, n + len(have), self.config.probe_max_tokens,
                                            self.gw.sampling_defaults) if p.step_id not in have]
        return fresh[:n]

    async def _top_up(self, line: Line) -> None:
        line.topped_up_at = time.monotonic()
        want = self.config.probes - self.config.everyday_probes - len(line.held)
        if want <= 0:
            return
        ids = await asyncio.to_thread(self.gw.pool.hold_out, line.tenant, want)
        if ids:
            steps = await asyncio.to_thread(self.gw.pool.get_steps, ids)
            line.held += probes_of(steps, self.config.probe_max_tokens, self.gw.engine.render)

    async def _draw(self, line: Line, held: list[Probe], version: int) -> ProbeSet:
        """A new probe set: the base answers it; its replies calibrate the measures. The base then
        answers it once more with other seeds, and those replies are its sane rate in the verdicts
        (and the incumbent's while the base serves); every version answers with those seeds too,
        so a candidate is compared with the base seed for seed, on replies neither was fitted on.
        A calibration keeps nearly all of the replies it was fitted on (~0.97 of 12) but ~0.87 of
        unseen ones, and a candidate's replies are unseen ones as soon as its weights moved:
        against the in-sample rate, a candidate exactly as good as the base was rejected about
        half the time by a 0.1 bound on 12 probes (two unlucky replies), and a Qwen demo run
        rejected five versions in a row that way."""
        self.sets += 1
        if getattr(self.gw.engine, "scores_at_temperature_one_only", False):
            # A vLLM or SGLang server scores the unscaled distribution only, and the meter scores
            # each reply as it was sampled: probes are sampled at 1, uncut, there.
            held = [replace(probe, temperature=1.0, top_p=1.0, top_k=0) for probe in held]
        gens = await ask(self.gw.engine, self.gw.pool, held, None, self._tenant(line), f"set{self.sets}")
        meter = await self.gw.quality_meter()
        calibration, _ = await meter.calibrate(replies_of(held, gens, self.gw.engine))
        unseen = [replace(probe, seed=probe.seed + REFERENCE_SEED) for probe in held]
        base = await measure(meter, unseen, await ask(self.gw.engine, self.gw.pool, unseen, None, self._tenant(line),
                                                      f"set{self.sets}-reference"), calibration)
        held = unseen  # what every version answers: paired with the base's reference replies, seed for seed
        log.info("guard: %s probe set %d of %d held-out requests (base sane rate %.2f)", line.name, self.sets,
                 len(held), base.sane_rate)
        return ProbeSet(self.sets, held, calibration, base, version)

    async def _incumbent(self, line: Line, probes: ProbeSet, meter: Any) -> Any:
        """The served version's replies on this probe set (the base's when the base is served)."""
        if line.served == 0:
            return probes.base
        if line.served not in probes.summaries:
            gens = await ask(self.gw.engine, self.gw.pool, probes.probes, line.name, self._tenant(line),
                             f"v{line.served}")
            probes.summaries[line.served] = await measure(meter, probes.probes, gens, probes.calibration)
        return probes.summaries[line.served]

    # ---- serving -------------------------------------------------------------------------
    async def _serve(self, line: Line, version: int, status: str | None, reason: str, path: Path | None = None) -> None:
        """Flip the served name to `version` (0: the base); `status`: an admin action to log."""
        if version == 0:
            if line.name in self.gw.engine.adapters():
                await self.gw.engine.unload_adapter(line.name)
        else:
            path = path or store.version_dir(self.root, line.name, version)
            started = time.perf_counter()
            await self.gw.engine.load_adapter(line.name, path)
            self.gw.swaps.append((time.time(), line.name, version, time.perf_counter() - started))
        line.served = version
        if status is not None:
            await asyncio.to_thread(self._record, line.name, version, status, reason, {})
        log.info("serving %s v%d%s", line.name, version, f" ({reason})" if reason else "")

    async def _restore(self, line: Line) -> None:
        """After a restart: serve the pinned version, else the newest promoted; versions published
        before (no verdict, older than the newest decided) are not judged again. A rollback asked
        while no guard ran gets its verdicts now (`_supersede`)."""
        control = await asyncio.to_thread(store.control, self.root, line.name)
        if control.get("rollback"):
            await asyncio.to_thread(self._supersede, line.name, control)
        line.rollback_id = (control.get("rollback") or {}).get("id")
        line.pinned = control.get("pinned")
        line.decided = max(await asyncio.to_thread(self._decided, line.name), default=0)
        await self._serve_first(line, None, "restored")

    async def _serve_first(self, line: Line, status: str | None, reason: str) -> None:
        """Serve the first of `store.serve_order` that loads (nothing to do when it serves already).
        A promoted version that does not load is rejected, so no serving side tries it again; a
        pinned one is skipped, with an error in the log, while the pin stands."""
        for version in await asyncio.to_thread(store.serve_order, self.root, line.name):
            if version == line.served:
                return
            try:
                await self._serve(line, version, status, reason)
                return
            except EngineError as exc:
                log.error("guard: %s v%d does not load: %s", line.name, version, exc)
                if version != line.pinned:
                    await asyncio.to_thread(self._record, line.name, version, "rejected", f"did not load: {exc}", {})
                    self.decisions["rejected"] += 1

    # ---- helpers -------------------------------------------------------------------------
    def _line(self, name: str) -> Line:
        if name not in self.lines:
            prefix = adapter_name("")  # "policy-"
            tenant = name[len(prefix):] if name.startswith(prefix) else None
            self.lines[name] = Line(name, tenant)
        return self.lines[name]

    def _tenant(self, line: Line) -> str:
        return line.tenant or DEFAULT_TENANT

    def _names(self) -> list[str]:
        if not self.gw.per_tenant:
            return [POLICY]
        prefix = adapter_name("")
        return sorted(d.name for d in self.root.iterdir() if d.name.startswith(prefix)) if self.root.is_dir() else []

    def _decided(self, name: str) -> list[int]:
        return [v for v in store.published(self.root, name) if store.verdict(self.root, name, v) is not None]

    def _promoted(self, name: str) -> list[int]:
        return [v for v in store.published(self.root, name)
                if (store.verdict(self.root, name, v) or {}).get("status") == "promoted"]

    def _record(self, name: str, version: int, status: str, reason: str, scores: dict[str, Any]) -> None:
        if status in ("promoted", "rejected"):
            store.decide(self.root, name, version, status, reason, scores)
        self.gw.pool.record_version(name, version, status, reason, scores)
