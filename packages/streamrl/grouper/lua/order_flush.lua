-- Submission order: stop waiting for missing cursors once a held group (or drop) has waited
-- `max wait` ms (a task rollout dead-lettered never makes a group): skip to the lowest held
-- cursor and write what follows, again while the oldest still held waited that long.
-- KEYS: stats hash, then ORDER's four (order.lua)
-- ARGV: max wait ms, then ORDER's five
-- -> cursors skipped
local o = ORDER.tail(1, 1, KEYS[1])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local before = tonumber(redis.call('HGET', KEYS[1], C.GROUPS_ORDER_SKIPPED) or '0')
while redis.call('HLEN', o.at) > 0 do
  local oldest = nil
  local at = redis.call('HVALS', o.at)
  for _, ms in ipairs(at) do
    local v = tonumber(ms)
    if oldest == nil or v < oldest then oldest = v end
  end
  if now - oldest < tonumber(ARGV[1]) then break end
  local n = ORDER.next(o)
  ORDER.skip(o)
  ORDER.release(o)
  if ORDER.next(o) == n then break end  -- nothing moved (cannot happen: the lowest is held)
end
return tonumber(redis.call('HGET', KEYS[1], C.GROUPS_ORDER_SKIPPED) or '0') - before
