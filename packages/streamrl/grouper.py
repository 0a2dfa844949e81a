"""Group assembly and GRPO advantages, atomic in Redis so any number of groupers can run.

A grouper keeps no state of its own. Each trajectory is added to its group's hash with
HSETNX (a member already present is ignored) and acknowledged in the same Lua script, unless
it completes the group: then the grouper computes the advantages and a second script emits
the group exactly once (SADD on the emitted set), deletes the hash and acknowledges the
entry. A grouper killed between the two scripts leaves that entry pending; whoever claims it
re-adds the member (a no-op), sees the group complete and emits it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from streamrl.config import Config
from streamrl.names import Keys
from streamrl.rl.advantages import ADVANTAGES, is_zero_variance
from streamrl.transport import Delivery, RedisStreamConsumer
from streamrl.wire import SCHEMA_VERSION, Group, Trajectory, WireError, decode_body, encode_body

# KEYS: members hash, emitted set, dropped set, trajectories stream, stats hash, started hash
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
#       started hash
# ARGV: group id, schema version, kind, body, entry id, consumer group, extra counter ('' none)
_EMIT = """
redis.call('HDEL', KEYS[6], ARGV[1])
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

# KEYS: members hash, emitted set, dropped set, trajectories stream, stats hash, started hash
# ARGV: group id, entry id, consumer group, extra counter ('' none)
_DROP = """
redis.call('HDEL', KEYS[6], ARGV[1])
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


@dataclass(frozen=True)
class Outcome:
    """What one trajectory did: `partial`, `emitted`, `duplicate`, `dropped`, or `closed`."""

    kind: str
    group_id: str


ZERO_VARIANCE = "groups_zero_variance"  # stats counter: groups whose rewards were all equal


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
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.log = log
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

    def step(self, block_ms: int | None = None) -> list[Outcome]:
        deliveries = self.input.read(block_ms=block_ms)
        if not deliveries:
            return []
        version = self.trainer_version()
        return [self.handle(d, version) for d in deliveries]

    def run(self, stop: threading.Event, burst: bool = False) -> None:
        """Process until `stop` is set; with `burst`, also stop once the input is drained."""
        while not stop.is_set():
            out = self.step()
            if burst and not out and not self._has_pending():
                return

    def _has_pending(self) -> bool:
        info = self.client.xpending(self.keys.trajectories, self.keys.CG_GROUPER)
        return bool(info["pending"])
