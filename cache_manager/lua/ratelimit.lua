-- One API key's rate-limit window: a fixed window opened by the key's first request after
-- the previous window ended. One key, hash-tagged by the key's id, so this runs on one
-- Redis Cluster slot; the times are Redis' own (TIME), never a gateway's clock.
-- KEYS: 1 rl:{<key id>} (hash r: requests, t: tokens, w: when the window ends, ms)
-- ARGV: 1 op: 'take' | 'settle'
--   take:   2 window ms  3 requests limit (0: none)  4 tokens limit (0: none)
--           5 tokens to reserve
--           -> {allowed 1|0, requests counted, tokens counted, ms until the window ends,
--               the window's end ms}
--           A refused request writes nothing: it counts against neither budget.
--   settle: 2 the window's end ms (as take answered it)  3 tokens to add (may be < 0)
--           4 window ms (to open a window for a late charge; 0: none)
--           -> {1}: counted in its window
--              {2}: its window has ended, a charge (> 0) counted in the current window
--                   (opened now, with no request counted, if none is open)
--              {0}: nothing written (a refund to a window that ended: its counts are gone)
--           A request may run far longer than a window: what it used beyond its
--           reservation is still charged, in the window in which it is known.
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if ARGV[1] == 'settle' then
  local delta = tonumber(ARGV[3])
  local w = tonumber(redis.call('HGET', key, 'w') or '0')
  if w == tonumber(ARGV[2]) and w > now then
    if redis.call('HINCRBY', key, 't', delta) < 0 then
      redis.call('HSET', key, 't', 0)
    end
    return {1}
  end
  if delta <= 0 then
    return {0}
  end
  if w > now then -- another window is open: the late charge counts there
    redis.call('HINCRBY', key, 't', delta)
    return {2}
  end
  local window = tonumber(ARGV[4] or '0')
  if window <= 0 then
    return {0}
  end
  w = now + window
  redis.call('DEL', key)
  redis.call('HSET', key, 'r', 0, 't', delta, 'w', w)
  redis.call('PEXPIREAT', key, w)
  return {2}
end

local window = tonumber(ARGV[2])
local max_r, max_t, cost = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local v = redis.call('HMGET', key, 'r', 't', 'w')
local r, tk, w = tonumber(v[1] or '0'), tonumber(v[2] or '0'), tonumber(v[3] or '0')
local fresh = w <= now -- no window open (its key may outlive its end by a moment)
if fresh then
  r, tk, w = 0, 0, now + window
end
if (max_r > 0 and r + 1 > max_r) or (max_t > 0 and tk + cost > max_t) then
  return {0, r, tk, w - now, w}
end
if fresh then
  redis.call('DEL', key)
  redis.call('HSET', key, 'r', 1, 't', cost, 'w', w)
  redis.call('PEXPIREAT', key, w)
else
  redis.call('HINCRBY', key, 'r', 1)
  redis.call('HINCRBY', key, 't', cost)
end
return {1, r + 1, tk + cost, w - now, w}
