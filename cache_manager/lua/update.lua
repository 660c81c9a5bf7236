-- Change a session's TTL (expires_at = now + ttl), affinity, metadata, or mark its KV shared.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:r
-- ARGV: 1 tenant  2 new ttl seconds ('' = keep)  3 worker id ('' = keep)  4 sidecar url
--       5 metadata JSON ('' = keep)  6 '1': a fork reads this session's KV blocks
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
  for i = 1, 4 do
    redis.call('PEXPIREAT', KEYS[i], exp)
  end
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'affinity', ARGV[3], 'sidecar', ARGV[4])
end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'metadata', ARGV[5])
end
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[1], 'kv_shared', '1')
end
return {1, redis.call('HGETALL', KEYS[1])}
