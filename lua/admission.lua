-- Graviton cluster admission coordinator (see docs/admission.md for the protocol).
--
-- KEYS (all share the hash tag {<cell}, so one script call touches one slot):
--   1 counts       HASH   occupancy: s:b s:c t:<h>:b t:<h>:c b:<h>:c (absent = 0)
--   2 expirations  ZSET   lease id -> expiry ms (Redis server time)
--   3 leases       HASH   lease id -> token|tenant|backend|bytes|admitted_ms|operation|policy_version
--   4 fence        STRING fencing token sequence
--   5 policy       HASH   version; cluster-wide limits svc:b, svc:c, t:b, t:c, b:c (set by
--                         the first call that finds them absent, or by the `limits` op);
--                         overrides t:<h>:b, t:<h>:c, b:<h>:c
--   6 events       STREAM decision events, schema graviton-admission-event-v1
--   7 waiters      ZSET   lease id -> first rejection ms (service-pool waiters, oldest first)
--   8 waiting      HASH   lease id -> bytes|last_seen_ms
--   9 traffic key  HASH   window, count (charge only)
-- ARGV[1] = op, ARGV[2] = event stream MAXLEN (approximate), ARGV[3] = reap batch.
-- Replies are arrays of strings; the first names the outcome. Integers are always
-- written with %d so the client never sees a float.

local op = ARGV[1]
local max_events = ARGV[2]
local reap_limit = tonumber(ARGV[3]) or 0
local K_COUNTS, K_EXP, K_LEASES, K_FENCE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_POLICY, K_EVENTS, K_WAITERS, K_WAITING = KEYS[5], KEYS[6], KEYS[7], KEYS[8]

local function fmt(n)
  return string.format('%d', n)
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local now_s = string.format('%d', now)
-- Server time in microseconds: the floor of fencing tokens (about 1.8e15, exact in a Lua
-- double up to 2^53). See next_token.
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

