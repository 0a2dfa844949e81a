"""Group assembly and GRPO advantages, atomic in Redis so any number of groupers can run.

A grouper keeps no state of its own. Each trajectory is added to its group's hash with
HSETNX (a member already present is ignored) and acknowledged in the same Lua script, unless
it completes the group: then the grouper computes the advantages and a second script emits
the group exactly once (SADD on the emitted set), deletes the hash and acknowledges the
entry. A grouper killed between the two scripts leaves that entry pending; whoever claims it
re-adds the member (a no-op), sees the group complete and emits it.

A read batch costs two round trips, not two per trajectory: one pipeline holds the add
scripts of the whole batch (and the drops of stale members), a second the emits and drops
of the groups the first completed (a stale member of a group added to earlier in the batch
starts another pair). The outcomes are those of handling the deliveries one by one, in order.

A group still incomplete `group_timeout_s` after its first member arrived is handled by
`group_timeout_policy` (drop it, re-run its missing members, or release it with the members
present). Every grouper looks for such groups about once a second; the decision is one Lua
script that checks the group's age, size and state again and claims it, so however many
groupers look, a group is dropped, re-run or released once per timeout. The same check
emits (or drops) a complete group that nobody emitted (the entry that completed it was
dead-lettered before its emit), once it is that old, or without a timeout once that entry
must have been emitted or dead-lettered.

A group is scored by one rule, complete or released: a member that ended in error or
timeout is masked out of the statistics; the group is dropped, with its reason, for a
reward or advantage that is not finite, any member too far off policy, fewer valid members
than `min_valid_members`, or (if so configured) rewards that are all equal.

Traced (`tracer`): each group emitted is a `group.wait` span on track ("group", group_id),
from its first member's arrival (the Redis time the add script recorded, which the
completing add returns) to the emission; it ends the flows of its members' episodes and
starts the flow to the train step that uses it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import redis
import structlog
from redis.commands.core import Script

from streamrl.config import Config
from streamrl.liveness import Liveness
from streamrl.metrics import (
    GROUPS,
    GROUPS_HALF_FILLED,
    OLDEST_HALF_FILLED_S,
    Metrics,
    queue_depth,
    queue_lag,
)
from streamrl.names import Keys
from streamrl.queues import backlog, partial_groups
from streamrl.rl.advantages import ADVANTAGES, is_zero_variance, masked_advantages
from streamrl.tasks.registry import make_task
from streamrl.tracing import GROUP_FLOW, TRAJ_FLOW, Span, Tracer, flow_id
from streamrl.transport import Delivery, RedisStreamConsumer
from streamrl.wire import (
    SCHEMA_VERSION,
    Group,
    Task,
    Trajectory,
    WireError,
    decode_body,
    encode_body,
)

# KEYS: members hash, emitted set, dropped set, trajectories stream, stats hash, started hash,
#       reruns hash (unused here)
# ARGV: group id, member index, payload, group size, entry id, consumer group, max version
_ADD_MEMBER = """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return {'emitted', 0}
end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[5], 'trajectories_dropped', 1)
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return {'dropped', 0}
end
if redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3]) == 1 then
  local t = redis.call('TIME')
  redis.call('HSETNX', KEYS[6], ARGV[1], t[1] * 1000 + math.floor(t[2] / 1000))
  local cur = tonumber(redis.call('HGET', KEYS[5], 'max_trajectory_policy_version') or '-1')
  if tonumber(ARGV[7]) > cur then
    redis.call('HSET', KEYS[5], 'max_trajectory_policy_version', ARGV[7])
  end
