-- Count live sessions across every tenant (for the metrics): drop expired ids, then count.
-- KEYS: 1 ctx:live (zset id -> expires_at ms)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
