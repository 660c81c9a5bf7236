-- Extend a turn lock while its turn runs, if we still hold it.
-- KEYS: 1 ctx:{id}:lock  ARGV: 1 lock token  2 ttl ms
-- Returns 1 (extended) | 0 (the lock is gone or another's: the turn lost it)
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
