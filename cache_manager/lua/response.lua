-- A stored /v1/responses object, read or deleted with the tenant check of its session.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:r
-- ARGV: 1 op: 'get' | 'delete'  2 tenant  3 response id (the field in ctx:{id}:r)
-- Returns get: {1, response JSON, session version} | delete: {1, responses left} | {0}
local rec = redis.call('HMGET', KEYS[1], 'tenant', 'version')
if not rec[1] or rec[1] ~= ARGV[2] then
  return {0}
end
if ARGV[1] == 'get' then
  local found = redis.call('HGET', KEYS[2], ARGV[3])
  if not found then
    return {0}
  end
  return {1, found, rec[2]}
end
if redis.call('HDEL', KEYS[2], ARGV[3]) == 0 then
  return {0}
end
return {1, redis.call('HLEN', KEYS[2])}
