-- Load a session for a turn, optionally taking its turn lock and sliding its TTL.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:lock  5 ctx:{id}:r
--       6 ctx:{id}:i:<key>  7 ctx:{id}:k (with an idempotency key: its record, and the set
--       of the session's records, which delete.lua deletes with the session)
-- ARGV: 1 tenant  2 lock token ('' = take no lock)  3 lock ttl ms
--       4 '1' return token ids  5 '1' return messages  6 '1' slide the TTL now
--       7 a version whose messages the caller holds: none are returned at that version
--       8 request hash ('' = no idempotency key)  9 idempotency record ttl ms
-- Returns {1, record fields..., tokens, messages} | {0} not found | {-1, lock pttl} busy
--       | {2, answer, context_tokens, expires_at} the key's first attempt wrote: replay it
--       | {-3} the key was used with another request | {-4, lock pttl} its attempt runs
-- Idempotent: a retry of this begin (its reply lost) finds the lock holding its own token.
-- An idempotency record is {body, lock} while its attempt runs (the lock names it: once
-- that lock is gone, the attempt ended without writing and the key is free again), and
-- {body, answer, ...} once the append that wrote the turn recorded its answer.
local h = redis.call('HGETALL', KEYS[1])
if #h == 0 then
  return {0}
end
local rec = {}
for i = 1, #h, 2 do
  rec[h[i]] = h[i + 1]
end
if rec['tenant'] ~= ARGV[1] then
  return {0}
end
local idem = ARGV[8] ~= nil and ARGV[8] ~= ''
if idem then
  local r = redis.call('HMGET', KEYS[6], 'body', 'lock', 'answer', 'context_tokens', 'expires_at')
  local running = r[2] and r[2] ~= '' and r[2] ~= ARGV[2] and redis.call('GET', KEYS[4]) == r[2]
  if r[3] or running then  -- (a record of an attempt that ended without writing binds nothing)
    if r[1] ~= ARGV[8] then
      return {-3}
    end
    if r[3] then
      return {2, r[3], r[4], r[5]}
    end
    return {-4, redis.call('PTTL', KEYS[4])}
  end
end
if ARGV[2] ~= '' then
  local took = redis.call('SET', KEYS[4], ARGV[2], 'NX', 'PX', ARGV[3])
  if not took and redis.call('GET', KEYS[4]) ~= ARGV[2] then
    return {-1, redis.call('PTTL', KEYS[4])}
  end
  if idem then
    redis.call('HSET', KEYS[6], 'body', ARGV[8], 'lock', ARGV[2])
    redis.call('PEXPIRE', KEYS[6], ARGV[9])
    redis.call('SADD', KEYS[7], KEYS[6])
    if redis.call('PTTL', KEYS[7]) < tonumber(ARGV[9]) then
      redis.call('PEXPIRE', KEYS[7], ARGV[9])
    end
  end
end
if ARGV[6] == '1' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local exp = now + tonumber(rec['ttl']) * 1000
  redis.call('HSET', KEYS[1], 'last_used', now, 'expires_at', exp)
  redis.call('PEXPIREAT', KEYS[1], exp)
  redis.call('PEXPIREAT', KEYS[2], exp)
  redis.call('PEXPIREAT', KEYS[3], exp)
  redis.call('PEXPIREAT', KEYS[5], exp)
  h = redis.call('HGETALL', KEYS[1])
end
local toks = ''
if ARGV[4] == '1' then
  toks = redis.call('GET', KEYS[2]) or ''
end
local msgs = {}
if ARGV[5] == '1' and rec['version'] ~= ARGV[7] then
  msgs = redis.call('LRANGE', KEYS[3], 0, -1)
end
return {1, h, toks, msgs}
