-- Delete a session and everything under its hash tag (its stored responses too).
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:lock  5 ctx:{id}:r
-- ARGV: 1 tenant
-- Returns {1, record fields...} | {0} not found
local owner = redis.call('HGET', KEYS[1], 'tenant')
if not owner or owner ~= ARGV[1] then
  return {0}
end
local rec = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return {1, rec}
