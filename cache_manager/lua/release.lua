-- Release a turn lock if we still hold it.
-- KEYS: 1 ctx:{id}:lock  (a claim's: 2 ctx:{id}:i:<key>  3 ctx:{id}:k)  ARGV: 1 lock token
-- With a claim's record: the record goes too if the attempt under this lock recorded no
-- answer (such a record binds nothing; without it, nothing is left of an attempt that
-- wrote nothing). Returns 1 (released) | 0 (the lock is gone or another's).
if KEYS[2] then
  local r = redis.call('HMGET', KEYS[2], 'lock', 'answer')
  if r[1] == ARGV[1] and not r[2] then
    redis.call('DEL', KEYS[2])
    redis.call('SREM', KEYS[3], KEYS[2])
  end
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
