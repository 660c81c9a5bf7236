-- Add messages to a conversation's session, or delete one: the conversation's items.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:lock
--       5 ctx:{id}:i:<key>  6 ctx:{id}:k (with an idempotency key: its record, and the
--       set of the session's records)
-- ARGV: 1 tenant  2 op 'add' | 'delete'  3 expected version ('' = any)  4 index (delete)
--       5 request hash ('' = no idempotency key)  6 the answer (JSON)  7 record ttl ms
--       8.. messages to add (JSON strings)
-- Returns {1, record fields...} | {0} not found (or not a conversation, or no such index)
--       | {-1, lock pttl} a turn holds the session | {-2, version} the version moved on
--       | {2, answer, context_tokens, expires_at} the key's first attempt did it: replay
--       | {-3} the key was used with another request | {-4, lock pttl} its attempt runs
-- A record binds as begin.lua reads it: by its answer, or while its attempt runs (its lock
-- holds the session); a record of an attempt that ended without writing binds nothing.
-- The session's token ids are dropped (the items are text: the next response renders the
-- whole conversation again, and finds the unchanged prefix's KV by its chunk hashes).
local rec = redis.call('HMGET', KEYS[1], 'tenant', 'origin', 'version', 'expires_at')
if not rec[1] or rec[1] ~= ARGV[1] or rec[2] ~= 'conversation' then
  return {0}
end
if ARGV[5] ~= '' then
  local r = redis.call('HMGET', KEYS[5], 'body', 'lock', 'answer', 'context_tokens', 'expires_at')
  local running = r[2] and r[2] ~= '' and redis.call('GET', KEYS[4]) == r[2]
  if r[3] or running then
    if r[1] ~= ARGV[5] then
      return {-3}
    end
    if r[3] then
      return {2, r[3], r[4], r[5]}
    end
    return {-4, redis.call('PTTL', KEYS[4])}
  end
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {-1, redis.call('PTTL', KEYS[4])}
end
if ARGV[3] ~= '' and tonumber(rec[3]) ~= tonumber(ARGV[3]) then
  return {-2, rec[3]}
end
if ARGV[2] == 'add' then
  for i = 8, #ARGV do
    redis.call('RPUSH', KEYS[3], ARGV[i])
  end
else
  local index = tonumber(ARGV[4])
  if not redis.call('LINDEX', KEYS[3], index) then
    return {0}
  end
  redis.call('LSET', KEYS[3], index, '\0deleted')
  redis.call('LREM', KEYS[3], 1, '\0deleted')
end
local exp = tonumber(rec[4])
redis.call('SET', KEYS[2], '', 'PXAT', exp)
redis.call('PEXPIREAT', KEYS[3], exp)
redis.call('HSET', KEYS[1], 'context_tokens', 0)
local version = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'edited', version)
if ARGV[5] ~= '' then
  redis.call('DEL', KEYS[5])
  redis.call('HSET', KEYS[5], 'body', ARGV[5], 'answer', ARGV[6], 'context_tokens', 0,
    'expires_at', exp)
  redis.call('PEXPIRE', KEYS[5], ARGV[7])
  redis.call('SADD', KEYS[6], KEYS[5])
  if redis.call('PTTL', KEYS[6]) < tonumber(ARGV[7]) then
    redis.call('PEXPIRE', KEYS[6], ARGV[7])
  end
end
return {1, redis.call('HGETALL', KEYS[1])}
