-- The per-tenant index: live sessions (by expiry and by creation) and context tokens.
-- All keys share the tenant's hash tag, so this runs on one Redis Cluster slot.
-- KEYS: 1 tn:{t}:exp (zset id -> expires_at ms)  2 tn:{t}:new (zset id -> created ms)
--       3 tn:{t}:tok (hash id -> "version:tokens")  4 tn:{t}:sum (total context tokens)
--       5 tn:{t}:del (zset id -> ms: removed ids, kept out until then; see 'remove')
-- ARGV: 1 op: 'reserve' | 'record' | 'remove' | 'purge' | 'status'
--   reserve: 2 id  3 ttl s  4 tokens  5 max sessions  6 max tokens  -> {1, expires_at ms}
--            | {-1, live sessions} over the session quota | {-2, total tokens} over tokens
--            | {-3} the id is taken
--   record:  2 id  3 expires_at ms  4 version  5 tokens  6 exact ('1': set expiry as given)
--            -> {1, total tokens}
--            (a removed id is not recorded again: see 'remove')
--   remove:  2 id  3 keep-out ms -> {1}: the id leaves the index, and a 'record' of it that
--            arrives within keep-out ms (a turn's index update racing the session's DELETE:
--            the session and this index live in different slots, no script sees both) is
--            ignored
--   purge:   -> {1}: only drops the ids whose expiry has passed (every write op does too)
--   status:  -> {1, live sessions, total tokens}, and writes nothing: ids whose expiry has
--            passed but that no write op has purged yet are left out of both counts
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function tokens_of(id)
  local v = redis.call('HGET', KEYS[3], id)
  if not v then
    return nil, nil
  end
  local sep = string.find(v, ':', 1, true)
  return tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
end

local function forget(id)
  local _, n = tokens_of(id)
  if n then
    redis.call('DECRBY', KEYS[4], n)
    redis.call('HDEL', KEYS[3], id)
  end
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end

-- a status read (pipelined with every locked turn's begin) is a pure read: on a cluster a
-- turn then writes nothing in its tenant's slot but the index update after the answer
if ARGV[1] == 'status' then
  local live = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
  local total = tonumber(redis.call('GET', KEYS[4]) or '0')
  local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1000)
  for _, id in ipairs(stale) do
    local _, n = tokens_of(id)
    total = total - (n or 0)
  end
  return {1, live, total}
end

redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)

-- purge sessions whose expiry has passed (Redis already dropped their keys)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(expired) do
  forget(id)
end

-- every key of the index expires with the tenant's last live session (none live: deleted),
-- so a tenant whose sessions are all gone leaves nothing behind in Redis
local function tidy()
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  for i = 1, 4 do
    if last[2] then
      redis.call('PEXPIREAT', KEYS[i], math.floor(tonumber(last[2])))
    else
      redis.call('DEL', KEYS[i])
    end
  end
  local gone = redis.call('ZRANGE', KEYS[5], -1, -1, 'WITHSCORES')
  if gone[2] then
    redis.call('PEXPIREAT', KEYS[5], math.floor(tonumber(gone[2])))
  end
end

local function run(op)
  if op == 'purge' then
    return {1}
  elseif op == 'remove' then
    forget(ARGV[2])
    redis.call('ZADD', KEYS[5], now + tonumber(ARGV[3]), ARGV[2])
    return {1}
  elseif op == 'reserve' then
    if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
      return {-3}
    end
    local live = redis.call('ZCARD', KEYS[1])
    if live >= tonumber(ARGV[5]) then
      return {-1, live}
    end
    local total = tonumber(redis.call('GET', KEYS[4]) or '0')
    if total + tonumber(ARGV[4]) > tonumber(ARGV[6]) then
      return {-2, total}
    end
    local exp = now + tonumber(ARGV[3]) * 1000
    redis.call('ZREM', KEYS[5], ARGV[2])  -- a client creating an id again, on purpose
    redis.call('ZADD', KEYS[1], exp, ARGV[2])
    redis.call('ZADD', KEYS[2], now, ARGV[2])
    redis.call('HSET', KEYS[3], ARGV[2], '1:' .. ARGV[4])
    redis.call('INCRBY', KEYS[4], tonumber(ARGV[4]))
    return {1, exp}
  elseif op == 'record' then
    local id = ARGV[2]
    if redis.call('ZSCORE', KEYS[5], id) then
      return {1, tonumber(redis.call('GET', KEYS[4]) or '0')}
    end
    local version, old = tokens_of(id)
    local new_version = tonumber(ARGV[4])
    if version == nil or new_version >= version then
      redis.call('HSET', KEYS[3], id, new_version .. ':' .. ARGV[5])
      redis.call('INCRBY', KEYS[4], tonumber(ARGV[5]) - (old or 0))
    end
    local exp = tonumber(ARGV[3])
    local cur = redis.call('ZSCORE', KEYS[1], id)
    if ARGV[6] == '1' or not cur or exp > tonumber(cur) then
      redis.call('ZADD', KEYS[1], exp, id)
    end
    if not redis.call('ZSCORE', KEYS[2], id) then
      redis.call('ZADD', KEYS[2], now, id)
    end
    return {1, tonumber(redis.call('GET', KEYS[4]) or '0')}
  end
  return redis.error_reply('unknown tenant op ' .. tostring(op))
end

local result = run(ARGV[1])
tidy()
return result
