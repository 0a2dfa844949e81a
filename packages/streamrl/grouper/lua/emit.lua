-- Emit a complete group once (SADD on the emitted set), delete its hash and acknowledge the
-- entry that completed it. A group dropped since its add answered `complete` (a stale member
-- at another grouper) is not emitted as well.
-- In submission order (grouper.order) the group is written in its task's turn (order.lua).
-- KEYS: members hash, emitted set, groups stream, trajectories stream, stats hash,
--       started hash, reruns hash, dropped set, then ORDER's four
-- ARGV: group id, schema version, kind, body, entry id, consumer group, extra counter ('' none),
--       then ORDER's five
-- -> -1 (dropped meanwhile) | 1 (this call emitted it) | 0 (it was out already)
if redis.call('SISMEMBER', KEYS[8], ARGV[1]) == 1 then
  redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
  return -1
end
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
local first = redis.call('SADD', KEYS[2], ARGV[1])
if first == 1 then
  ORDER.emit(ORDER.tail(8, 7, KEYS[5]), ARGV[4])
  if ARGV[7] ~= '' then
    redis.call('HINCRBY', KEYS[5], ARGV[7], 1)
  end
end
redis.call('DEL', KEYS[1])
redis.call('XACK', KEYS[4], ARGV[6], ARGV[5])
return first
