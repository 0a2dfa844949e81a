"""Group assembly and GRPO advantages, atomic in Redis so any number of groupers can run.

A grouper keeps no state of its own. Each trajectory is added to its group's hash with
HSETNX (a member already present is ignored) and acknowledged in the same Lua script, unless
it completes the group: then the grouper computes the advantages and a second script emits
the group exactly once (SADD on the emitted set), deletes the hash and acknowledges the
entry. A grouper killed between the two scripts leaves that entry pending; whoever claims it
re-adds the member (a no-op), sees the group complete and emits it.

A group still incomplete `group_timeout_s` after its first member arrived is handled by
`group_timeout_policy` (drop it, re-run its missing members, or release it with the members
present). Every grouper looks for such groups about once a second; the decision is one Lua
script that checks the group's age, size and state again and claims it, so however many
groupers look, a group is dropped, re-run or released once per timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
import structlog

from streamrl.config import Config
from streamrl.names import Keys
from streamrl.rl.advantages import ADVANTAGES, is_zero_variance
from streamrl.tasks.registry import make_task
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
return {'complete', n, redis.call('HVALS', KEYS[1])}
"""

# KEYS: members hash, emitted set, groups stream, trajectories stream, stats hash,
#       started hash, reruns hash
# ARGV: group id, schema version, kind, body, entry id, consumer group, extra counter ('' none)
_EMIT = """
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
# ARGV: group id, entry id, consumer group, extra counter ('' none)
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
redis.call('HINCRBY', KEYS[5], 'trajectories_dropped', held + 1)
redis.call('DEL', KEYS[1])
redis.call('XACK', KEYS[4], ARGV[3], ARGV[2])
return first
"""

# A group past its timeout, decided once. Every branch re-checks what the caller saw: the
# group is still being assembled (its start time is there, it is neither emitted nor
# dropped), it is still past the timeout (a rerun restarts its clock, so a second grouper
# acting on an older look finds it fresh), it still holds the members the caller decided
# on (else `changed`: the caller looks again at the next check), and it is not complete
# (then its last member is being emitted by whoever added it).
# KEYS: members hash, emitted set, dropped set, started hash, reruns hash, stats hash,
#       tasks stream, groups stream
# ARGV: group id, timeout ms, members held, group size, action (drop | rerun | release),
#       max reruns, schema version, kind, body, extra counter ('' none)
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
if held >= tonumber(ARGV[4]) then
  return {'complete'}
end
if held ~= tonumber(ARGV[3]) then
  return {'changed'}
end
local action = ARGV[5]
local reruns = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
if action == 'rerun' and reruns >= tonumber(ARGV[6]) then
  action = 'drop_max_reruns'
