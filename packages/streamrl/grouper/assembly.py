"""Group assembly, atomic in Redis so any number of groupers can run.

A grouper keeps no state of its own. Each trajectory is added to its group's hash with
HSETNX (a member already present is ignored) and acknowledged in the same Lua script, unless
it completes the group: then the grouper scores it (`scoring.score`: advantages, or a drop
with its reason) and a second script emits the group exactly once (SADD on the emitted set),
deletes the hash and acknowledges the entry. A grouper killed between the two scripts leaves
that entry pending; whoever claims it re-adds the member (a no-op), sees the group complete
and emits it.

A read batch costs two round trips, not two per trajectory: one pipeline holds the add
scripts of the whole batch (and the drops of stale members), a second the emits and drops
of the groups the first completed (a stale member of a group added to earlier in the batch
starts another pair). The outcomes are those of handling the deliveries one by one, in order.

Groups past their time are `timeouts.GroupTimeouts`' part; the scripts are in lua/.

Traced (`tracer`): each group emitted is a `group.wait` span on track ("group", group_id),
from its first member's arrival (the Redis time the add script recorded, which the
completing add returns) to the emission (`timeouts.trace_wait`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import redis
import structlog
from redis.commands.core import Script
from redis.typing import EncodableT

from streamrl import counters
from streamrl.config import Config
from streamrl.grouper import scripts
from streamrl.grouper.scoring import (
    EMITTED,
    Decision,
    Outcome,
    OutcomeKind,
    score,
    stale_reason,
)
from streamrl.grouper.timeouts import GroupTimeouts, TaskBuilder, trace_wait
from streamrl.names import Keys
from streamrl.obs.metrics import (
    GROUPS,
    GROUPS_HALF_FILLED,
    OLDEST_HALF_FILLED_S,
    Metrics,
    queue_depth,
    queue_lag,
)
from streamrl.obs.tracing import Tracer
from streamrl.queues import backlog, partial_groups
from streamrl.rl.clock import PolicyClock, TrainerVersion, policy_clock
from streamrl.run.liveness import Liveness
from streamrl.tasks.base import group_cursor
from streamrl.tasks.mixture import make_task, mixture
from streamrl.transport import Delivery, RedisStreamConsumer
from streamrl.wire import SCHEMA_VERSION, Trajectory, WireError, decode_body, encode_body

TIMEOUT_CHECK_EVERY_S = 1.0  # how often a grouper looks for timed-out groups (at most)
WAITING_EVERY_S = 0.2  # how often a grouper publishes the groups waiting for the trainer
WAITING_TTL_MS = 10_000  # a count older than this is gone (no grouper runs to renew it)

# A script with its KEYS and ARGV, to run in a pipeline.
_Call = tuple[Script, list[str], list[EncodableT]]

# What an add-member answer other than `complete` makes of the trajectory.
_ADD_OUTCOMES: dict[str, OutcomeKind] = {
    "partial": "partial",
    "emitted": "duplicate",
    "dropped": "closed",
}


class Grouper:
    """Consumes `trajectories`, writes each complete group to `groups` exactly once."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        cfg: Config,
        consumer: str,
        log: structlog.stdlib.BoundLogger,
        rebuild_task: TaskBuilder | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        """`rebuild_task`: how policy `rerun` rebuilds a group's task from its cursor; by
        default the configured data set's (what the feeder wrote)."""
        self.client = client
        self.tracer = tracer or Tracer.disabled()
        self.keys = keys
        self.cfg = cfg
        self.log = log
        self.rebuild_task: TaskBuilder = rebuild_task or (
            lambda cursor, n: make_task(cfg, cursor, n)
        )
        self.input = RedisStreamConsumer(
            client,
            keys,
            keys.trajectories,
            keys.CG_GROUPER,
            consumer,
            Trajectory,
            cfg.transport,
            log,
        )
        self._add = client.register_script(scripts.source(scripts.ADD_MEMBER))
        self._emit = client.register_script(scripts.source(scripts.EMIT))
        self._drop = client.register_script(scripts.source(scripts.DROP))
        self._count_after = client.register_script(scripts.source(scripts.COUNT_AFTER))
        self._order_flush = client.register_script(scripts.source(scripts.ORDER_FLUSH))
        self.timeouts = GroupTimeouts(client, keys, cfg, log, self.rebuild_task, self.tracer)
        self._next_timeout_check = 0.0
        self._next_waiting = 0.0

    def _assembly_keys(self, group_id: str) -> list[str]:
        """KEYS of the add-member and drop scripts."""
        k = self.keys
        return [
            k.group_members(group_id),
            k.groups_emitted,
            k.groups_dropped,
            k.trajectories,
            k.stats,
            k.groups_started,
            k.groups_reruns,
        ]

    def trainer_version(self) -> PolicyClock:
        """The version trajectories' staleness is judged against: the trainer's published
        one, with the jump of its last resume (review N1: `Keys.policy_offset`)."""
        version, offset = self.client.mget([self.keys.policy_version, self.keys.policy_offset])
        return policy_clock(version, offset)

    def handle(self, d: Delivery[Trajectory], trainer_version: TrainerVersion) -> Outcome:
        """One delivery: the batch of one."""
        [outcome] = self.handle_batch([d], trainer_version)
        return outcome

    def handle_batch(
        self, deliveries: list[Delivery[Trajectory]], trainer_version: TrainerVersion
    ) -> list[Outcome]:
        """Each delivery's outcome, in order: what handling them one at a time would give.

        Two pipelined round trips: the adds (and the drops of stale members), then the
        emits and drops of the groups those adds completed. A stale member of a group added
        to earlier in the batch waits for a second pair: dropping the group must come after
        that add's emit, if the add completed it."""
        out: list[Outcome] = []
        for part in self._split(deliveries, trainer_version):
            out.extend(self._handle_part(part, trainer_version))
        return out

    def _split(
        self, deliveries: list[Delivery[Trajectory]], trainer_version: TrainerVersion
    ) -> list[list[tuple[Delivery[Trajectory], str]]]:
        """The deliveries with their stale reasons ('' when fresh), in parts that each run
        in two round trips: a stale member of a group added to earlier starts a new part."""
        parts: list[list[tuple[Delivery[Trajectory], str]]] = [[]]
        added: set[str] = set()
        for d in deliveries:
            stale = stale_reason(d.msg, trainer_version, self.cfg.grouper.off_policy_steps)
            if stale and d.msg.group_id in added:
                parts.append([])
                added = set()
            if not stale:
                added.add(d.msg.group_id)
            parts[-1].append((d, stale))
        return parts

    def _handle_part(
        self, part: list[tuple[Delivery[Trajectory], str]], trainer_version: TrainerVersion
    ) -> list[Outcome]:
        """Adds and stale drops in one pipeline, then the completed groups' emits and drops
        in a second. A group is scored once, by its first delivery whose add completed it;
        a later one (a re-sent member) gets the same script, which finds the group emitted
        or dropped, as its add would have after the emit."""
        answers = self._run_scripts(
            [
                self._drop_call(d, counters.GROUPS_STALE) if stale else self._add_call(d)
                for d, stale in part
            ]
        )
        outcomes: list[Outcome] = []
        decisions: dict[str, Decision] = {}
        started_ms: dict[str, int] = {}  # group id -> its first member's arrival (Redis ms)
        finish: list[tuple[int, Delivery[Trajectory], bool]] = []  # index, delivery, first
        for i, ((d, stale), res) in enumerate(zip(part, answers, strict=True)):
            gid = d.msg.group_id
            if stale:
                self._log_dropped(d, stale)
                outcomes.append(Outcome("dropped", gid))
                continue
            state = res[0].decode()
            if state != "complete":
                outcomes.append(Outcome(_ADD_OUTCOMES[state], gid))
                continue
            outcomes.append(Outcome("complete", gid))  # replaced once its emit or drop ran
            first = gid not in decisions
            if first:
                decisions[gid] = self._complete(res[2], trainer_version)
                if len(res) > 3 and res[3] is not None:
                    started_ms[gid] = int(res[3])
            finish.append((i, d, first))
        calls = [self._finish_call(d, decisions[d.msg.group_id]) for _, d, _ in finish]
        for (i, d, first), res in zip(finish, self._run_scripts(calls), strict=True):
            outcomes[i] = self._finished(d, decisions[d.msg.group_id], first, int(res))
            group = decisions[d.msg.group_id].group
            if outcomes[i].kind == "emitted" and group is not None and d.msg.group_id in started_ms:
                start_ns = self.tracer.local_ns(started_ms[d.msg.group_id] * 1_000_000)
                trace_wait(self.tracer, group, start_ns)
        return outcomes

    def _complete(self, stored: list[bytes], trainer_version: TrainerVersion) -> Decision:
        """What a complete group gets, from its members as stored."""
        try:
            members = [decode_body(b, Trajectory) for b in stored]
        except WireError as err:  # only a foreign writer could have put this there
            return Decision("drop", f"a stored member cannot be decoded: {err}")
        return score(members, trainer_version, self.cfg.grouper)

    def _add_call(self, d: Delivery[Trajectory]) -> _Call:
        t = d.msg
        args: list[EncodableT] = [
            t.group_id,
            t.member,
            encode_body(t),
            t.num_generations,
            d.entry_id,
            self.keys.CG_GROUPER,
            t.max_version,
        ]
        return self._add, self._assembly_keys(t.group_id), args

    def _drop_call(self, d: Delivery[Trajectory], counter: str) -> _Call:
        """Drop the group (once; `counter` in stats counts the reason too)."""
        gid = d.msg.group_id
        args = [gid, d.entry_id, self.keys.CG_GROUPER, counter, d.msg.member]
        tail_keys, tail_args = scripts.order_tail(self.keys, self.cfg.grouper, d.msg.cursor)
        return self._drop, [*self._assembly_keys(gid), *tail_keys], [*args, *tail_args]

    def _finish_call(self, d: Delivery[Trajectory], decision: Decision) -> _Call:
        """The emit or drop of a complete group, acknowledging `d`."""
        if decision.action == "drop":
            return self._drop_call(d, decision.counter)
        k = self.keys
        gid = d.msg.group_id
        keys = [
            k.group_members(gid),
            k.groups_emitted,
            k.groups,
            k.trajectories,
            k.stats,
            k.groups_started,
            k.groups_reruns,
            k.groups_dropped,
        ]
        args = [
            gid,
            SCHEMA_VERSION,
            decision.kind,
            decision.body,
            d.entry_id,
            k.CG_GROUPER,
            decision.counter,
        ]
        tail_keys, tail_args = scripts.order_tail(k, self.cfg.grouper, d.msg.cursor)
        return self._emit, [*keys, *tail_keys], [*args, *tail_args]

    def _finished(
        self, d: Delivery[Trajectory], decision: Decision, first: bool, written: int
    ) -> Outcome:
        """The outcome of the delivery that completed a group (`first`, else a re-sent
        member), whose emit or drop script answered `written` (1: first to emit or drop;
        -1: the emit found the group dropped meanwhile)."""
        gid = d.msg.group_id
        if written < 0:
            return Outcome("closed", gid)
        if decision.action == "drop":
            if not first:
                return Outcome("closed", gid)
            self._log_dropped(d, decision.reason)
            return Outcome("dropped", gid)
        if written != 1 or decision.group is None:
            return Outcome("duplicate", gid)
        self.log.info(
            "group_emitted",
            group_id=gid,
            entry_id=d.entry_id,
            rewards=[m.reward for m in decision.group.members],
            versions=sorted({v for m in decision.group.members for v in m.versions}),
        )
        return Outcome("emitted", gid)

    def _log_dropped(self, d: Delivery[Trajectory], reason: str) -> None:
        self.log.warning(
            "group_dropped",
            group_id=d.msg.group_id,
            traj_id=d.msg.traj_id,
            entry_id=d.entry_id,
            reason=reason,
        )

    def _run_scripts(self, calls: list[_Call]) -> list[Any]:
        """Each call's answer, in order, from one non-transactional pipeline: one round trip.

        A script's first call in the pipeline sends its body (EVAL), the others its SHA
        (EVALSHA), so the server has every script the pipeline uses even if it restarted or
        its script cache was flushed since the last batch, with no round trip to ask (a
        pipeline given Script objects asks SCRIPT EXISTS before every execute). Only a
        SCRIPT FLUSH that lands inside the pipeline makes a later call answer NOSCRIPT (it
        did nothing): that raises like any error, and the entries left pending are claimed
        again, as after a grouper killed between its scripts."""
        if not calls:
            return []
        pipe = self.client.pipeline(transaction=False)
        sent: set[Script] = set()
        for script, keys, args in calls:
            # execute_command: a cluster pipeline has no eval() that takes a script
            if script in sent:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            else:
                sent.add(script)
                pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        return pipe.execute()

    # -- group timeout ------------------------------------------------------------------

    def stall_ms(self) -> int:
        """Age past which a group is looked at (`GroupTimeouts.stall_ms`)."""
        return self.timeouts.stall_ms()

    def check_timeouts(self) -> list[Outcome]:
        """Handle the groups past their time (`GroupTimeouts.check`)."""
        return self.timeouts.check(self.trainer_version)

    def flush_order(self) -> int:
        """grouper.order submission: stop waiting for the task cursors before any group held
        `order_max_wait_s` (lua/order_flush.lua); the cursors skipped (0 in completion
        order, or when nothing waited that long)."""
        gcfg = self.cfg.grouper
        if gcfg.order != "submission":
            return 0
        tail_keys, tail_args = scripts.order_tail(self.keys, gcfg, -1)
        skipped = int(
            self._order_flush(
                keys=[self.keys.stats, *tail_keys],
                args=[int(gcfg.order_max_wait_s * 1000), *tail_args],
            )
        )
        if skipped:
            self.log.warning(
                "group_order_skipped",
                cursors=skipped,
                reason=f"a group waited order_max_wait_s ({gcfg.order_max_wait_s:g}s) for an "
                "earlier task's group",
            )
        return skipped

    # -- loop -------------------------------------------------------------------------

    def step(self, block_ms: int | None = None) -> list[Outcome]:
        """Read a batch and handle it: one read, one GET of the trainer version, two
        pipelined round trips of scripts."""
        deliveries = self.input.read(block_ms=block_ms)
        if not deliveries:
            return []
        return self.handle_batch(deliveries, self.trainer_version())

    def run(
        self,
        stop: threading.Event,
        burst: bool = False,
        liveness: Liveness | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """Process until `stop` is set; with `burst`, also stop once the input is drained.
        Ticks `liveness` each time round; counts the groups it emits in `metrics`.

        Timed-out (or complete but stuck) groups are looked for every TIMEOUT_CHECK_EVERY_S
        (or half of `stall_ms`, if shorter)."""
        every = min(TIMEOUT_CHECK_EVERY_S, self.stall_ms() / 2000)
        alive = liveness or Liveness()
        while not stop.is_set():
            alive.tick()
            out = self.step()
            done = out
            if time.monotonic() >= self._next_timeout_check:
                self._next_timeout_check = time.monotonic() + every
                done = [*out, *self.check_timeouts()]
                self.flush_order()
            emitted = sum(o.kind in EMITTED for o in done)
            if metrics is not None and emitted:
                metrics.count(GROUPS, emitted)
            if self.cfg.tasks and done:
                self.count_per_task(done)
            if time.monotonic() >= self._next_waiting:
                self._next_waiting = time.monotonic() + WAITING_EVERY_S
                self.publish_waiting()
            if burst and not out and not self._has_pending():
                return

    def count_per_task(self, done: list[Outcome]) -> None:
        """A mixture's groups emitted and dropped, per task (`counters.PER_TASK`): each
        group's task from its cursor, by the mixture's order. Counted after the scripts
        answered, so approximate (a grouper killed in between does not count them)."""
        mix = mixture(self.cfg)
        counts: Counter[str] = Counter()
        for o in done:
            field = (
                counters.GROUPS
                if o.kind in EMITTED
                else counters.GROUPS_DROPPED
                if o.kind == "dropped"
                else None
            )
            cursor = group_cursor(o.group_id)
            if field is not None and cursor is not None:
                counts[counters.per_task(mix.label_at(cursor), field)] += 1
        if counts:
            pipe = self.client.pipeline(transaction=False)
            for name, k in counts.items():
                pipe.hincrby(self.keys.stats, name, k)
            pipe.execute()

    def publish_waiting(self) -> int:
        """Write how many groups wait for the trainer (`Keys.groups_waiting`, for rollout's
        backpressure, whose role may not read `groups`): the trainer consumer group's lag,
        counted up to `rollout.max_ready_groups` where Redis does not say it (6.2; entries
        deleted past the group's position on 7); every entry before a trainer joined.
        Redis' own count, unlike `groups - groups_trained`, which a trainer restart that
        trains the groups after its cut again drifts. Its pending entries are taken (in its
        batch, or trained and acknowledged with its next checkpoint)."""
        waiting = self._waiting()
        self.client.set(self.keys.groups_waiting, waiting, px=WAITING_TTL_MS)
        return waiting

    def _waiting(self) -> int:
        lag, _ = backlog(
            self.client,
            self.keys.groups,
            Keys.CG_TRAINER,
            self.cfg.rollout.max_ready_groups,
            self._count_entries_after,
        )
        return lag

    def _count_entries_after(self, stream: str, after: str, cap: int) -> int:
        return int(self._count_after(keys=[stream], args=[after, cap]))

    def queue_probe(self) -> dict[str, float]:
        """The grouper's queues as counters (`streamrl.obs.metrics`): the depth (not yet
        finished by their readers) and lag (not yet delivered) of `trajectories` (read by
        the groupers) and `groups` (by the trainer), and the groups being assembled with
        the age of the oldest. Lags are counted up to `rollout.max_ready_groups` x
        `rollout.num_generations` where Redis does not report them."""
        r = self.cfg.rollout
        cap = r.max_ready_groups * r.num_generations
        out: dict[str, float] = {}
        for name, stream, group in (
            ("trajectories", self.keys.trajectories, Keys.CG_GROUPER),
            ("groups", self.keys.groups, Keys.CG_TRAINER),
        ):
            lag, pending = backlog(self.client, stream, group, cap, self._count_entries_after)
            out[queue_depth(name)] = lag + pending
            out[queue_lag(name)] = lag
        sec, usec = self.client.time()  # the clock the start times were written with
        half, oldest = partial_groups(self.client, self.keys, sec * 1000 + usec / 1000)
        out[GROUPS_HALF_FILLED] = half
        out[OLDEST_HALF_FILLED_S] = oldest or 0.0
        return out

    def _has_pending(self) -> bool:
        info = self.client.xpending(self.keys.trajectories, self.keys.CG_GROUPER)
        return bool(info["pending"])
