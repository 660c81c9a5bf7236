-- Delete a session and everything under its hash tag.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:lock
-- ARGV: 1 tenant
-- Returns {1, sidecar url} | {0} not found
local rec = redis.call('HMGET', KEYS[1], 'tenant', 'sidecar')
if not rec[1] or rec[1] ~= ARGV[1] then
  return {0}
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return {1, rec[2] or ''}
