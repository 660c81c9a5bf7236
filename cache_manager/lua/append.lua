-- Append a turn with compare-and-set on the version, slide the TTL, release our lock.
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:lock  5 ctx:{id}:r
--       6 ctx:{id}:i:<key>  7 ctx:{id}:k (with an idempotency key: its record, and the
--       set of the session's records)
-- ARGV: 1 tenant  2 expected version  3 lock token ('' = none held)  4 packed new token ids
--       5 number of new tokens  6 worker id ('' = keep)  7 sidecar url ('' = keep)
--       8 model, set if the session has none ('' = keep)  9 response id ('' = none)
--       10 response JSON  11 request hash ('' = no idempotency key)  12 the answer (JSON)
--       13 idempotency record ttl ms  14 the session's tools from now on (JSON; '' = keep)
--       15 '1': the token ids replace the session's (its history rendered again with new
--       tools; older points of it are continued from their messages) '' = appended
--       16.. new messages (JSON strings)
-- With an idempotency key, the answer is recorded with the turn (begin.lua replays it).
-- Returns {1, record fields...} | {0} not found | {-1} another turn holds the lock
--         | {-2, current version} version conflict
-- Idempotent for a locked turn: the record keeps the lock token of the last append, so a
-- retry of this append (its reply lost with a dropped connection) is answered as the first
-- was, and never appends the turn twice.
local rec = redis.call('HMGET', KEYS[1], 'tenant', 'version', 'ttl', 'last_lock', 'model')
if not rec[1] or rec[1] ~= ARGV[1] then
  return {0}
end
if ARGV[3] ~= '' and rec[4] == ARGV[3] and tonumber(rec[2]) == tonumber(ARGV[2]) + 1 then
  return {1, redis.call('HGETALL', KEYS[1])}
end
local holder = redis.call('GET', KEYS[4])
if holder and holder ~= ARGV[3] then
  return {-1}
end
if tonumber(rec[2]) ~= tonumber(ARGV[2]) then
  return {-2, rec[2]}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local exp = now + tonumber(rec[3]) * 1000
if ARGV[15] == '1' then
  redis.call('SET', KEYS[2], ARGV[4])
  redis.call('HSET', KEYS[1], 'context_tokens', 0, 'edited', tonumber(rec[2]) + 1)
else
  redis.call('APPEND', KEYS[2], ARGV[4])
end
if ARGV[14] ~= '' then
  redis.call('HSET', KEYS[1], 'tools', ARGV[14])
end
for i = 16, #ARGV do
  redis.call('RPUSH', KEYS[3], ARGV[i])
end
if ARGV[9] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[9], ARGV[10])
end
if ARGV[8] ~= '' and (rec[5] or '') == '' then
  redis.call('HSET', KEYS[1], 'model', ARGV[8])
end
redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HINCRBY', KEYS[1], 'context_tokens', tonumber(ARGV[5]))
redis.call('HSET', KEYS[1], 'last_used', now, 'expires_at', exp, 'last_lock', ARGV[3])
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'prev_affinity', redis.call('HGET', KEYS[1], 'affinity') or '',
    'prev_sidecar', redis.call('HGET', KEYS[1], 'sidecar') or '',
    'affinity', ARGV[6], 'sidecar', ARGV[7])
end
redis.call('PEXPIREAT', KEYS[1], exp)
redis.call('PEXPIREAT', KEYS[2], exp)
redis.call('PEXPIREAT', KEYS[3], exp)
redis.call('PEXPIREAT', KEYS[5], exp)
if ARGV[11] ~= '' then
  redis.call('DEL', KEYS[6])
  redis.call('HSET', KEYS[6], 'body', ARGV[11], 'answer', ARGV[12],
    'context_tokens', redis.call('HGET', KEYS[1], 'context_tokens'), 'expires_at', exp)
  redis.call('PEXPIRE', KEYS[6], ARGV[13])
  redis.call('SADD', KEYS[7], KEYS[6])
  if redis.call('PTTL', KEYS[7]) < tonumber(ARGV[13]) then
    redis.call('PEXPIRE', KEYS[7], ARGV[13])
  end
end
if holder then
  redis.call('DEL', KEYS[4])
end
return {1, redis.call('HGETALL', KEYS[1])}
