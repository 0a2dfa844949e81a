-- Drop a group once (SADD on the dropped set; late members are dropped too), counting its
-- trajectories, and acknowledge the entry.
-- In submission order (grouper.order) the groups held behind its cursor may go (order.lua).
-- KEYS: members hash, emitted set, dropped set, trajectories stream, stats hash, started hash,
--       reruns hash, then ORDER's four
-- ARGV: group id, entry id, consumer group, extra counter ('' none), member index of the
--       entry (its trajectory counts once: it may be held already, as the member whose add
--       completed the group), then ORDER's five
-- -> 1 (this call dropped it) | 0 (dropped already, or emitted: nothing done)
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  redis.call('XACK', KEYS[4], ARGV[3], ARGV[2])
  return 0
end
local first = redis.call('SADD', KEYS[3], ARGV[1])
if first == 1 then
  redis.call('HINCRBY', KEYS[5], C.GROUPS_DROPPED, 1)
  local o = ORDER.tail(7, 5, KEYS[5])
  if o.on then
    ORDER.done(o)
  end
  if ARGV[4] ~= '' then
    redis.call('HINCRBY', KEYS[5], ARGV[4], 1)
  end
end
local held = redis.call('HLEN', KEYS[1])
if redis.call('HEXISTS', KEYS[1], ARGV[5]) == 0 then
  held = held + 1
end
redis.call('HINCRBY', KEYS[5], C.TRAJECTORIES_DROPPED, held)
redis.call('DEL', KEYS[1])
redis.call('XACK', KEYS[4], ARGV[3], ARGV[2])
return first
