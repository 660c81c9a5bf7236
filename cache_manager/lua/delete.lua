-- Delete a session and everything under its hash tag: its stored responses and its
-- idempotency records too (they would outlive it by up to their TTL, outside its tenant's
-- quota). The record of the key that created the session keeps only its request hash and
-- `gone` (claim.lua then refuses the key: a create retried after the DELETE does not make
-- the session again), for the rest of its TTL.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:lock  5 ctx:{id}:r
--       6 ctx:{id}:k (the set of the session's idempotency records)
-- ARGV: 1 tenant
-- Returns {1, record fields...} | {0} not found
local owner = redis.call('HGET', KEYS[1], 'tenant')
if not owner or owner ~= ARGV[1] then
  return {0}
end
local rec = redis.call('HGETALL', KEYS[1])
local created = redis.call('HGET', KEYS[1], 'idem')
for _, key in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  if key == created then
    redis.call('HDEL', key, 'answer', 'lock', 'context_tokens', 'expires_at')
    if redis.call('EXISTS', key) == 1 then -- (not expired meanwhile)
      redis.call('HSET', key, 'gone', 1)
    end
  else
    redis.call('DEL', key)
  end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
return {1, rec}