end
local n = redis.call('HLEN', KEYS[1])
if n < tonumber(ARGV[4]) then
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return {'partial', n}
end
return {'complete', n, redis.call('HVALS', KEYS[1]), redis.call('HGET', KEYS[6], ARGV[1])}
"""

# A group dropped since its add answered `complete` (a stale member at another grouper) is
# not emitted as well: -1. Else 1 when this call emitted it, 0 when it was out already.
# KEYS: members hash, emitted set, groups stream, trajectories stream, stats hash,
#       started hash, reruns hash, dropped set
# ARGV: group id, schema version, kind, body, entry id, consumer group, extra counter ('' none)
_EMIT = """
if redis.call('SISMEMBER', KEYS[8], ARGV[1]) == 1 then
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return -1
end
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
local first = redis.call('SADD', KEYS[2], ARGV[1])
if first == 1 then
  redis.call('XADD', KEYS[3], '*', 'v', ARGV[2], 'kind', ARGV[3], 'data', ARGV[4])
  redis.call('HINCRBY', KEYS[5], 'groups', 1)
  if ARGV[7] ~= '' then
    redis.call('HINCRBY', KEYS[5], ARGV[7], 1)
  end
end
redis.call('DEL', KEYS[1])
redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
return first
"""

# KEYS: members hash, emitted set, dropped set, trajectories stream, stats hash, started hash,
#       reruns hash
# ARGV: group id, entry id, consumer group, extra counter ('' none), member index of the
#       entry (its trajectory counts once: it may be held already, as the member whose add
#       completed the group)
_DROP = """
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  redis.call('XACK', KEYS[4], ARGV[3], ARGV[2])
  return 0
end
local first = redis.call('SADD', KEYS[3], ARGV[1])
if first == 1 then
  redis.call('HINCRBY', KEYS[5], 'groups_dropped', 1)
  if ARGV[4] ~= '' then
    redis.call('HINCRBY', KEYS[5], ARGV[4], 1)
  end
end
local held = redis.call('HLEN', KEYS[1])
if redis.call('HEXISTS', KEYS[1], ARGV[5]) == 0 then
  held = held + 1
end
redis.call('HINCRBY', KEYS[5], 'trajectories_dropped', held)
redis.call('DEL', KEYS[1])
redis.call('XACK', KEYS[4], ARGV[3], ARGV[2])
return first
"""

# A group past its timeout, decided once. Every branch re-checks what the caller saw: the
# group is still being assembled (its start time is there, it is neither emitted nor
# dropped), it is still past the timeout (a rerun restarts its clock, so a second grouper
# acting on an older look finds it fresh), and it still holds the members the caller
# decided on (else `changed`: the caller looks again at the next check). A group the caller
# saw complete is one whose completing entry was never emitted (dead-lettered after its add
# answered `complete`, review M8): it is emitted or dropped now, not timed out; if its adder
# is only slow, the emitted and dropped sets make the second of the two a no-op.
# KEYS: members hash, emitted set, dropped set, started hash, reruns hash, stats hash,
#       tasks stream, groups stream
# ARGV: group id, timeout ms, members held, group size, action (drop | rerun | release, or
#       emit | drop for a complete group), max reruns, schema version, kind, body, extra
#       counter ('' none)
_TIMEOUT = """
local started = redis.call('HGET', KEYS[4], ARGV[1])
if not started then
  return {'gone'}
end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1
    or redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[4], ARGV[1])
  return {'gone'}
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if now - tonumber(started) < tonumber(ARGV[2]) then
  return {'fresh'}
end
local held = redis.call('HLEN', KEYS[1])
if held ~= tonumber(ARGV[3]) then
  return {'changed'}
end
local action = ARGV[5]
local reruns = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
if held < tonumber(ARGV[4]) then
  if action == 'rerun' and reruns >= tonumber(ARGV[6]) then
    action = 'drop_max_reruns'
  end
  redis.call('HINCRBY', KEYS[6], 'groups_timed_out', 1)
end
if action == 'rerun' then
  redis.call('XADD', KEYS[7], '*', 'v', ARGV[7], 'kind', ARGV[8], 'data', ARGV[9])
  redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
  redis.call('HSET', KEYS[4], ARGV[1], now)
  redis.call('HINCRBY', KEYS[6], 'groups_rerun', 1)
  return {'rerun', reruns + 1}
