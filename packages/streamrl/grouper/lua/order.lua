-- Submission order (grouper.order = "submission"), a library the group-writing scripts
-- (emit, drop, timeout, order_flush) are given in front of their own text. `o` is what
-- ORDER.tail reads: the four KEYS after a script's own (the next cursor, the held hash
-- cursor -> group body, '' for a dropped cursor, the held-at hash cursor -> Redis ms, the
-- groups stream) and the five ARGV after its own (mode: 'submission' or '' for completion
-- order, the group's task cursor, -1 when unknown, the window, the schema version and the
-- group kind to write held groups with).
local ORDER = {}

function ORDER.tail(kbase, abase, stats)
  return {
    next = KEYS[kbase + 1], held = KEYS[kbase + 2], at = KEYS[kbase + 3],
    groups = KEYS[kbase + 4], stats = stats,
    on = ARGV[abase + 1] == 'submission', cursor = tonumber(ARGV[abase + 2]),
    window = tonumber(ARGV[abase + 3]), schema = ARGV[abase + 4], kind = ARGV[abase + 5],
  }
end

local function cur(n)
  return string.format('%d', n)
end

function ORDER.next(o)
  return tonumber(redis.call('GET', o.next) or '0')
end

local function xadd(o, body)
  redis.call('XADD', o.groups, '*', 'v', o.schema, 'kind', o.kind, 'data', body)
  redis.call('HINCRBY', o.stats, C.GROUPS, 1)
end

-- Write the held groups from the next cursor on while there are any (a dropped cursor just
-- lets the next one go).
function ORDER.release(o)
  local n = ORDER.next(o)
  while true do
    local body = redis.call('HGET', o.held, cur(n))
    if not body then break end
    redis.call('HDEL', o.held, cur(n))
    redis.call('HDEL', o.at, cur(n))
    if body ~= '' then xadd(o, body) end
    n = n + 1
  end
  redis.call('SET', o.next, cur(n))
end

-- Stop waiting for the cursors before the lowest held one (counted).
function ORDER.skip(o)
  local n = ORDER.next(o)
  local low = nil
  for _, f in ipairs(redis.call('HKEYS', o.at)) do
    local c = tonumber(f)
    if low == nil or c < low then low = c end
  end
  if low ~= nil and low > n then
    redis.call('HINCRBY', o.stats, C.GROUPS_ORDER_SKIPPED, low - n)
    redis.call('SET', o.next, cur(low))
  end
end

local function hold(o, body)
  local t = redis.call('TIME')
  redis.call('HSET', o.held, cur(o.cursor), body)
  redis.call('HSET', o.at, cur(o.cursor), t[1] * 1000 + math.floor(t[2] / 1000))
  if redis.call('HLEN', o.at) > o.window then
    ORDER.skip(o)
    ORDER.release(o)
  end
end

-- A group to write: now, when its cursor is the next one (then the held ones after it), or
-- unknown, or skipped already (out of order, counted); else held for its turn.
function ORDER.write(o, body)
  local n = ORDER.next(o)
  if o.cursor < 0 or o.cursor < n then
    xadd(o, body)
    if o.cursor >= 0 then redis.call('HINCRBY', o.stats, C.GROUPS_OUT_OF_ORDER, 1) end
  elseif o.cursor > n then
    redis.call('HINCRBY', o.stats, C.GROUPS_ORDER_HELD, 1)
    hold(o, body)
  else
    xadd(o, body)
    redis.call('SET', o.next, cur(n + 1))
    ORDER.release(o)
  end
end

-- A group decided to be written: at once in completion order, in its turn in submission.
function ORDER.emit(o, body)
  if o.on then
    ORDER.write(o, body)
  else
    xadd(o, body)
  end
end

-- A cursor whose group was dropped: the groups after it need not wait for it.
function ORDER.done(o)
  local n = ORDER.next(o)
  if o.cursor < 0 or o.cursor < n then
    return
  elseif o.cursor > n then
    hold(o, '')
  else
    redis.call('SET', o.next, cur(n + 1))
    ORDER.release(o)
  end
end