end
redis.call('HINCRBY', KEYS[6], 'groups_timed_out', 1)
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
if action == 'release' then
  redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('XADD', KEYS[8], '*', 'v', ARGV[7], 'kind', ARGV[8], 'data', ARGV[9])
  redis.call('HINCRBY', KEYS[6], 'groups', 1)
  redis.call('HINCRBY', KEYS[6], 'groups_released', 1)
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
    `rerun` (a task re-runs its missing members) or `released` (emitted incomplete)."""

    kind: str
    group_id: str


ZERO_VARIANCE = "groups_zero_variance"  # stats counter: groups whose rewards were all equal

# Rebuilds the task at a data-set cursor with a group size: (cursor, num_generations) -> Task.
TaskBuilder = Callable[[int, int], Task]

TIMEOUT_CHECK_EVERY_S = 1.0  # how often a grouper looks for timed-out groups (at most)


@dataclass(frozen=True)
class _Decision:
    """What a timed-out group should get: `action` drop, rerun or release, with the message
    to write (the rerun task or the released group), the reason logged, and an extra stats
    counter."""

    action: str
    reason: str
    body: bytes = b""
    kind: str = ""
    counter: str = ""


def build_group(members: list[Trajectory], epsilon: float, estimator: str = "grpo") -> Group | None:
    """The group with advantages (`ADVANTAGES[estimator]`); None when no member finished
    without error.

    Members with status `error` (an infrastructure or environment failure, not the
    policy's doing) get advantage 0 and take no part in the group's statistics.
    """
    members = sorted(members, key=lambda t: t.member)
    scored = [m for m in members if m.status != "error"]
    if not scored:
        return None
    adv = iter(ADVANTAGES[estimator]([m.reward for m in scored], epsilon))
    advantages = [0.0 if m.status == "error" else next(adv) for m in members]
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
    ) -> None:
        """`rebuild_task`: how policy `rerun` rebuilds a group's task from its cursor; by
        default the configured data set's (what the feeder wrote)."""
        self.client = client
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
        self._next_timeout_check = 0.0

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
        t = d.msg
        k = self.keys
        lag = trainer_version - t.min_version
        if t.versions and lag > self.cfg.grouper.off_policy_steps:
            return self._drop_group(
                d,
                f"stale: policy version {t.min_version} is {lag} behind "
                f"trainer version {trainer_version}",
            )
        res: list[Any] = self._add(
            keys=self._assembly_keys(t.group_id),
            args=[
                t.group_id,
                t.member,
                encode_body(t),
                t.num_generations,
                d.entry_id,
                k.CG_GROUPER,
                t.max_version,
            ],
        )
        state = res[0].decode()
        if state == "emitted":
            return Outcome("duplicate", t.group_id)
        if state in ("partial", "dropped"):
            return Outcome("partial" if state == "partial" else "closed", t.group_id)
        try:
            members = [decode_body(b, Trajectory) for b in res[2]]
        except WireError as err:  # only a foreign writer could have put this there
            return self._drop_group(d, f"a stored member cannot be decoded: {err}")
        gcfg = self.cfg.grouper
        group = build_group(members, gcfg.advantage_epsilon, gcfg.advantage)
        if group is None:
            return self._drop_group(d, "every member of the group ended with status error")
        rewards = [m.reward for m in group.members if m.status != "error"]
        zero_variance = is_zero_variance(rewards)
        if zero_variance and gcfg.zero_variance == "drop":
            return self._drop_group(
                d, f"zero variance: every reward is {rewards[0]:g}", counter=ZERO_VARIANCE
            )
        first = self._emit(
            keys=[
                k.group_members(t.group_id),
                k.groups_emitted,
                k.groups,
                k.trajectories,
                k.stats,
                k.groups_started,
                k.groups_reruns,
            ],
            args=[
                t.group_id,
                SCHEMA_VERSION,
                Group.KIND,
                encode_body(group),
                d.entry_id,
                k.CG_GROUPER,
                ZERO_VARIANCE if zero_variance else "",
            ],
        )
        if not first:
            return Outcome("duplicate", t.group_id)
        self.log.info(
            "group_emitted",
            group_id=t.group_id,
            entry_id=d.entry_id,
            rewards=[m.reward for m in group.members],
            versions=sorted({v for m in group.members for v in m.versions}),
        )
        return Outcome("emitted", t.group_id)

    def _drop_group(self, d: Delivery[Trajectory], reason: str, counter: str = "") -> Outcome:
        """Drop the group (once; `counter` in stats counts the reason too)."""
        t = d.msg
        k = self.keys
        self._drop(
            keys=self._assembly_keys(t.group_id),
            args=[t.group_id, d.entry_id, k.CG_GROUPER, counter],
        )
        self.log.warning(
            "group_dropped",
            group_id=t.group_id,
            traj_id=t.traj_id,
            entry_id=d.entry_id,
            reason=reason,
        )
        return Outcome("dropped", t.group_id)

    # -- group timeout ------------------------------------------------------------------

    def check_timeouts(self) -> list[Outcome]:
        """Handle every group incomplete for `group_timeout_s` (none when it is 0)."""
        gcfg = self.cfg.grouper
        if gcfg.group_timeout_s <= 0:
            return []
        timeout_ms = int(gcfg.group_timeout_s * 1000)
        sec, usec = self.client.time()  # the clock the start times were written with
        now_ms = sec * 1000 + usec // 1000
        raw: Any = self.client.hgetall(self.keys.groups_started)
        out = []
        for gid, ms in raw.items():
            if now_ms - int(ms) >= timeout_ms:
                outcome = self._handle_timeout(gid.decode(), timeout_ms, now_ms - int(ms))
                if outcome is not None:
                    out.append(outcome)
        return out

    def _handle_timeout(self, group_id: str, timeout_ms: int, age_ms: int) -> Outcome | None:
        """Decide on one timed-out group; None when another grouper or a member got there
        first (nothing to do, or look again at the next check)."""
        raw: Any = self.client.hgetall(self.keys.group_members(group_id))
        try:
            members = sorted(
                (decode_body(v, Trajectory) for v in raw.values()), key=lambda m: m.member
            )
        except WireError as err:
            members, decision = [], _Decision("drop", f"a stored member cannot be decoded: {err}")
        else:
            decision = self._decide(group_id, members)
        # Undecodable members tell no group size: one more than held keeps it incomplete.
        n = members[0].num_generations if members else len(raw) + 1
        gcfg = self.cfg.grouper
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
                timeout_ms,
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
        if done in ("gone", "fresh", "complete", "changed"):
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

    def _decide(self, group_id: str, members: list[Trajectory]) -> _Decision:
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
        group = build_group(members, gcfg.advantage_epsilon, gcfg.advantage)
        if group is None:
            return _Decision("drop", f"{timed_out}; every member present ended with error")
        rewards = [m.reward for m in group.members if m.status != "error"]
        zero_variance = is_zero_variance(rewards)
        if zero_variance and gcfg.zero_variance == "drop":
            return _Decision(
                "drop",
                f"{timed_out}; zero variance: every reward is {rewards[0]:g}",
                counter=ZERO_VARIANCE,
            )
        return _Decision(
            "release",
            timed_out,
            body=encode_body(group),
            kind=Group.KIND,
            counter=ZERO_VARIANCE if zero_variance else "",
        )

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
        deliveries = self.input.read(block_ms=block_ms)
        if not deliveries:
            return []
        version = self.trainer_version()
        return [self.handle(d, version) for d in deliveries]

    def run(self, stop: threading.Event, burst: bool = False) -> None:
        """Process until `stop` is set; with `burst`, also stop once the input is drained.

        Timed-out groups are looked for every TIMEOUT_CHECK_EVERY_S (or half the timeout,
        if shorter)."""
        every = min(TIMEOUT_CHECK_EVERY_S, self.cfg.grouper.group_timeout_s / 2)
        while not stop.is_set():
            out = self.step()
            if every > 0 and time.monotonic() >= self._next_timeout_check:
                self._next_timeout_check = time.monotonic() + every
                self.check_timeouts()
            if burst and not out and not self._has_pending():
                return

    def _has_pending(self) -> bool:
        info = self.client.xpending(self.keys.trajectories, self.keys.CG_GROUPER)
        return bool(info["pending"])