end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('DEL', KEYS[1])
if action == 'release' or action == 'emit' then
  redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('XADD', KEYS[8], '*', 'v', ARGV[7], 'kind', ARGV[8], 'data', ARGV[9])
  redis.call('HINCRBY', KEYS[6], 'groups', 1)
  if action == 'release' then
    redis.call('HINCRBY', KEYS[6], 'groups_released', 1)
  end
else
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('HINCRBY', KEYS[6], 'groups_dropped', 1)
  redis.call('HINCRBY', KEYS[6], 'trajectories_dropped', held)
end
if ARGV[10] ~= '' then
  redis.call('HINCRBY', KEYS[6], ARGV[10], 1)
end
return {action, reruns}
"""


@dataclass(frozen=True)
class Outcome:
    """What one trajectory or timeout check did: `partial`, `emitted`, `duplicate`,
    `dropped`, `closed` (a member of a group already dropped), or, after a group timeout,
    `rerun` (a task re-runs its missing members) or `released` (emitted incomplete); a
    timeout check emits (or drops) a complete group that was never emitted, too."""

    kind: str
    group_id: str


EMITTED = ("emitted", "released")  # outcomes that wrote a group to `groups`
ZERO_VARIANCE = "groups_zero_variance"  # stats counter: groups whose rewards were all equal
TOO_FEW_VALID = "groups_too_few_valid"  # stats counter: groups under min_valid_members
NONFINITE = "groups_nonfinite"  # stats counter: groups with a reward or advantage not finite

# Rebuilds the task at a data-set cursor with a group size: (cursor, num_generations) -> Task.
TaskBuilder = Callable[[int, int], Task]

TIMEOUT_CHECK_EVERY_S = 1.0  # how often a grouper looks for timed-out groups (at most)
WAITING_EVERY_S = 0.2  # how often a grouper publishes the groups waiting for the trainer
WAITING_TTL_MS = 10_000  # a count older than this is gone (no grouper runs to renew it)

# KEYS: a stream (groups, trajectories). ARGV: an exclusive start id `(<id>`, the most
# entries to count.
# How many entries follow that id, counted in Redis (their payloads stay there).
_COUNT_AFTER = """
return #redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
"""


@dataclass(frozen=True)
class _Decision:
    """What a group should get: `action` emit or drop (a complete group), drop, rerun or
    release (a timed-out one), with the message to write (the group, or the rerun task),
    the reason logged, an extra stats counter, and the group emitted or released."""

    action: str
    reason: str
    body: bytes = b""
    kind: str = ""
    counter: str = ""
    group: Group | None = None


# A script with its KEYS and ARGV, to run in a pipeline.
_Call = tuple[Script, list[Any], list[Any]]

# What an add-member answer other than `complete` makes of the trajectory.
_ADD_OUTCOMES = {"partial": "partial", "emitted": "duplicate", "dropped": "closed"}


def build_group(members: list[Trajectory], epsilon: float, estimator: str = "grpo") -> Group:
    """The group, members in order, with advantages (`ADVANTAGES[estimator]`).

    A member that is not `valid` (it ended in error or timeout: infrastructure, not the
    policy's doing) gets advantage 0 and takes no part in the group's statistics.
    """
    members = sorted(members, key=lambda t: t.member)
    advantages = masked_advantages(
        ADVANTAGES[estimator], [m.reward for m in members], [m.valid for m in members], epsilon
    )
    return Group(
        group_id=members[0].group_id,
        task_id=members[0].task_id,
        members=members,
        advantages=advantages,
    )


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
            lambda cursor, n: make_task(cfg.task, cfg.run.seed, cursor, n)
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
        self._add = client.register_script(_ADD_MEMBER)
        self._emit = client.register_script(_EMIT)
        self._drop = client.register_script(_DROP)
        self._timeout = client.register_script(_TIMEOUT)
        self._count_after = client.register_script(_COUNT_AFTER)
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

    def trainer_version(self) -> int:
        raw = self.client.get(self.keys.policy_version)
        return int(raw) if raw is not None else 0

    def handle(self, d: Delivery[Trajectory], trainer_version: int) -> Outcome:
        """One delivery: the batch of one."""
        [outcome] = self.handle_batch([d], trainer_version)
        return outcome

    def handle_batch(
        self, deliveries: list[Delivery[Trajectory]], trainer_version: int
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

    def _stale(self, t: Trajectory, trainer_version: int) -> str:
        """Why `t` is too far off policy to train on; '' when it is not."""
        lag = trainer_version - t.min_version
        if t.versions and lag > self.cfg.grouper.off_policy_steps:
            return (
                f"stale: member {t.member}'s policy version {t.min_version} is {lag} behind "
                f"trainer version {trainer_version}"
            )
        return ""

    def _split(
        self, deliveries: list[Delivery[Trajectory]], trainer_version: int
    ) -> list[list[tuple[Delivery[Trajectory], str]]]:
        """The deliveries with their stale reasons ('' when fresh), in parts that each run
        in two round trips: a stale member of a group added to earlier starts a new part."""
        parts: list[list[tuple[Delivery[Trajectory], str]]] = [[]]
        added: set[str] = set()
        for d in deliveries:
            stale = self._stale(d.msg, trainer_version)
            if stale and d.msg.group_id in added:
                parts.append([])
                added = set()
            if not stale:
                added.add(d.msg.group_id)
            parts[-1].append((d, stale))
        return parts

    def _handle_part(
        self, part: list[tuple[Delivery[Trajectory], str]], trainer_version: int
    ) -> list[Outcome]:
        """Adds and stale drops in one pipeline, then the completed groups' emits and drops
        in a second. A group is scored once, by its first delivery whose add completed it;
        a later one (a re-sent member) gets the same script, which finds the group emitted
        or dropped, as its add would have after the emit."""
        answers = self._run_scripts(
            [self._drop_call(d, "") if stale else self._add_call(d) for d, stale in part]
        )
        outcomes: list[Outcome] = []
        decisions: dict[str, _Decision] = {}
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
                self._trace_wait(group, start_ns)
        return outcomes

    def _trace_wait(self, group: Group, start_ns: int) -> None:
        """The `group.wait` span of an emitted group, from `start_ns` (this host's clock)."""
        end_ns = time.time_ns()
        self.tracer.span(
            self.tracer.track("group", group.group_id),
            Span.GROUP_WAIT,
            min(start_ns, end_ns),
            end_ns,
            flows=[flow_id(GROUP_FLOW, group.group_id)],
            ends_flows=[flow_id(TRAJ_FLOW, m.traj_id) for m in group.members],
        )

    def _complete(self, stored: list[bytes], trainer_version: int) -> _Decision:
        """What a complete group gets, from its members as stored."""
        try:
            members = [decode_body(b, Trajectory) for b in stored]
        except WireError as err:  # only a foreign writer could have put this there
            return _Decision("drop", f"a stored member cannot be decoded: {err}")
        return self._score(members, trainer_version)

    def _score(self, members: list[Trajectory], trainer_version: int) -> _Decision:
        """Emit the group with its advantages, or drop it with the reason: a reward or an
        advantage not finite, a member too far off policy (each member, however early it
        arrived), fewer valid members than min_valid_members, or rewards all equal under
        zero_variance `drop`. The one rule for a complete group and a timed-out one
        released."""
        gcfg = self.cfg.grouper
        members = sorted(members, key=lambda t: t.member)
        for m in members:
            if not math.isfinite(m.reward):
                reason = f"reward not finite: member {m.member} has reward {m.reward}"
                return _Decision("drop", reason, counter=NONFINITE)
        for m in members:
            if stale := self._stale(m, trainer_version):
                return _Decision("drop", stale)
        rewards = [m.reward for m in members if m.valid]
        if len(rewards) < gcfg.min_valid_members:
            return _Decision(
                "drop",
                f"{len(rewards)} of {len(members)} members valid (the others ended in error "
                f"or timeout), fewer than grouper.min_valid_members ({gcfg.min_valid_members})",
                counter=TOO_FEW_VALID,
            )
        group = build_group(members, gcfg.advantage_epsilon, gcfg.advantage)
        for m, a in zip(members, group.advantages, strict=True):
            if not math.isfinite(a):
                reason = f"advantage not finite: member {m.member} has advantage {a}"
                return _Decision("drop", reason, counter=NONFINITE)
        zero_variance = is_zero_variance(rewards)
        if zero_variance and gcfg.zero_variance == "drop":
            reason = f"zero variance: every reward is {rewards[0]:g}"
            return _Decision("drop", reason, counter=ZERO_VARIANCE)
        return _Decision(
            "emit",
            "",
            body=encode_body(group),
            kind=Group.KIND,
            counter=ZERO_VARIANCE if zero_variance else "",
            group=group,
        )

    def _add_call(self, d: Delivery[Trajectory]) -> _Call:
        t = d.msg
        args = [
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
        return self._drop, self._assembly_keys(gid), args

    def _finish_call(self, d: Delivery[Trajectory], decision: _Decision) -> _Call:
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
        return self._emit, keys, args

    def _finished(
        self, d: Delivery[Trajectory], decision: _Decision, first: bool, written: int
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
        """Age (ms since its first member arrived) past which a group is looked at:
        `group_timeout_s`; without a timeout, only a complete group is, once the entry that
        completed it must have been emitted or dead-lettered, (max_deliveries + 1) x
        claim_idle_ms after it arrived."""
        if self.cfg.grouper.group_timeout_s > 0:
            return int(self.cfg.grouper.group_timeout_s * 1000)
        t = self.cfg.transport
        return (t.max_deliveries + 1) * t.claim_idle_ms

    def check_timeouts(self) -> list[Outcome]:
        """Handle every group incomplete for `group_timeout_s` (none when it is 0), and
        emit or drop every complete group left unemitted for `stall_ms` (review M8: the
        entry that completed it was dead-lettered after its add answered `complete`)."""
        stall_ms = self.stall_ms()
        sec, usec = self.client.time()  # the clock the start times were written with
        now_ms = sec * 1000 + usec // 1000
        raw: Any = self.client.hgetall(self.keys.groups_started)
        ages = ((gid.decode(), now_ms - int(ms)) for gid, ms in raw.items())
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
        trainer_version = self.trainer_version()
        out = []
        for gid, age in old.items():
            outcome = self._handle_timeout(gid, stall_ms, age, trainer_version)
            if outcome is not None:
                out.append(outcome)
        return out

    def _handle_timeout(
        self, group_id: str, stall_ms: int, age_ms: int, trainer_version: int
    ) -> Outcome | None:
        """Decide on one timed-out group, or one complete but never emitted; None when
        another grouper or a member got there first (nothing to do, or look again at the
        next check)."""
        raw: Any = self.client.hgetall(self.keys.group_members(group_id))
        undecodable = ""
        try:
            members = sorted(
                (decode_body(v, Trajectory) for v in raw.values()), key=lambda m: m.member
            )
        except WireError as err:
            members, undecodable = [], f"a stored member cannot be decoded: {err}"
        # Undecodable members tell no group size: one more than held keeps it incomplete.
        n = members[0].num_generations if members else len(raw) + 1
        complete = len(members) >= n
        gcfg = self.cfg.grouper
        if not complete and gcfg.group_timeout_s <= 0:
            return None  # incomplete after all: without a timeout it waits for ever
        if undecodable:
            decision = _Decision("drop", undecodable)
        elif complete:
            decision = self._score(members, trainer_version)
        else:
            decision = self._decide(group_id, members, trainer_version)
        res: list[Any] = self._timeout(
            keys=[
                self.keys.group_members(group_id),
                self.keys.groups_emitted,
                self.keys.groups_dropped,
                self.keys.groups_started,
                self.keys.groups_reruns,
                self.keys.stats,
                self.keys.tasks,
                self.keys.groups,
            ],
            args=[
                group_id,
                stall_ms,
                len(raw),
                n,
                decision.action,
                gcfg.max_reruns,
                SCHEMA_VERSION,
                decision.kind,
                decision.body,
                decision.counter,
            ],
        )
        done = res[0].decode()
        if done in ("gone", "fresh", "changed"):
            return None
        present = [m.member for m in members]
        missing = sorted(set(range(n)) - set(present))
        ev = self.log.bind(
            group_id=group_id,
            waited_s=round(age_ms / 1000, 3),
            present=present,
            missing=missing,
            policy=gcfg.group_timeout_policy,
        )
        if done in ("emit", "release") and decision.group is not None:
            self._trace_wait(decision.group, time.time_ns() - age_ms * 1_000_000)
        if complete:
            return self._stuck_outcome(ev, group_id, decision)
        if done == "rerun":
            ev.warning("group_rerun", rerun=int(res[1]), max_reruns=gcfg.max_reruns)
            return Outcome("rerun", group_id)
        if done == "release":
            ev.warning("group_released", rewards=[m.reward for m in members])
            return Outcome("released", group_id)
        reason = decision.reason
        if done == "drop_max_reruns":
            reason = f"group_timeout after {int(res[1])} reruns (max_reruns {gcfg.max_reruns})"
        ev.warning("group_dropped", reason=reason)
        return Outcome("dropped", group_id)

    def _stuck_outcome(
        self, ev: structlog.stdlib.BoundLogger, group_id: str, decision: _Decision
    ) -> Outcome:
        """The outcome of a complete group emitted or dropped by a timeout check."""
        stuck = f"complete but never emitted after {self.stall_ms() / 1000:g}s"
        if decision.action == "drop":
            ev.warning("group_dropped", reason=f"{stuck}; {decision.reason}")
            return Outcome("dropped", group_id)
        ev.warning("group_emitted", reason=stuck)
        return Outcome("emitted", group_id)

    def _decide(self, group_id: str, members: list[Trajectory], trainer_version: int) -> _Decision:
        """What the configured policy makes of a timed-out group holding `members`."""
        gcfg = self.cfg.grouper
        timed_out = f"incomplete after group_timeout_s ({gcfg.group_timeout_s:g}s)"
        if not members:
            return _Decision("drop", f"{timed_out}; no member held")
        if gcfg.group_timeout_policy == "drop":
            return _Decision("drop", timed_out)
        if gcfg.group_timeout_policy == "rerun":
            return self._rerun(group_id, members, timed_out)
        if len(members) < 2:
            return _Decision("drop", f"{timed_out}; release needs 2 members, 1 present")
        scored = self._score(members, trainer_version)
        if scored.action == "drop":
            return replace(scored, reason=f"{timed_out}; {scored.reason}")
        return replace(scored, action="release", reason=timed_out)

    def _rerun(self, group_id: str, members: list[Trajectory], timed_out: str) -> _Decision:
        """The task that re-runs the missing members: the group's own task (same ids, so a
        re-run member has the same member index and trajectory id) limited to them."""
        first = members[0]
        if first.cursor < 0:
            return _Decision("drop", f"{timed_out}; its members carry no task cursor to re-run")
        task = self.rebuild_task(first.cursor, first.num_generations)
        if (task.group_id, task.task_id) != (group_id, first.task_id):
            return _Decision(
                "drop",
                f"{timed_out}; the task rebuilt from cursor {first.cursor} is "
                f"{task.task_id}/{task.group_id}, not {first.task_id}/{group_id}",
            )
        have = {m.member for m in members}
        missing = [i for i in range(first.num_generations) if i not in have]
        task = msgspec.structs.replace(task, members=missing)
        return _Decision("rerun", timed_out, body=encode_body(task), kind=Task.KIND)

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
            emitted = sum(o.kind in EMITTED for o in done)
            if metrics is not None and emitted:
                metrics.count(GROUPS, emitted)
            if time.monotonic() >= self._next_waiting:
                self._next_waiting = time.monotonic() + WAITING_EVERY_S
                self.publish_waiting()
            if burst and not out and not self._has_pending():
                return

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
        """The grouper's queues as counters (`streamrl.metrics`): the depth (not yet
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
