-- How many entries follow an id, counted in Redis (their payloads stay there).
-- KEYS: a stream (groups, trajectories). ARGV: an exclusive start id `(<id>`, the most
-- entries to count.
return #redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
