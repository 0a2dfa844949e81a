-- Add one trajectory to its group's hash (HSETNX: a member already held is ignored) and
-- acknowledge its entry, unless it completes the group: then the caller scores the group
-- and emits or drops it (emit.lua, drop.lua), acknowledging the entry there.
-- KEYS: members hash, emitted set, dropped set, trajectories stream, stats hash, started hash,
--       reruns hash (unused here)
-- ARGV: group id, member index, payload, group size, entry id, consumer group, max version
-- -> {'emitted', 0} | {'dropped', 0} | {'partial', held} | {'complete', held, members,
--    first arrival ms}
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return {'emitted', 0}
end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[5], C.TRAJECTORIES_DROPPED, 1)
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return {'dropped', 0}
end
if redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3]) == 1 then
  local t = redis.call('TIME')
  redis.call('HSETNX', KEYS[6], ARGV[1], t[1] * 1000 + math.floor(t[2] / 1000))
  local cur = tonumber(redis.call('HGET', KEYS[5], C.MAX_TRAJECTORY_POLICY_VERSION) or '-1')
  if tonumber(ARGV[7]) > cur then
    redis.call('HSET', KEYS[5], C.MAX_TRAJECTORY_POLICY_VERSION, ARGV[7])
  end
end
local n = redis.call('HLEN', KEYS[1])
if n < tonumber(ARGV[4]) then
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return {'partial', n}
end
return {'complete', n, redis.call('HVALS', KEYS[1]), redis.call('HGET', KEYS[6], ARGV[1])}
