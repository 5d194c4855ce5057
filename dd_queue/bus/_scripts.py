"""Lua scripts of ``RedisBus``: fenced leases, the fenced commit and heartbeats.

Each script is registered once per client (``register_script``: EVALSHA with a NOSCRIPT
fallback, so a restarted server that lost its script cache is handled). Every script touches
only the keys it is given, all of one hash tag, so it runs unchanged on a Redis Cluster.

Redis runs a script atomically but does not roll back: a failing command leaves earlier writes
applied. So each writing script first checks everything that could fail (lease value, key
types) and only then writes; arguments were checked by the caller (``commit_ops``) before the
script was sent. Errors the caller maps to exceptions start with ``DDQ_``.

A bus call whose reply is lost is retried (``_redis_conn``). The commit therefore leaves a marker
key (same hash tag, with a TTL) holding its result: a retry finds it and returns that result
instead of applying everything twice.
"""

from __future__ import annotations

# Lua 5.1 in Redis has a global ``unpack``; fakeredis runs a newer Lua with ``table.unpack``.
_PRELUDE = """
local unpack = unpack or table.unpack
local function check_stream(key)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= 'stream' then
    return redis.error_reply('DDQ_WRONGTYPE ' .. key .. ' holds a ' .. t .. ', not a stream')
  end
  return nil
end
"""

# KEYS[1] lease, KEYS[2] fencing counter; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] nonce.
# The lease value is "<token>:<nonce>:<owner>"; a free, expired or own lease gets a new token:
# max(last token + 1, server time in microseconds). Time keeps tokens growing across a restart
# that lost the counter; doubles hold such integers exactly (< 2^53), '%.0f' prints them whole.
# Returns the token as a string, or nil while another owner holds the lease.
ACQUIRE_LEASE = """
local current = redis.call('GET', KEYS[1])
if current then
  local holder = string.match(current, '^%d+:[^:]*:(.*)$')
  if holder == nil then
    return redis.error_reply('DDQ_BAD_LEASE ' .. KEYS[1] .. ' holds ' ..
      string.sub(current, 1, 80) .. ', not a lease value; delete the key')
  end
  if holder ~= ARGV[1] then
    return false
  end
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local token = string.format('%.0f', math.max(last + 1, now_us))
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], token .. ':' .. ARGV[3] .. ':' .. ARGV[1], 'PX', ARGV[2])
return token
"""

# KEYS[1] lease; ARGV[1] expected value, ARGV[2] ttl ms. Returns 1 if renewed, else 0.
RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS[1] lease; ARGV[1] expected value. Returns 1 if deleted, else 0.
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS[1] lease, KEYS[2] commit marker, KEYS[3..] one key per op. ARGV[1] expected lease value,
# ARGV[2] marker ttl ms, then per op its code and arguments:
#   S value px|''   X maxlen|'' nfields f1 v1 ...   A group nids id1 ...   D
# Returns {appended ids, acked count, replayed 0|1}. A marker written under the same lease value
# means this commit already ran (its reply was lost): its result is returned, nothing reapplied.
# Otherwise refuses (DDQ_LEASE_LOST / DDQ_WRONGTYPE) before any write.
COMMIT = (
    _PRELUDE
    + """
local marker = redis.call('GET', KEYS[2])
if marker then
  local acked, ids, holder = string.match(marker, '^(%d+)\\n([^\\n]*)\\n(.*)$')
  if holder == ARGV[1] then
    local out = {}
    for id in string.gmatch(ids, '%S+') do out[#out + 1] = id end
    return {out, tonumber(acked), 1}
  end
end
local current = redis.call('GET', KEYS[1])
if current ~= ARGV[1] then
  return redis.error_reply('DDQ_LEASE_LOST lease ' .. KEYS[1] .. ' is held by ' ..
    (current or 'nobody (expired)') .. ', not ' .. ARGV[1])
end
local ops, a = {}, 3
for k = 3, #KEYS do
  local op = {code = ARGV[a], key = KEYS[k]}
  a = a + 1
  if op.code == 'S' then
    op.value, op.px = ARGV[a], ARGV[a + 1]
    a = a + 2
  elseif op.code == 'X' then
    op.maxlen, op.args = ARGV[a], {}
    for j = 1, 2 * tonumber(ARGV[a + 1]) do op.args[j] = ARGV[a + 1 + j] end
    a = a + 2 + #op.args
  elseif op.code == 'A' then
    op.group, op.ids = ARGV[a], {}
    for j = 1, tonumber(ARGV[a + 1]) do op.ids[j] = ARGV[a + 1 + j] end
    a = a + 2 + #op.ids
  elseif op.code ~= 'D' then
    return redis.error_reply('DDQ_BAD_OP ' .. tostring(op.code))
  end
  if op.code == 'X' or op.code == 'A' then
    local err = check_stream(op.key)
    if err then return err end
  end
  ops[#ops + 1] = op
end
local ids, acked = {}, 0
for _, op in ipairs(ops) do
  if op.code == 'S' then
    if op.px == '' then
      redis.call('SET', op.key, op.value)
    else
      redis.call('SET', op.key, op.value, 'PX', op.px)
    end
  elseif op.code == 'X' then
    local args = {op.key}
    if op.maxlen ~= '' then
      args[2], args[3], args[4] = 'MAXLEN', '~', op.maxlen
    end
    args[#args + 1] = '*'
    for _, v in ipairs(op.args) do args[#args + 1] = v end
    ids[#ids + 1] = redis.call('XADD', unpack(args))
  elseif op.code == 'A' then
    if #op.ids > 0 then
      acked = acked + redis.call('XACK', op.key, op.group, unpack(op.ids))
    end
  else
    redis.call('UNLINK', op.key)
  end
end
redis.call('SET', KEYS[2], acked .. '\\n' .. table.concat(ids, ' ') .. '\\n' .. ARGV[1],
  'PX', ARGV[2])
return {ids, acked, 0}
"""
)

# Shared by the heartbeat scripts: server time in ms, and removal of expired members.
_HEARTBEAT_PRELUDE = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function forget(member)
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZREM', KEYS[2], member)
  return redis.call('HDEL', KEYS[3], member)
end
"""

# KEYS[1] seen zset, KEYS[2] expiry zset, KEYS[3] payload hash; ARGV[1] member, ARGV[2] payload,
# ARGV[3] ttl ms. Stamped with the server's clock, so every age is measured on one clock.
HEARTBEAT = (
    _HEARTBEAT_PRELUDE
    + """
redis.call('ZADD', KEYS[1], now_ms, ARGV[1])
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
return now_ms
"""
)

# Same KEYS. Drops expired members; returns
# {now ms, {member, seen ms, ...}, {member, payload, ...}}.
HEARTBEATS = (
    _HEARTBEAT_PRELUDE
    + """
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)) do
  forget(member)
end
return {tostring(now_ms), redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'),
        redis.call('HGETALL', KEYS[3])}
"""
)

# Same KEYS; ARGV[1] member. Returns 1 if it was present.
REMOVE_HEARTBEAT = (
    _HEARTBEAT_PRELUDE
    + """
return forget(ARGV[1])
"""
)
