"""Live rollout capacity, and the task backlog it needs (`task.max_backlog = "auto"`).

Each rollout worker advertises its episode slots (`rollout.max_concurrency`) in one hash
(`Keys.rollout_capacity`, field: its consumer name, value: slots and the Redis clock's ms),
renewed by its heartbeat; a field older than the time-to-live is a worker gone. The feeder
reads the live fields (and deletes the stale ones) in one script, on Redis's clock, so no
two hosts' clocks are compared, and keeps the backlog those slots need:
`auto_backlog(slots, G)`.

Why C + 2 C / G tasks for a worker of C slots and groups of G: a task stays in the backlog
(pending) until its last member ends, so while stragglers run, each of the C running
members may hold a task of its own open (C tasks at worst); the reader takes whole tasks
for its free slots plus one ahead, so about C / G tasks are read at a time, and two such
waves queued keep it from ever waiting for the feeder's next write. A fixed backlog below
this starves rollout as soon as stragglers hold slots (issue 29: 0.37 of the Little's-law
bound at C = 256 with the old default of 64).
"""

from __future__ import annotations

import redis

# Both scripts start by reading Redis's clock, in ms.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Run by the rollout worker's heartbeat (asyncio client).
# KEYS: the capacity hash. ARGV: this worker's field, its slots.
ADVERTISE_SCRIPT = (
    _NOW
    + """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. now)
return now
"""
)

# KEYS: the capacity hash. ARGV: the time-to-live in ms.
# Returns the slots of every live field, flat; deletes the fields past their ttl.
_LIVE = (
    _NOW
    + """
local ttl = tonumber(ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #all, 2 do
  local slots, at = string.match(all[i + 1], '^(%d+):(%d+)$')
  if slots and now - tonumber(at) <= ttl then
    table.insert(live, tonumber(slots))
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return live
"""
)


def auto_backlog(slots: list[int], group_size: int) -> int:
    """Tasks to keep written but not yet rolled out for live rollout workers of `slots`
    episode slots each, groups of `group_size` members: C + 2 * ceil(C / G) per worker
    (see the module doc). 0 while no worker is live."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return sum(c + 2 * -(-c // group_size) for c in slots if c > 0)


def live_slots(client: redis.Redis, key: str, ttl_ms: int) -> list[int]:
    """Episode slots of each rollout worker whose advertisement is younger than `ttl_ms`
    (by Redis's clock); older ones are deleted."""
    out = client.eval(_LIVE, 1, key, ttl_ms)
    return [int(x) for x in out or []]
