-- A group past its timeout, decided once. Every branch re-checks what the caller saw: the
-- group is still being assembled (its start time is there, it is neither emitted nor
-- dropped), it is still past the timeout (a rerun restarts its clock, so a second grouper
-- acting on an older look finds it fresh), and it still holds the members the caller
-- decided on (else `changed`: the caller looks again at the next check). A group the caller
-- saw complete is one whose completing entry was never emitted (dead-lettered after its add
-- answered `complete`, review M8): it is emitted or dropped now, not timed out; if its adder
-- is only slow, the emitted and dropped sets make the second of the two a no-op.
-- In submission order (grouper.order) a group written or dropped here takes its task's turn
-- (order.lua).
-- KEYS: members hash, emitted set, dropped set, started hash, reruns hash, stats hash,
--       tasks stream, groups stream, then ORDER's four
-- ARGV: group id, timeout ms, members held, group size, action (drop | rerun | release, or
--       emit | drop for a complete group), max reruns, schema version, kind, body, extra
--       counter ('' none), then ORDER's five
-- -> {'gone'} | {'fresh'} | {'changed'} | {action done, reruns before}, the action done
--    being rerun, release, emit, drop or drop_max_reruns
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
  redis.call('HINCRBY', KEYS[6], C.GROUPS_TIMED_OUT, 1)
end
if action == 'rerun' then
  redis.call('XADD', KEYS[7], '*', 'v', ARGV[7], 'kind', ARGV[8], 'data', ARGV[9])
  redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
  redis.call('HSET', KEYS[4], ARGV[1], now)
  redis.call('HINCRBY', KEYS[6], C.GROUPS_RERUN, 1)
  return {'rerun', reruns + 1}
end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('DEL', KEYS[1])
local o = ORDER.tail(8, 10, KEYS[6])
if action == 'release' or action == 'emit' then
  redis.call('SADD', KEYS[2], ARGV[1])
  ORDER.emit(o, ARGV[9])
  if action == 'release' then
    redis.call('HINCRBY', KEYS[6], C.GROUPS_RELEASED, 1)
  end
else
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('HINCRBY', KEYS[6], C.GROUPS_DROPPED, 1)
  redis.call('HINCRBY', KEYS[6], C.TRAJECTORIES_DROPPED, held)
  if o.on then
    ORDER.done(o)
  end
end
if ARGV[10] ~= '' then
  redis.call('HINCRBY', KEYS[6], ARGV[10], 1)
end
return {action, reruns}