local function split(s)
  local out = {}
  for part in string.gmatch(s, '[^|]+') do
    out[#out + 1] = part
  end
  return out
end

-- Write-back caches: one script call (one op, or a batch of many) reads each counter,
-- lease and expiry at most once and writes everything back once in flush(), with one
-- HSET/HDEL per hash and one ZADD/ZREM for the expiry set. Events are appended at once
-- (in order), from the cached occupancy. The script runs atomically, so the caches are
-- exact.
local counts, counts_dirty = {}, {}
local lease_cache, lease_dirty = {}, {}
local exp_cache, exp_dirty = {}, {}
local fence_value, fence_dirty = nil, false
local policy_cache = {}
local waiters_known_empty = nil

-- Counter field names of one (tenant, backend) scope.
local function fields_for(tenant, backend)
  local names = { 's:b', 's:c' }
  if tenant ~= '-' then
    names[#names + 1] = 't:' .. tenant .. ':b'
    names[#names + 1] = 't:' .. tenant .. ':c'
  end
  if backend ~= '-' then
    names[#names + 1] = 'b:' .. backend .. ':c'
  end
  return names
end

-- The scope's counters: names and the shared name -> value map (loaded with at most
-- one HMGET of the fields not cached yet).
local function load_counts(tenant, backend)
  local names = fields_for(tenant, backend)
  local missing = {}
  for i = 1, #names do
    if counts[names[i]] == nil then
      missing[#missing + 1] = names[i]
    end
  end
  if #missing > 0 then
    local raw = redis.call('HMGET', K_COUNTS, unpack(missing))
    for i = 1, #missing do
      counts[missing[i]] = tonumber(raw[i]) or 0
    end
  end
  return names, counts
end

-- Add sign * (bytes, 1 transfer) to every counter of the scope (clamped at zero).
local function apply(tenant, backend, names, v, bytes, sign)
  v['s:b'] = v['s:b'] + sign * bytes
  v['s:c'] = v['s:c'] + sign
  if tenant ~= '-' then
    local tb, tc = 't:' .. tenant .. ':b', 't:' .. tenant .. ':c'
    v[tb] = v[tb] + sign * bytes
    v[tc] = v[tc] + sign
  end
  if backend ~= '-' then
    local bc = 'b:' .. backend .. ':c'
    v[bc] = v[bc] + sign
  end
  for _, name in ipairs(names) do
    if v[name] < 0 then
      v[name] = 0
    end
    counts_dirty[name] = true
  end
end

local function get_lease(id)
  local raw = lease_cache[id]
  if raw == nil then
    raw = redis.call('HGET', K_LEASES, id) or false
    lease_cache[id] = raw
  end
  return raw
end

local function set_lease(id, raw)
  lease_cache[id] = raw
  lease_dirty[id] = true
end

local function get_expiry(id)
  local score = exp_cache[id]
  if score == nil then
    score = tonumber(redis.call('ZSCORE', K_EXP, id)) or false
    exp_cache[id] = score
  end
  return score
end

local function set_expiry(id, score)
  exp_cache[id] = score
  exp_dirty[id] = true
end

-- Fencing tokens never go backwards, even when the stored sequence does (a failover to a
-- replica that missed the last writes, a restart without persistence): a token is the
-- larger of the sequence + 1 and the server time in microseconds. Tokens issued at under
-- one per microsecond stay at the clock, so a new primary whose clock is not behind the
-- old one's by more than the failover takes issues higher tokens (docs/admission.md).
local function next_token()
  if fence_value == nil then
    fence_value = tonumber(redis.call('GET', K_FENCE)) or 0
  end
  fence_value = math.max(fence_value + 1, now_us)
  fence_dirty = true
  return fence_value
end

local function flush()
  local set, del = {}, {}
  for name in pairs(counts_dirty) do
    if counts[name] > 0 then
      set[#set + 1] = name
      set[#set + 1] = fmt(counts[name])
    else
      del[#del + 1] = name
    end
  end
  if #set > 0 then
    redis.call('HSET', K_COUNTS, unpack(set))
  end
  if #del > 0 then
    redis.call('HDEL', K_COUNTS, unpack(del))
  end
  set, del = {}, {}
  for id in pairs(lease_dirty) do
    if lease_cache[id] then
      set[#set + 1] = id
      set[#set + 1] = lease_cache[id]
    else
      del[#del + 1] = id
    end
  end
  if #set > 0 then
    redis.call('HSET', K_LEASES, unpack(set))
  end
  if #del > 0 then
    redis.call('HDEL', K_LEASES, unpack(del))
  end
  set, del = {}, {}
  for id in pairs(exp_dirty) do
    if exp_cache[id] then
      set[#set + 1] = fmt(exp_cache[id])
      set[#set + 1] = id
    else
      del[#del + 1] = id
    end
  end
  if #set > 0 then
    redis.call('ZADD', K_EXP, unpack(set))
  end
  if #del > 0 then
    redis.call('ZREM', K_EXP, unpack(del))
  end
  if fence_dirty then
    redis.call('SET', K_FENCE, fmt(fence_value))
  end
end

-- Occupancy strings {sB, sC, tB, tC, bC}; tenant values are -1 without a tenant.
local function occupancy(tenant, backend, v)
  local tb, tc, bc = '-1', '-1', '0'
  if tenant ~= '-' then
    tb = fmt(v['t:' .. tenant .. ':b'])
    tc = fmt(v['t:' .. tenant .. ':c'])
  end
  if backend ~= '-' then
    bc = fmt(v['b:' .. backend .. ':c'])
  end
  return { fmt(v['s:b']), fmt(v['s:c']), tb, tc, bc }
end

-- Load the policy fields of `names` that are not cached yet, with one HMGET.
local function load_policy(names)
  local missing = {}
  for i = 1, #names do
    if policy_cache[names[i]] == nil then
      missing[#missing + 1] = names[i]
    end
  end
  if #missing > 0 then
    local raw = redis.call('HMGET', K_POLICY, unpack(missing))
    for i = 1, #missing do
      policy_cache[missing[i]] = tonumber(raw[i]) or false
    end
  end
end

-- Policy hash fields (cached for the call).
local function policy_field(name)
  local value = policy_cache[name]
  if value == nil then
    value = tonumber(redis.call('HGET', K_POLICY, name)) or false
    policy_cache[name] = value
  end
  return value
end

local function policy_version()
  return policy_field('version') or 0
end

-- The cluster-wide limits (service bytes, service transfers, default tenant bytes, default
-- tenant transfers, default backend transfers), in the order of the acquire defaults.
local LIMIT_FIELDS = { 'svc:b', 'svc:c', 't:b', 't:c', 'b:c' }

-- Store values[1..5] as the cluster-wide limits where none is stored yet, so the first
-- node to admit (or bootstrap) sets them for every node. '-' entries are skipped.
local function bootstrap_limits(values)
  load_policy(LIMIT_FIELDS)
  for i = 1, 5 do
    local name, value = LIMIT_FIELDS[i], tonumber(values[i])
    if not policy_cache[name] and value then
      redis.call('HSET', K_POLICY, name, fmt(value))
      policy_cache[name] = value
    end
  end
end

-- Append one decision event; o is the occupancy after the transition.
local function event(kind, lease, token, tenant, backend, bytes, operation, outcome, version, o)
  redis.call('XADD', K_EVENTS, 'MAXLEN', '~', max_events, '*',
    'schema', 'graviton-admission-event-v1', 'kind', kind, 'at_ms', now_s,
    'lease', lease, 'fencing_token', token, 'tenant', tenant, 'backend', backend,
    'bytes', bytes, 'operation', operation, 'outcome', outcome,
    'policy_version', fmt(version),
    'service_bytes', o[1], 'service_transfers', o[2], 'tenant_bytes', o[3],
    'tenant_transfers', o[4], 'backend_transfers', o[5])
end

-- Remove a lease and give back everything it reserved. Returns false if absent.
local function drop_lease(id, kind, outcome)
  local raw = get_lease(id)
  -- Clear the expiry without reading it first (ZREM of an absent member is a no-op).
  set_expiry(id, false)
  if not raw then
    return false
  end
  local r = split(raw)
  local tenant, backend = r[2], r[3]
  local names, v = load_counts(tenant, backend)
  apply(tenant, backend, names, v, tonumber(r[4]), -1)
  set_lease(id, false)
  event(kind, id, r[1], tenant, backend, r[4], r[6], outcome, tonumber(r[7]) or policy_version(),
    occupancy(tenant, backend, v))
  return true
end

-- Expire at most `batch` leases whose expiry is at or before now (server time).
local function reap(batch)
  if batch < 1 then
    return 0
  end
  local ids = redis.call('ZRANGEBYSCORE', K_EXP, '-inf', fmt(now), 'LIMIT', 0, batch)
  for _, id in ipairs(ids) do
    drop_lease(id, 'expired', 'lease_expired')
  end
  return #ids
end

local function waiters_empty()
  if waiters_known_empty == nil then
    waiters_known_empty = redis.call('ZCARD', K_WAITERS) == 0
  end
  return waiters_known_empty
end

local function forget_waiter(id)
  if waiters_empty() then
    return
  end
  if redis.call('ZREM', K_WAITERS, id) == 1 then
    redis.call('HDEL', K_WAITING, id)
  end
end

-- The oldest waiter that polled within waiter_ttl, pruning dead ones (bounded).
local function head_waiter(waiter_ttl)
  if waiters_empty() then
    return nil, 0
  end
  for _ = 1, 16 do
    local h = redis.call('ZRANGE', K_WAITERS, 0, 0)
    if #h == 0 then
      return nil, 0
    end
    local info = redis.call('HGET', K_WAITING, h[1])
    if info then
      local f = split(info)
      if tonumber(f[2]) + waiter_ttl >= now then
        return h[1], tonumber(f[1])
      end
    end
    forget_waiter(h[1])
  end
  return nil, 0
end

-- One acquire. a = { id, tenant, backend, bytes, operation, first }, d = { svc_b, svc_c,
-- ten_b, ten_c, back_c, ttl, waiter_ttl } (the caller's defaults and timings).
local function acquire_one(a, d)
  local id, tenant, backend = a[1], a[2], a[3]
  local bytes, operation, first = tonumber(a[4]), a[5], a[6] == '1'
  local ttl, waiter_ttl = tonumber(d[6]), tonumber(d[7])
  if not bytes or bytes <= 0 or not ttl or ttl <= 0 or not waiter_ttl then
    return { 'PROTOCOL', 'invalid_acquire' }
  end

  -- Idempotent retry: the same lease id answers with the lease it already holds.
  local existing = get_lease(id)
  if existing then
    local score = get_expiry(id)
    if score and score > now then
      local r = split(existing)
      local _, v = load_counts(r[2], r[3])
      local o = occupancy(r[2], r[3], v)
      return { 'ADMITTED', r[1], fmt(score), r[7], o[1], o[2], o[3], o[4], o[5] }
    end
    drop_lease(id, 'expired', 'lease_expired')
  end

  -- The cluster-wide limits stored in Redis win over the caller's file (the caller's
  -- values only bootstrap them when absent); live overrides win over both.
  load_policy({ 'version', 'svc:b', 'svc:c', 't:b', 't:c', 'b:c', 't:' .. tenant .. ':b',
    't:' .. tenant .. ':c', 'b:' .. backend .. ':c' })
  bootstrap_limits(d)
  local version = policy_version()
  local svc_b = policy_field('svc:b')
  local svc_c = policy_field('svc:c')
  local ten_b = policy_field('t:' .. tenant .. ':b') or policy_field('t:b')
  local ten_c = policy_field('t:' .. tenant .. ':c') or policy_field('t:c')
  local back_c = policy_field('b:' .. backend .. ':c') or policy_field('b:c')

  -- A footprint above a ceiling can never be admitted: say so at once.
  local never = nil
  if bytes > svc_b then
    never = 'service_bytes'
  elseif svc_c < 1 then
    never = 'service_transfers'
  elseif tenant ~= '-' and bytes > ten_b then
    never = 'tenant_bytes'
  elseif tenant ~= '-' and ten_c < 1 then
    never = 'tenant_transfers'
  elseif back_c < 1 then
    never = 'backend_transfers'
  end
  if never then
    forget_waiter(id)
    return { 'NEVER', never, fmt(version) }
  end

  -- Head-of-line reservation: the oldest live service-pool waiter keeps room for
  -- itself, so a large waiter is not starved by a stream of small newcomers.
  local hold_b, hold_c = 0, 0
  local head, head_bytes = head_waiter(waiter_ttl)
  if head and head ~= id then
    hold_b, hold_c = head_bytes, 1
  end

  local names, v = load_counts(tenant, backend)
  local dim = nil
  if v['s:b'] + bytes + hold_b > svc_b then
    dim = 'service_bytes'
  elseif v['s:c'] + 1 + hold_c > svc_c then
    dim = 'service_transfers'
  elseif tenant ~= '-' and v['t:' .. tenant .. ':b'] + bytes > ten_b then
    dim = 'tenant_bytes'
  elseif tenant ~= '-' and v['t:' .. tenant .. ':c'] + 1 > ten_c then
    dim = 'tenant_transfers'
  elseif v['b:' .. backend .. ':c'] + 1 > back_c then
    dim = 'backend_transfers'
  end

  if dim then
    if dim == 'service_bytes' or dim == 'service_transfers' then
      redis.call('ZADD', K_WAITERS, 'NX', fmt(now), id)
      redis.call('HSET', K_WAITING, id, fmt(bytes) .. '|' .. fmt(now))
      waiters_known_empty = false
    else
      forget_waiter(id)
    end
    local o = occupancy(tenant, backend, v)
    if first then
      event('queued', id, '-', tenant, backend, fmt(bytes), operation, dim, version, o)
    end
    return { 'REJECTED', dim, fmt(version), o[1], o[2], o[3], o[4], o[5] }
  end

  if head == id or not first then
    forget_waiter(id)
  end
  local token = next_token()
  local expires = now + ttl
  apply(tenant, backend, names, v, bytes, 1)
  set_lease(id, table.concat({ fmt(token), tenant, backend, fmt(bytes), fmt(now), operation, fmt(version) }, '|'))
  set_expiry(id, expires)
  local o = occupancy(tenant, backend, v)
  event('admitted', id, fmt(token), tenant, backend, fmt(bytes), operation, 'admitted', version, o)
  return { 'ADMITTED', fmt(token), fmt(expires), fmt(version), o[1], o[2], o[3], o[4], o[5] }
end

-- ARGV: 4 lease id, 5 tenant hash or '-', 6 backend hash, 7 bytes, 8..12 default limits
-- (service bytes, service transfers, tenant bytes, tenant transfers, backend transfers),
-- 13 ttl ms, 14 operation, 15 waiter ttl ms, 16 first attempt ('1'/'0').
local function acquire()
  reap(reap_limit)
  return acquire_one({ ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[14], ARGV[16] },
    { ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[15] })
end

-- One release: lease id, fencing token, outcome (completed, failed, interrupted).
local function release_one(id, token, outcome)
  local raw = get_lease(id)
  if not raw then
    return { 'MISSING' }
  end
  if split(raw)[1] ~= token then
    return { 'STALE' }
  end
  drop_lease(id, 'completed', outcome)
  return { 'RELEASED' }
end

-- ARGV: 4 lease id, 5 fencing token, 6 ttl ms.
local function renew()
  local id, token, ttl = ARGV[4], ARGV[5], tonumber(ARGV[6])
  if not ttl or ttl <= 0 then
    return { 'PROTOCOL', 'invalid_renew' }
  end
  local raw = get_lease(id)
  if not raw then
    return { 'LOST' }
  end
  if split(raw)[1] ~= token then
    return { 'STALE' }
  end
  local score = get_expiry(id)
  if (not score) or score <= now then
    -- Past expiry but not reaped yet: never resurrect it.
    drop_lease(id, 'expired', 'lease_expired')
    return { 'EXPIRED' }
  end
  local expires = now + ttl
  set_expiry(id, expires)
  return { 'RENEWED', fmt(expires) }
end

-- ARGV: 4 lease id, 5 fencing token, 6 outcome (completed, failed, interrupted).
local function release()
  return release_one(ARGV[4], ARGV[5], ARGV[6])
end

-- Give up a wait (or an acquire whose reply was lost): forget the waiter, drop a lease the
-- id may hold, and record `kind` (timed_out, or abandoned when the caller went away while
-- it waited) when `dim` names the blocking dimension.
local function abandon_one(id, tenant, backend, bytes, operation, dim, kind)
  if kind ~= 'abandoned' then
    kind = 'timed_out'
  end
  forget_waiter(id)
  local released = 0
  if drop_lease(id, 'completed', 'abandoned') then
    released = 1
  end
  if dim ~= '-' then
    local _, v = load_counts(tenant, backend)
    event(kind, id, '-', tenant, backend, bytes, operation, dim, policy_version(),
      occupancy(tenant, backend, v))
  end
  return { 'ABANDONED', fmt(released) }
end

-- ARGV: 4 lease id, 5 tenant, 6 backend, 7 bytes, 8 operation, 9 dimension or '-',
-- 10 event kind (timed_out, the default, or abandoned).
local function abandon()
  return abandon_one(ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
end

-- ARGV: 4 tenant hash or '-', 5 backend hash or '-'.
local function snapshot()
  reap(reap_limit)
  local _, v = load_counts(ARGV[4], ARGV[5])
  local o = occupancy(ARGV[4], ARGV[5], v)
  return { 'SNAPSHOT', o[1], o[2], o[3], o[4], o[5], fmt(policy_version()), fmt(now),
    fmt(redis.call('ZCARD', K_WAITERS)) }
end

-- Set or clear a tenant override. ARGV: 4 tenant hash, 5 bytes or '-', 6 transfers or '-'.
local function policy()
  local tenant = ARGV[4]
  if tenant == '-' then
    return { 'PROTOCOL', 'policy_needs_tenant' }
  end
  local fields = { [5] = ':b', [6] = ':c' }
  for i = 5, 6 do
    local v = ARGV[i]
    if v ~= '-' and (not tonumber(v) or tonumber(v) < 1) then
      return { 'PROTOCOL', 'invalid_policy_value' }
    end
  end
  for i = 5, 6 do
    local field = 't:' .. tenant .. fields[i]
    if ARGV[i] == '-' then
      redis.call('HDEL', K_POLICY, field)
    else
      redis.call('HSET', K_POLICY, field, fmt(tonumber(ARGV[i])))
    end
  end
  -- Versions follow the same rule as fencing tokens, in milliseconds: the larger of the
  -- stored version + 1 and the server time, so a promoted lagging replica or an emptied
  -- server still issues a version above every earlier one.
  local version = math.max((tonumber(redis.call('HGET', K_POLICY, 'version')) or 0) + 1, now)
  redis.call('HSET', K_POLICY, 'version', fmt(version))
  local outcome = 'set'
  if ARGV[5] == '-' and ARGV[6] == '-' then
    outcome = 'cleared'
  end
  local _, v = load_counts(tenant, '-')
  event('policy_changed', '-', '-', tenant, '-', '0', 'control', outcome, version, occupancy(tenant, '-', v))
  return { 'POLICY', fmt(version) }
end

-- Bump the policy version (same rule as fencing tokens, in ms) and return it.
local function bump_version()
  local version = math.max(policy_version() + 1, now)
  redis.call('HSET', K_POLICY, 'version', fmt(version))
  policy_cache['version'] = version
  return version
end

-- Read, bootstrap or set the cluster-wide limits. ARGV: 4 mode ('read', 'bootstrap',
-- 'set'), 5..9 service bytes, service transfers, tenant bytes, tenant transfers, backend
-- transfers, each a number or '-' (bootstrap: store only where absent; set: leave '-'
-- unchanged). Reply: LIMITS version and the five stored values ('-' when absent).
local function limits()
  local mode = ARGV[4]
  local values = { ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9] }
  for i = 1, 5 do
    if values[i] ~= '-' and (not tonumber(values[i]) or tonumber(values[i]) < 1) then
      return { 'PROTOCOL', 'invalid_limit' }
    end
  end
  if mode == 'bootstrap' then
    bootstrap_limits(values)
  elseif mode == 'set' then
    for i = 1, 5 do
      if values[i] ~= '-' then
        redis.call('HSET', K_POLICY, LIMIT_FIELDS[i], fmt(tonumber(values[i])))
        policy_cache[LIMIT_FIELDS[i]] = tonumber(values[i])
      end
    end
    local version = bump_version()
    local _, v = load_counts('-', '-')
    event('policy_changed', '-', '-', '-', '-', '0', 'control', 'set', version, occupancy('-', '-', v))
  elseif mode ~= 'read' then
    return { 'PROTOCOL', 'invalid_limits_mode' }
  end
  load_policy(LIMIT_FIELDS)
  local reply = { 'LIMITS', fmt(policy_version()) }
  for i = 1, 5 do
    local value = policy_cache[LIMIT_FIELDS[i]]
    reply[#reply + 1] = value and fmt(value) or '-'
  end
  return reply
end

-- Set or clear a backend's transfer override. ARGV: 4 backend hash, 5 transfers or '-'.
local function backend_policy()
  local backend, value = ARGV[4], ARGV[5]
  if backend == '-' then
    return { 'PROTOCOL', 'policy_needs_backend' }
  end
  if value ~= '-' and (not tonumber(value) or tonumber(value) < 1) then
    return { 'PROTOCOL', 'invalid_policy_value' }
  end
  local field = 'b:' .. backend .. ':c'
  local outcome = 'set'
  if value == '-' then
    redis.call('HDEL', K_POLICY, field)
    outcome = 'cleared'
  else
    redis.call('HSET', K_POLICY, field, fmt(tonumber(value)))
  end
  local version = bump_version()
  local _, v = load_counts('-', backend)
  event('policy_changed', '-', '-', '-', backend, '0', 'control', outcome, version, occupancy('-', backend, v))
  return { 'POLICY', fmt(version) }
end

-- Append a client-side decision. ARGV: 4 kind, 5 lease, 6 tenant, 7 backend, 8 bytes,
-- 9 operation, 10 outcome.
local function append_event()
  local kinds = { admitted = 1, queued = 1, timed_out = 1, abandoned = 1, completed = 1, expired = 1, policy_changed = 1 }
  if not kinds[ARGV[4]] then
    return { 'PROTOCOL', 'unknown_event_kind' }
  end
  local _, v = load_counts(ARGV[6], ARGV[7])
  event(ARGV[4], ARGV[5], '-', ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], policy_version(),
    occupancy(ARGV[6], ARGV[7], v))
  return { 'RECORDED' }
end

-- Charge a traffic quota in fixed windows of Redis time. KEYS[9] = traffic key.
-- ARGV: 4 kind, 5 amount (0 = only check that the window is not spent), 6 limit, 7 window ms.
local function charge()
  local key = KEYS[9]
  local amount, lim, window_ms = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  if not key or not amount or amount < 0 or not lim or not window_ms or window_ms <= 0 then
    return { 'PROTOCOL', 'invalid_charge' }
  end
  local window = math.floor(now / window_ms)
  local stored = redis.call('HMGET', key, 'window', 'count')
  local current = 0
  if stored[1] and tonumber(stored[1]) == window then
    current = tonumber(stored[2]) or 0
  end
  -- amount 0 is a peek: refused when the window is already spent, never written.
  if current + amount > lim or (amount == 0 and current >= lim) then
    local retry = (window + 1) * window_ms - now
    if retry < 1 then
      retry = 1
    end
    return { 'QUOTA', fmt(lim), fmt(retry) }
  end
  if amount == 0 then
    return { 'CHARGED', fmt(current) }
  end
  redis.call('HSET', key, 'window', fmt(window), 'count', fmt(current + amount))
  redis.call('PEXPIRE', key, fmt(2 * window_ms))
  return { 'CHARGED', fmt(current + amount) }
end

-- Many acquires and releases of one node in one call (coalesced by the client).
-- ARGV: 4 item count, 5..11 the acquire defaults and timings (as acquire's 8..13 and 15),
-- then per item: 'A', lease id, tenant, backend, bytes, operation, first; or
-- 'R', lease id, fencing token, outcome; or 'X' (abandon), lease id, tenant, backend,
-- bytes, operation, dimension or '-', event kind. Reply: one reply array per item, in order.
local function batch()
  local n = tonumber(ARGV[4])
  if not n or n < 1 then
    return { 'PROTOCOL', 'invalid_batch' }
  end
  local d = { ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11] }
  local replies, i, reaped = {}, 12, false
  for k = 1, n do
    local kind = ARGV[i]
    if kind == 'A' then
      if not reaped then
        reap(reap_limit)
        reaped = true
      end
      replies[k] = acquire_one({ ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6] }, d)
      i = i + 7
    elseif kind == 'R' then
      replies[k] = release_one(ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
      i = i + 4
    elseif kind == 'X' then
      replies[k] = abandon_one(ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7])
      i = i + 8
    else
      return { 'PROTOCOL', 'invalid_batch_item' }
    end
  end
  return replies
end

local ops = {
  acquire = acquire,
  batch = batch,
  renew = renew,
  release = release,
  abandon = abandon,
  reap = function()
    return { 'REAPED', fmt(reap(reap_limit)) }
  end,
  snapshot = snapshot,
  policy = policy,
  limits = limits,
  backend_policy = backend_policy,
  event = append_event,
  charge = charge,
}

local handler = ops[op]
if not handler then
  return { 'PROTOCOL', 'unknown_op' }
end
local result = handler()
flush()
return result
