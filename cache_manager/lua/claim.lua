-- Claim an idempotency key for a create whose session id is derived from the key.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:lock  3 ctx:{id}:i:<key>  4 ctx:{id}:k (the session's records)
-- ARGV: 1 request hash  2 lock token  3 lock ttl ms  4 record ttl ms
-- Returns {1} claimed (the lock marks the attempt running) | {2, answer, context_tokens,
--   expires_at} the first attempt created the session: replay | {-3} the key was used with
--   another request | {-4, lock pttl} the first attempt still runs | {-5} the session exists
--   but its key's record has expired (the key cannot make it again) | {-6} the session the
--   key created was deleted (delete.lua left the record's body and `gone`: it is not made
--   again)
local r = redis.call('HMGET', KEYS[3], 'body', 'lock', 'answer', 'context_tokens', 'expires_at',
  'gone')
if r[6] then
  if r[1] ~= ARGV[1] then
    return {-3}
  end
  return {-6}
end
local holder = redis.call('GET', KEYS[2])
if r[3] or (holder and holder ~= ARGV[2]) then
  -- (a record of an attempt that ended without writing binds nothing)
  if r[1] and r[1] ~= ARGV[1] then
    return {-3}
  end
  if r[3] then
    return {2, r[3], r[4], r[5]}
  end
  return {-4, redis.call('PTTL', KEYS[2])}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {-5}
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[3], 'body', ARGV[1], 'lock', ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
redis.call('SADD', KEYS[4], KEYS[3])
if redis.call('PTTL', KEYS[4]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[4], ARGV[4])
end
return {1}
