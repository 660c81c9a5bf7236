-- Change a session's TTL (expires_at = now + ttl) or its affinity.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m
-- ARGV: 1 tenant  2 new ttl seconds ('' = keep)  3 worker id ('' = keep)  4 sidecar url
-- Returns {1, record fields...} | {0} not found
local owner = redis.call('HGET', KEYS[1], 'tenant')
if not owner or owner ~= ARGV[1] then
  return {0}
end
if ARGV[2] ~= '' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local exp = now + tonumber(ARGV[2]) * 1000
  redis.call('HSET', KEYS[1], 'ttl', ARGV[2], 'expires_at', exp, 'last_used', now)
  redis.call('PEXPIREAT', KEYS[1], exp)
  redis.call('PEXPIREAT', KEYS[2], exp)
  redis.call('PEXPIREAT', KEYS[3], exp)
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'affinity', ARGV[3], 'sidecar', ARGV[4])
end
return {1, redis.call('HGETALL', KEYS[1])}
