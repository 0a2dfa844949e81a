"""Groups that waited too long: the group timeout policy, and complete groups never emitted.

A group still incomplete `group_timeout_s` after its first member arrived is handled by
`group_timeout_policy` (drop it, re-run its missing members, or release it with the members
present). Every grouper looks for such groups about once a second; the decision is one Lua
script (lua/timeout.lua) that checks the group's age, size and state again and claims it, so
however many groupers look, a group is dropped, re-run or released once per timeout. The
same check emits (or drops) a complete group that nobody emitted (the entry that completed it
was dead-lettered before its emit), once it is that old, or without a timeout once that entry
must have been emitted or dead-lettered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import msgspec
import redis
import structlog

from streamrl.config import Config
from streamrl.grouper import scripts
from streamrl.grouper.scoring import Decision, Outcome, score
from streamrl.names import Keys
from streamrl.obs.tracing import GROUP_FLOW, TRAJ_FLOW, Span, Tracer, flow_id
from streamrl.rl.clock import TrainerVersion
from streamrl.transport import hgetall_bytes
from streamrl.wire import (
    SCHEMA_VERSION,
    Group,
    Task,
    Trajectory,
    WireError,
    decode_body,
    encode_body,
)

# Rebuilds the task at a data-set cursor with a group size: (cursor, num_generations) -> Task.
TaskBuilder = Callable[[int, int], Task]

# The first word of lua/timeout.lua's answer: nothing to do (`gone`, `fresh`, `changed`), or
# what it did.
TimeoutAnswer = Literal[
    "gone", "fresh", "changed", "rerun", "release", "emit", "drop", "drop_max_reruns"
]
_NOTHING_DONE: tuple[TimeoutAnswer, ...] = ("gone", "fresh", "changed")


def trace_wait(tracer: Tracer, group: Group, start_ns: int) -> None:
    """The `group.wait` span of an emitted group, from `start_ns` (this host's clock) to now,
    on track ("group", group_id): it ends the flows of its members' episodes and starts the
    flow to the train step that uses it."""
    end_ns = time.time_ns()
    tracer.span(
        tracer.track("group", group.group_id),
        Span.GROUP_WAIT,
        min(start_ns, end_ns),
        end_ns,
        flows=[flow_id(GROUP_FLOW, group.group_id)],
        ends_flows=[flow_id(TRAJ_FLOW, m.traj_id) for m in group.members],
    )


class GroupTimeouts:
    """Finds the groups past their time and decides on each once (lua/timeout.lua)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        cfg: Config,
        log: structlog.stdlib.BoundLogger,
        rebuild_task: TaskBuilder,
        tracer: Tracer,
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.log = log
        self.rebuild_task = rebuild_task
        self.tracer = tracer
        self._script = client.register_script(scripts.source(scripts.TIMEOUT))

    def stall_ms(self) -> int:
        """Age (ms since its first member arrived) past which a group is looked at:
        `group_timeout_s`; without a timeout, only a complete group is, once the entry that
        completed it must have been emitted or dead-lettered, (max_deliveries + 1) x
        claim_idle_ms after it arrived."""
        if self.cfg.grouper.group_timeout_s > 0:
            return int(self.cfg.grouper.group_timeout_s * 1000)
        t = self.cfg.transport
        return (t.max_deliveries + 1) * t.claim_idle_ms

    def check(self, trainer_version: Callable[[], TrainerVersion]) -> list[Outcome]:
        """Handle every group incomplete for `group_timeout_s` (none when it is 0), and
        emit or drop every complete group left unemitted for `stall_ms` (review M8: the
        entry that completed it was dead-lettered after its add answered `complete`).
        `trainer_version` is read only when some group is due."""
        stall_ms = self.stall_ms()
        sec, usec = self.client.time()  # the clock the start times were written with
        now_ms = sec * 1000 + usec // 1000
        started = hgetall_bytes(self.client, self.keys.groups_started)
        ages = ((gid, now_ms - int(ms)) for gid, ms in started.items())
        old = {gid: age for gid, age in ages if age >= stall_ms}
        if old and self.cfg.grouper.group_timeout_s <= 0:
            # Only complete groups can be due: counted, not read, to find them.
            pipe = self.client.pipeline(transaction=False)
            for gid in old:
                pipe.hlen(self.keys.group_members(gid))
            n, held = self.cfg.rollout.num_generations, pipe.execute()
            old = {g: a for (g, a), h in zip(old.items(), held, strict=True) if h >= n}
        if not old:
            return []
        version = trainer_version()
        out = []
        for gid, age in old.items():
            # Review N2: a group whose check kills or fails its grouper would be read again
            # by every grouper, about once a second, for ever. The checks that began and
            # never ended are counted in Redis, across restarts; at max_deliveries the
            # group is dropped without being read again.
            attempts = int(self.client.hincrby(self.keys.groups_attempts, gid, 1))
            if attempts > self.cfg.transport.max_deliveries:
                outcome = self._poison(gid, stall_ms, attempts - 1)
            else:
                outcome = self._handle(gid, stall_ms, age, version)
            self.client.hdel(self.keys.groups_attempts, gid)
            if outcome is not None:
                out.append(outcome)
        return out

    def _poison(self, group_id: str, stall_ms: int, failed: int) -> Outcome | None:
        """Drop a group whose timeout checks kept failing, without reading its members
        (what killed the groupers); None when it changed meanwhile (checked again)."""
        held = int(self.client.hlen(self.keys.group_members(group_id)))
        reason = (
            f"deciding on it failed {failed} times (a grouper died or raised each time), "
            f"transport.max_deliveries {self.cfg.transport.max_deliveries}"
        )
        done, _ = self._run(group_id, stall_ms, held, held, Decision("drop", reason), -1)
        if done in _NOTHING_DONE:
            return None
        self.log.error("group_dropped", group_id=group_id, reason=reason, held=held)
        return Outcome("dropped", group_id)

    def _members(self, group_id: str) -> tuple[int, list[Trajectory], str]:
        """The group's stored members (in order) and how many entries hold them, or the
        reason they cannot be decoded (members then empty)."""
        raw = hgetall_bytes(self.client, self.keys.group_members(group_id))
        try:
            members = [decode_body(v, Trajectory) for v in raw.values()]
        except WireError as err:
            return len(raw), [], f"a stored member cannot be decoded: {err}"
        return len(raw), sorted(members, key=lambda m: m.member), ""

    def _handle(
        self, group_id: str, stall_ms: int, age_ms: int, trainer_version: TrainerVersion
    ) -> Outcome | None:
        """Decide on one timed-out group, or one complete but never emitted; None when
        another grouper or a member got there first (nothing to do, or look again at the
        next check)."""
        held, members, undecodable = self._members(group_id)
        # Undecodable members tell no group size: one more than held keeps it incomplete.
        n = members[0].num_generations if members else held + 1
        complete = len(members) >= n
        gcfg = self.cfg.grouper
        if not complete and gcfg.group_timeout_s <= 0:
            return None  # incomplete after all: without a timeout it waits for ever
        if undecodable:
            decision = Decision("drop", undecodable)
        elif complete:
            decision = score(members, trainer_version, gcfg)
        else:
            decision = self._decide(group_id, members, trainer_version)
        cursor = members[0].cursor if members else -1
        done, reruns = self._run(group_id, stall_ms, held, n, decision, cursor)
        if done in _NOTHING_DONE:
            return None
        present = [m.member for m in members]
        ev = self.log.bind(
            group_id=group_id,
            waited_s=round(age_ms / 1000, 3),
            present=present,
            missing=sorted(set(range(n)) - set(present)),
            policy=gcfg.group_timeout_policy,
        )
        if done in ("emit", "release") and decision.group is not None:
            trace_wait(self.tracer, decision.group, time.time_ns() - age_ms * 1_000_000)
        if complete:
            return self._stuck_outcome(ev, group_id, decision)
        if done == "rerun":
            ev.warning("group_rerun", rerun=reruns, max_reruns=gcfg.max_reruns)
            return Outcome("rerun", group_id)
        if done == "release":
            ev.warning("group_released", rewards=[m.reward for m in members])
            return Outcome("released", group_id)
        reason = decision.reason
        if done == "drop_max_reruns":
            reason = f"group_timeout after {reruns} reruns (max_reruns {gcfg.max_reruns})"
        ev.warning("group_dropped", reason=reason)
        return Outcome("dropped", group_id)

    def _run(
        self, group_id: str, stall_ms: int, held: int, n: int, decision: Decision, cursor: int
    ) -> tuple[TimeoutAnswer, int]:
        """lua/timeout.lua on the group of task `cursor` (its KEYS and ARGV are listed
        there): what it did, and the group's reruns (before this one; after it, for
        `rerun`)."""
        k = self.keys
        tail_keys, tail_args = scripts.order_tail(k, self.cfg.grouper, cursor)
        res: list[Any] = self._script(
            keys=[
                k.group_members(group_id),
                k.groups_emitted,
                k.groups_dropped,
                k.groups_started,
                k.groups_reruns,
                k.stats,
                k.tasks,
                k.groups,
                *tail_keys,
            ],
            args=[
                group_id,
                stall_ms,
                held,
                n,
                decision.action,
                self.cfg.grouper.max_reruns,
                SCHEMA_VERSION,
                decision.kind,
                decision.body,
                decision.counter,
                *tail_args,
            ],
        )
        done: Any = res[0].decode()
        return done, int(res[1]) if len(res) > 1 else 0

    def _stuck_outcome(
        self, ev: structlog.stdlib.BoundLogger, group_id: str, decision: Decision
    ) -> Outcome:
        """The outcome of a complete group emitted or dropped by a timeout check."""
        stuck = f"complete but never emitted after {self.stall_ms() / 1000:g}s"
        if decision.action == "drop":
            ev.warning("group_dropped", reason=f"{stuck}; {decision.reason}")
            return Outcome("dropped", group_id)
        ev.warning("group_emitted", reason=stuck)
        return Outcome("emitted", group_id)

    def _decide(
        self, group_id: str, members: list[Trajectory], trainer_version: TrainerVersion
    ) -> Decision:
        """What the configured policy makes of a timed-out group holding `members`."""
        gcfg = self.cfg.grouper
        timed_out = f"incomplete after group_timeout_s ({gcfg.group_timeout_s:g}s)"
        if not members:
            return Decision("drop", f"{timed_out}; no member held")
        if gcfg.group_timeout_policy == "drop":
            return Decision("drop", timed_out)
        if gcfg.group_timeout_policy == "rerun":
            return self._rerun(group_id, members, timed_out)
        if len(members) < 2:
            return Decision("drop", f"{timed_out}; release needs 2 members, 1 present")
        scored = score(members, trainer_version, gcfg)
        if scored.action == "drop":
            return replace(scored, reason=f"{timed_out}; {scored.reason}")
        return replace(scored, action="release", reason=timed_out)

    def _rerun(self, group_id: str, members: list[Trajectory], timed_out: str) -> Decision:
        """The task that re-runs the missing members: the group's own task (same ids, so a
        re-run member has the same member index and trajectory id) limited to them."""
        first = members[0]
        if first.cursor < 0:
            return Decision("drop", f"{timed_out}; its members carry no task cursor to re-run")
        task = self.rebuild_task(first.cursor, first.num_generations)
        if (task.group_id, task.task_id) != (group_id, first.task_id):
            return Decision(
                "drop",
                f"{timed_out}; the task rebuilt from cursor {first.cursor} is "
                f"{task.task_id}/{task.group_id}, not {first.task_id}/{group_id}",
            )
        have = {m.member for m in members}
        missing = [i for i in range(first.num_generations) if i not in have]
        task = msgspec.structs.replace(task, members=missing)
        return Decision("rerun", timed_out, body=encode_body(task), kind=Task.KIND)
