-- The live-session set (for the metrics): every live session id by expires_at ms. The key
-- expires with the last session in it, so nothing is left behind once every session is gone.
-- KEYS: 1 ctx:live
-- ARGV: 1 op: 'add' (2 id  3 expires_at ms  4 '1': only if not there yet) -> 1
--             none: count (drop expired ids, then count) -> live sessions
if ARGV[1] == 'add' then
  if ARGV[4] == '1' then
    redis.call('ZADD', KEYS[1], 'NX', ARGV[3], ARGV[2])
  else
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  end
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[1], math.floor(tonumber(last[2])))
  return 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
