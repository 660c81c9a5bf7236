-- Create a session: record hash, packed token ids, messages, all expiring at ARGV[1] (ms).
-- KEYS: 1 ctx:{id}  2 ctx:{id}:t  3 ctx:{id}:m
-- ARGV: 1 expires_at_ms  2 packed token ids  3 number of hash fields N
--       4 .. 3+2N field/value pairs, then the messages (JSON strings)
-- Returns 1, or 0 when the id is taken. Idempotent: a retry of this very create (its reply
-- lost with a dropped connection) finds its own record and returns 1 again.
local exp = ARGV[1]
local n = tonumber(ARGV[3])
local fields = {}
local given = {}
for j = 1, 2 * n do
  fields[j] = ARGV[3 + j]
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
local first = 4 + 2 * n
if first <= #ARGV then
  redis.call('DEL', KEYS[3])
  for i = first, #ARGV do
    redis.call('RPUSH', KEYS[3], ARGV[i])
  end
  redis.call('PEXPIREAT', KEYS[3], exp)
end
return 1
