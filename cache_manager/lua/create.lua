-- Create a session: record hash, packed token ids, messages (and the response that made it,
-- if any), all expiring at ARGV[1] (ms).
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m  4 ctx:{id}:r
--       5 ctx:{id}:lock  6 ctx:{id}:i:<key>  7 ctx:{id}:k (with an idempotency key: its
--       record, and the set of the session's records)
-- ARGV: 1 expires_at_ms  2 packed token ids  3 response id ('' = none)  4 response JSON
--       5 request hash ('' = no idempotency key)  6 the answer (JSON)  7 record ttl ms
--       8 the claim's lock token ('' = none)
--       9 number of hash fields N  10 .. 9+2N field/value pairs, then the messages (JSON)
-- With an idempotency key, the answer is recorded with the session, the record named in
-- the session's `idem` (delete.lua keeps a marker of it) and the claim's lock (claim.lua)
-- released.
-- Returns 1, or 0 when the id is taken. Idempotent: a retry of this very create (its reply
-- lost with a dropped connection) finds its own record and returns 1 again.
local exp = ARGV[1]
local n = tonumber(ARGV[9])
local fields = {}
local given = {}
for j = 1, 2 * n do
  fields[j] = ARGV[9 + j]
end
for j = 1, 2 * n, 2 do
  given[fields[j]] = fields[j + 1]
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local have = redis.call('HMGET', KEYS[1], 'tenant', 'created')
  if have[1] == given['tenant'] and have[2] == given['created'] then
    return 1
  end
  return 0
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIREAT', KEYS[1], exp)
redis.call('SET', KEYS[2], ARGV[2], 'PXAT', exp)
local first = 10 + 2 * n
if first <= #ARGV then
  redis.call('DEL', KEYS[3])
  for i = first, #ARGV do
    redis.call('RPUSH', KEYS[3], ARGV[i])
  end
  redis.call('PEXPIREAT', KEYS[3], exp)
end
redis.call('DEL', KEYS[4])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[4], ARGV[3], ARGV[4])
  redis.call('PEXPIREAT', KEYS[4], exp)
end
if ARGV[5] ~= '' then
  redis.call('DEL', KEYS[6])
  redis.call('HSET', KEYS[6], 'body', ARGV[5], 'answer', ARGV[6],
    'context_tokens', given['context_tokens'], 'expires_at', exp)
  redis.call('PEXPIRE', KEYS[6], ARGV[7])
  redis.call('SADD', KEYS[7], KEYS[6])
  if redis.call('PTTL', KEYS[7]) < tonumber(ARGV[7]) then
    redis.call('PEXPIRE', KEYS[7], ARGV[7])
  end
  redis.call('HSET', KEYS[1], 'idem', KEYS[6])
end
if ARGV[8] ~= '' and redis.call('GET', KEYS[5]) == ARGV[8] then
  redis.call('DEL', KEYS[5])
end
return 1
