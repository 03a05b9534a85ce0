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
-- Replies are arrays whose first element names the outcome; the other elements are strings
-- or integers (Lua numbers, which Redis answers as integer replies, exact below 2^53).
-- Integers sent to redis.call are strings written with %d (memoized per call, see fmt):
-- a Lua number argument would be formatted by Redis with %.17g, which costs more.

-- The file is loaded two ways with the same code: as a Redis Function library (the client
-- prepends `#!lua name=...`; FUNCTION LOAD runs this chunk once and every FCALL runs
-- `run`), or by EVALSHA (the chunk runs per call and ends by calling `run` itself). All
-- state of one call lives in the locals below, reset by `begin`.
--
-- redis.call and the library functions, looked up per call (a Function library's load-time
-- environment has neither).
local call, tonumber, unpack, sformat, smatch, mmax, mfloor

local keys, argv, op, max_events, reap_limit
local K_COUNTS, K_EXP, K_LEASES, K_FENCE, K_POLICY, K_EVENTS, K_WAITERS, K_WAITING
local now, now_s, now_us
local counts, counts_dirty, lease_cache, lease_dirty, exp_cache, exp_dirty
local fence_value, fence_dirty, policy_cache, waiters_known_empty, limits_bootstrapped
local events_added
-- Parsed lease records of the call, by the raw record (a pattern match is costly, and a
-- batch's prefetch and its release both need the fields).
local parsed
-- Field names of a tenant ({ bytes, transfers }) and a backend (transfers); counters and
-- overrides use the same names in their two hashes. Like `decimal`, a pure cache: kept
-- between calls of the library (up to 4096 entries), rebuilt per call under EVALSHA.
local tenant_names, backend_names, names_count

-- Decimal strings of integers, memoized: counter values, timestamps and versions recur,
-- and formatting is among the costliest things the script does (numbers handed to
-- redis.call as Lua numbers cost as much: Redis formats them). A pure cache, kept between
-- calls of the library (up to 4096 entries), rebuilt per call under EVALSHA.
local decimal, decimal_count

local function fmt(n)
  local s = decimal[n]
  if s == nil then
    s = sformat('%d', n)
    decimal[n] = s
    decimal_count = decimal_count + 1
  end
  return s
end

-- Start one call: its arguments, the server time, empty caches.
--
-- Write-back caches: one script call (one op, or a batch of many) reads each counter,
-- lease, expiry and policy field at most once and writes everything back once in flush(),
-- with one HSET/HDEL per hash and one ZADD/ZREM for the expiry set. A batch prefetches
-- them with one HMGET per hash (prefetch). Events are appended at once (in order), from
-- the cached occupancy. The script runs atomically, so the caches are exact.
local function begin(call_keys, call_argv)
  call, tonumber, unpack = redis.call, _G.tonumber, _G.unpack
  sformat, smatch, mmax, mfloor = string.format, string.match, math.max, math.floor
  keys, argv = call_keys, call_argv
  op, max_events, reap_limit = argv[1], argv[2], tonumber(argv[3]) or 0
  K_COUNTS, K_EXP, K_LEASES, K_FENCE = keys[1], keys[2], keys[3], keys[4]
  K_POLICY, K_EVENTS, K_WAITERS, K_WAITING = keys[5], keys[6], keys[7], keys[8]
  if decimal == nil or decimal_count > 4096 then
    decimal, decimal_count = {}, 0
  end
  local clock = call('TIME')
  now = tonumber(clock[1]) * 1000 + mfloor(tonumber(clock[2]) / 1000)
  now_s = fmt(now)
  -- Server time in microseconds: the floor of fencing tokens (about 1.8e15, exact in a
  -- Lua double up to 2^53). See next_token.
  now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  counts, counts_dirty, parsed = {}, {}, {}
  lease_cache, lease_dirty = {}, {}
  exp_cache, exp_dirty = {}, {}
  fence_value, fence_dirty = nil, false
  policy_cache = {}
  waiters_known_empty = nil
  limits_bootstrapped = false
  events_added = false
  if tenant_names == nil or names_count > 4096 then
    tenant_names, backend_names, names_count = {}, {}, 0
  end
end

-- A lease record: token|tenant|backend|bytes|admitted_ms|operation|policy_version (records
-- written before the version was added have six fields).
local LEASE_PATTERN = '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|?([^|]*)$'

local function split(s)
  return { smatch(s, LEASE_PATTERN) }
end

local function parse(raw)
  local r = parsed[raw]
  if r == nil then
    r = split(raw)
    parsed[raw] = r
  end
  return r
end

local function tenant_fields(tenant)
  local names = tenant_names[tenant]
  if names == nil then
    names = { 't:' .. tenant .. ':b', 't:' .. tenant .. ':c' }
    tenant_names[tenant] = names
    names_count = names_count + 1
  end
  return names
end

local function backend_field(backend)
  local name = backend_names[backend]
  if name == nil then
    name = 'b:' .. backend .. ':c'
    backend_names[backend] = name
    names_count = names_count + 1
  end
  return name
end

-- Append the counter names of one (tenant, backend) scope to `out`.
local function scope_fields(tenant, backend, out)
  out[#out + 1] = 's:b'
  out[#out + 1] = 's:c'
  if tenant ~= '-' then
    local t = tenant_fields(tenant)
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
  end
  if backend ~= '-' then
    out[#out + 1] = backend_field(backend)
  end
  return out
end

-- Load the fields of `names` not cached in `cache` with one HMGET of `key`: numbers (or
-- `absent`), or with `raw` the strings (or false).
local function load_fields(key, cache, names, absent, raw_values)
  local missing, seen = {}, {}
  for i = 1, #names do
    local name = names[i]
    if cache[name] == nil and not seen[name] then
      seen[name] = true
      missing[#missing + 1] = name
    end
  end
  if #missing > 0 then
    local raw = call('HMGET', key, unpack(missing))
    for i = 1, #missing do
      if raw_values then
        cache[missing[i]] = raw[i] or false
      else
        cache[missing[i]] = tonumber(raw[i]) or absent
      end
    end
  end
end

-- The scope's counters, in the shared name -> value map (at most one HMGET; none when a
-- prefetch or an earlier item loaded them).
local function load_counts(tenant, backend)
  local loaded = counts['s:b'] ~= nil and counts['s:c'] ~= nil
  if loaded and tenant ~= '-' then
    local t = tenant_fields(tenant)
    loaded = counts[t[1]] ~= nil and counts[t[2]] ~= nil
  end
  if loaded and backend ~= '-' then
    loaded = counts[backend_field(backend)] ~= nil
  end
  if not loaded then
    load_fields(K_COUNTS, counts, scope_fields(tenant, backend, {}), 0)
  end
  return counts
end

local function bump(name, delta)
  local value = counts[name] + delta
  if value < 0 then
    value = 0
  end
  counts[name] = value
  counts_dirty[name] = true
end

-- Add sign * (bytes, 1 transfer) to every counter of the scope (clamped at zero).
local function apply(tenant, backend, v, bytes, sign)
  bump('s:b', sign * bytes)
  bump('s:c', sign)
  if tenant ~= '-' then
    local t = tenant_fields(tenant)
    bump(t[1], sign * bytes)
    bump(t[2], sign)
  end
  if backend ~= '-' then
    bump(backend_field(backend), sign)
  end
end

local function get_lease(id)
  local raw = lease_cache[id]
  if raw == nil then
    raw = call('HGET', K_LEASES, id) or false
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
    score = tonumber(call('ZSCORE', K_EXP, id)) or false
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
    fence_value = tonumber(call('GET', K_FENCE)) or 0
  end
  fence_value = mmax(fence_value + 1, now_us)
  fence_dirty = true
  return fence_value
end

local function flush()
  local set, del = {}, {}
  for name in pairs(counts_dirty) do
    local value = counts[name]
    if value > 0 then
      set[#set + 1] = name
      set[#set + 1] = fmt(value)
    else
      del[#del + 1] = name
    end
  end
  if #set > 0 then
    call('HSET', K_COUNTS, unpack(set))
  end
  if #del > 0 then
    call('HDEL', K_COUNTS, unpack(del))
  end
  set, del = {}, {}
  for id in pairs(lease_dirty) do
    local raw = lease_cache[id]
    if raw then
      set[#set + 1] = id
      set[#set + 1] = raw
    else
      del[#del + 1] = id
    end
  end
  if #set > 0 then
    call('HSET', K_LEASES, unpack(set))
  end
  if #del > 0 then
    call('HDEL', K_LEASES, unpack(del))
  end
  set, del = {}, {}
  for id in pairs(exp_dirty) do
    local score = exp_cache[id]
    if score then
      set[#set + 1] = fmt(score)
      set[#set + 1] = id
    else
      del[#del + 1] = id
    end
  end
  if #set > 0 then
    call('ZADD', K_EXP, unpack(set))
  end
  if #del > 0 then
    call('ZREM', K_EXP, unpack(del))
  end
  if fence_dirty then
    call('SET', K_FENCE, fmt(fence_value))
  end
  -- One approximate trim per call for all the events it appended.
  if events_added then
    call('XTRIM', K_EVENTS, 'MAXLEN', '~', max_events)
  end
end

-- Occupancy strings {sB, sC, tB, tC, bC}; tenant values are -1 without a tenant.
local function occupancy(tenant, backend, v)
  local tb, tc, bc = '-1', '-1', '0'
  if tenant ~= '-' then
    local t = tenant_fields(tenant)
    tb, tc = fmt(v[t[1]]), fmt(v[t[2]])
  end
  if backend ~= '-' then
    bc = fmt(v[backend_field(backend)])
  end
  return { fmt(v['s:b']), fmt(v['s:c']), tb, tc, bc }
end

-- Load the policy fields of `names` that are not cached yet, with one HMGET.
local function load_policy(names)
  load_fields(K_POLICY, policy_cache, names, false)
end

-- Policy hash fields (cached for the call).
local function policy_field(name)
  local value = policy_cache[name]
  if value == nil then
    value = tonumber(call('HGET', K_POLICY, name)) or false
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
      call('HSET', K_POLICY, name, fmt(value))
      policy_cache[name] = value
    end
  end
  limits_bootstrapped = true
end

-- The policy fields an acquire of this scope reads: the version, the five limits and the
-- scope's overrides, appended to `out`.
local function acquire_policy_fields(tenant, backend, out)
  out[#out + 1] = 'version'
  for i = 1, 5 do
    out[#out + 1] = LIMIT_FIELDS[i]
  end
  if tenant ~= '-' then
    local t = tenant_fields(tenant)
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
  end
  out[#out + 1] = backend_field(backend)
  return out
end

-- Append one decision event; o is the occupancy after the transition.
local function event(kind, lease, token, tenant, backend, bytes, operation, outcome, version, o)
  events_added = true
  call('XADD', K_EVENTS, '*',
    'schema', 'graviton-admission-event-v1', 'kind', kind, 'at_ms', now_s,
    'lease', lease, 'fencing_token', token, 'tenant', tenant, 'backend', backend,
    'bytes', bytes, 'operation', operation, 'outcome', outcome,
    'policy_version', fmt(version),
    'service_bytes', o[1], 'service_transfers', o[2], 'tenant_bytes', o[3],
    'tenant_transfers', o[4], 'backend_transfers', o[5])
end

-- Remove a lease and give back everything it reserved. `r` is its parsed record (or nil
-- to read it). Returns false if absent.
local function drop_lease(id, kind, outcome, r)
  -- Clear the expiry without reading it first (ZREM of an absent member is a no-op).
  set_expiry(id, false)
  if r == nil then
    local raw = get_lease(id)
    if not raw then
      return false
    end
    r = parse(raw)
  end
  local tenant, backend = r[2], r[3]
  local v = load_counts(tenant, backend)
  apply(tenant, backend, v, tonumber(r[4]), -1)
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
  local ids = call('ZRANGEBYSCORE', K_EXP, '-inf', now_s, 'LIMIT', '0', fmt(batch))
  for _, id in ipairs(ids) do
    drop_lease(id, 'expired', 'lease_expired')
  end
  return #ids
end

local function waiters_empty()
  if waiters_known_empty == nil then
    waiters_known_empty = call('ZCARD', K_WAITERS) == 0
  end
  return waiters_known_empty
end

local function forget_waiter(id)
  if waiters_empty() then
    return
  end
  if call('ZREM', K_WAITERS, id) == 1 then
    call('HDEL', K_WAITING, id)
  end
end

-- The oldest waiter that polled within waiter_ttl, pruning dead ones (bounded).
local function head_waiter(waiter_ttl)
  if waiters_empty() then
    return nil, 0
  end
  for _ = 1, 16 do
    local h = call('ZRANGE', K_WAITERS, 0, 0)
    if #h == 0 then
      return nil, 0
    end
    local info = call('HGET', K_WAITING, h[1])
    if info then
      local bytes, seen = smatch(info, '^([^|]*)|([^|]*)')
      if tonumber(seen) + waiter_ttl >= now then
        return h[1], tonumber(bytes)
      end
    end
    forget_waiter(h[1])
  end
  return nil, 0
end

-- The caller's defaults and timings { svc_b, svc_c, ten_b, ten_c, back_c, ttl, waiter_ttl }
-- (strings from ARGV), checked once per call: numbers, or nil when malformed.
local function parse_defaults(d)
  local ttl, waiter_ttl = tonumber(d[6]), tonumber(d[7])
  if not ttl or ttl <= 0 or not waiter_ttl then
    return nil
  end
  return { d[1], d[2], d[3], d[4], d[5], ttl = ttl, waiter_ttl = waiter_ttl }
end

-- One acquire: lease id, tenant hash or '-', backend hash, bytes (string), operation,
-- first attempt ('1'/'0'); d from parse_defaults.
local function acquire_one(id, tenant, backend, bytes_s, operation, first_s, d)
  local bytes, first = tonumber(bytes_s), first_s == '1'
  -- bytes_s is stored and recorded as sent, so it must be a plain decimal.
  if not bytes or bytes <= 0 or not d or not smatch(bytes_s, '^%d+$') then
    return { 'PROTOCOL', 'invalid_acquire' }
  end

  -- Idempotent retry: the same lease id answers with the lease it already holds.
  local existing = get_lease(id)
  if existing then
    local score = get_expiry(id)
    local r = parse(existing)
    if score and score > now then
      local o = occupancy(r[2], r[3], load_counts(r[2], r[3]))
      return { 'ADMITTED', r[1], score, tonumber(r[7]) or policy_version(), o[1], o[2], o[3], o[4], o[5] }
    end
    drop_lease(id, 'expired', 'lease_expired', r)
  end

  -- The cluster-wide limits stored in Redis win over the caller's file (the caller's
  -- values only bootstrap them when absent, checked once per call); live overrides win
  -- over both.
  if policy_cache['version'] == nil or (tenant ~= '-' and policy_cache[tenant_fields(tenant)[2]] == nil)
      or policy_cache[backend_field(backend)] == nil then
    load_policy(acquire_policy_fields(tenant, backend, {}))
  end
  if not limits_bootstrapped then
    bootstrap_limits(d)
  end
  local version = policy_cache['version'] or 0
  local svc_b, svc_c = policy_cache['svc:b'], policy_cache['svc:c']
  local ten_b, ten_c, tnames = nil, nil, nil
  if tenant ~= '-' then
    tnames = tenant_fields(tenant)
    ten_b = policy_cache[tnames[1]] or policy_cache['t:b']
    ten_c = policy_cache[tnames[2]] or policy_cache['t:c']
  end
  local bname = backend_field(backend)
  local back_c = policy_cache[bname] or policy_cache['b:c']

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
    return { 'NEVER', never, version }
  end

  -- Head-of-line reservation: the oldest live service-pool waiter keeps room for
  -- itself, so a large waiter is not starved by a stream of small newcomers.
  local hold_b, hold_c = 0, 0
  local head, head_bytes = head_waiter(d.waiter_ttl)
  if head and head ~= id then
    hold_b, hold_c = head_bytes, 1
  end

  local v = load_counts(tenant, backend)
  local dim = nil
  if v['s:b'] + bytes + hold_b > svc_b then
    dim = 'service_bytes'
  elseif v['s:c'] + 1 + hold_c > svc_c then
    dim = 'service_transfers'
  elseif tenant ~= '-' and v[tnames[1]] + bytes > ten_b then
    dim = 'tenant_bytes'
  elseif tenant ~= '-' and v[tnames[2]] + 1 > ten_c then
    dim = 'tenant_transfers'
  elseif v[bname] + 1 > back_c then
    dim = 'backend_transfers'
  end

  if dim then
    if dim == 'service_bytes' or dim == 'service_transfers' then
      call('ZADD', K_WAITERS, 'NX', now_s, id)
      call('HSET', K_WAITING, id, bytes_s .. '|' .. now_s)
      waiters_known_empty = false
    else
      forget_waiter(id)
    end
    local o = occupancy(tenant, backend, v)
    if first then
      event('queued', id, '-', tenant, backend, bytes_s, operation, dim, version, o)
    end
    return { 'REJECTED', dim, version, o[1], o[2], o[3], o[4], o[5] }
  end

  if head == id or not first then
    forget_waiter(id)
  end
  local token = fmt(next_token())
  local expires = now + d.ttl
  apply(tenant, backend, v, bytes, 1)
  set_lease(id, token .. '|' .. tenant .. '|' .. backend .. '|' .. bytes_s .. '|' .. now_s .. '|' .. operation
    .. '|' .. fmt(version))
  set_expiry(id, expires)
  local o = occupancy(tenant, backend, v)
  event('admitted', id, token, tenant, backend, bytes_s, operation, 'admitted', version, o)
  return { 'ADMITTED', token, expires, version, o[1], o[2], o[3], o[4], o[5] }
end

-- ARGV: 4 lease id, 5 tenant hash or '-', 6 backend hash, 7 bytes, 8..12 default limits
-- (service bytes, service transfers, tenant bytes, tenant transfers, backend transfers),
-- 13 ttl ms, 14 operation, 15 waiter ttl ms, 16 first attempt ('1'/'0').
local function acquire()
  reap(reap_limit)
  return acquire_one(argv[4], argv[5], argv[6], argv[7], argv[14], argv[16],
    parse_defaults({ argv[8], argv[9], argv[10], argv[11], argv[12], argv[13], argv[15] }))
end

-- One release: lease id, fencing token, outcome (completed, failed, interrupted).
local function release_one(id, token, outcome)
  local raw = get_lease(id)
  if not raw then
    return { 'MISSING' }
  end
  local r = parse(raw)
  if r[1] ~= token then
    return { 'STALE' }
  end
  drop_lease(id, 'completed', outcome, r)
  return { 'RELEASED' }
end

-- One renewal: lease id, fencing token, ttl ms (a number).
local function renew_one(id, token, ttl)
  if not ttl or ttl <= 0 then
    return { 'PROTOCOL', 'invalid_renew' }
  end
  local raw = get_lease(id)
  if not raw then
    return { 'LOST' }
  end
  local r = parse(raw)
  if r[1] ~= token then
    return { 'STALE' }
  end
  local score = get_expiry(id)
  if (not score) or score <= now then
    -- Past expiry but not reaped yet: never resurrect it.
    drop_lease(id, 'expired', 'lease_expired', r)
    return { 'EXPIRED' }
  end
  local expires = now + ttl
  set_expiry(id, expires)
  return { 'RENEWED', expires }
end

-- ARGV: 4 lease id, 5 fencing token, 6 ttl ms.
local function renew()
  return renew_one(argv[4], argv[5], tonumber(argv[6]))
end

-- ARGV: 4 lease id, 5 fencing token, 6 outcome (completed, failed, interrupted).
local function release()
  return release_one(argv[4], argv[5], argv[6])
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
    local v = load_counts(tenant, backend)
    event(kind, id, '-', tenant, backend, bytes, operation, dim, policy_version(),
      occupancy(tenant, backend, v))
  end
  return { 'ABANDONED', released }
end

-- ARGV: 4 lease id, 5 tenant, 6 backend, 7 bytes, 8 operation, 9 dimension or '-',
-- 10 event kind (timed_out, the default, or abandoned).
local function abandon()
  return abandon_one(argv[4], argv[5], argv[6], argv[7], argv[8], argv[9], argv[10])
end


-- ARGV: 4 tenant hash or '-', 5 backend hash or '-'.
local function snapshot()
  reap(reap_limit)
  local v = load_counts(argv[4], argv[5])
  local o = occupancy(argv[4], argv[5], v)
  return { 'SNAPSHOT', o[1], o[2], o[3], o[4], o[5], fmt(policy_version()), fmt(now),
    fmt(redis.call('ZCARD', K_WAITERS)) }
end

-- Set or clear a tenant override. ARGV: 4 tenant hash, 5 bytes or '-', 6 transfers or '-'.
local function policy()
  local tenant = argv[4]
  if tenant == '-' then
    return { 'PROTOCOL', 'policy_needs_tenant' }
  end
  local fields = { [5] = ':b', [6] = ':c' }
  for i = 5, 6 do
    local v = argv[i]
    if v ~= '-' and (not tonumber(v) or tonumber(v) < 1) then
      return { 'PROTOCOL', 'invalid_policy_value' }
    end
  end
  for i = 5, 6 do
    local field = 't:' .. tenant .. fields[i]
    if argv[i] == '-' then
      redis.call('HDEL', K_POLICY, field)
    else
      redis.call('HSET', K_POLICY, field, fmt(tonumber(argv[i])))
    end
  end
  -- Versions follow the same rule as fencing tokens, in milliseconds: the larger of the
  -- stored version + 1 and the server time, so a promoted lagging replica or an emptied
  -- server still issues a version above every earlier one.
  local version = mmax((tonumber(redis.call('HGET', K_POLICY, 'version')) or 0) + 1, now)
  redis.call('HSET', K_POLICY, 'version', fmt(version))
  local outcome = 'set'
  if argv[5] == '-' and argv[6] == '-' then
    outcome = 'cleared'
  end
  local v = load_counts(tenant, '-')
  event('policy_changed', '-', '-', tenant, '-', '0', 'control', outcome, version, occupancy(tenant, '-', v))
  return { 'POLICY', fmt(version) }
end

-- Bump the policy version (same rule as fencing tokens, in ms) and return it.
local function bump_version()
  local version = mmax(policy_version() + 1, now)
  redis.call('HSET', K_POLICY, 'version', fmt(version))
  policy_cache['version'] = version
  return version
end

-- Read, bootstrap or set the cluster-wide limits. ARGV: 4 mode ('read', 'bootstrap',
-- 'set'), 5..9 service bytes, service transfers, tenant bytes, tenant transfers, backend
-- transfers, each a number or '-' (bootstrap: store only where absent; set: leave '-'
-- unchanged). Reply: LIMITS version and the five stored values ('-' when absent).
local function limits()
  local mode = argv[4]
  local values = { argv[5], argv[6], argv[7], argv[8], argv[9] }
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
    local v = load_counts('-', '-')
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
  local backend, value = argv[4], argv[5]
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
  local v = load_counts('-', backend)
  event('policy_changed', '-', '-', '-', backend, '0', 'control', outcome, version, occupancy('-', backend, v))
  return { 'POLICY', fmt(version) }
end

-- Append a client-side decision. ARGV: 4 kind, 5 lease, 6 tenant, 7 backend, 8 bytes,
-- 9 operation, 10 outcome.
local function append_event()
  local kinds = { admitted = 1, queued = 1, timed_out = 1, abandoned = 1, completed = 1, expired = 1, policy_changed = 1 }
  if not kinds[argv[4]] then
    return { 'PROTOCOL', 'unknown_event_kind' }
  end
  local v = load_counts(argv[6], argv[7])
  event(argv[4], argv[5], '-', argv[6], argv[7], argv[8], argv[9], argv[10], policy_version(),
    occupancy(argv[6], argv[7], v))
  return { 'RECORDED' }
end

-- Charge a traffic quota in fixed windows of Redis time. KEYS[9] = traffic key.
-- ARGV: 4 kind, 5 amount (0 = only check that the window is not spent), 6 limit, 7 window ms.
local function charge()
  local key = keys[9]
  local amount, lim, window_ms = tonumber(argv[5]), tonumber(argv[6]), tonumber(argv[7])
  if not key or not amount or amount < 0 or not lim or not window_ms or window_ms <= 0 then
    return { 'PROTOCOL', 'invalid_charge' }
  end
  local window = mfloor(now / window_ms)
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

-- Sizes of the batch items in ARGV (the kind letter included).
local ITEM_SIZE = { A = 7, R = 4, X = 8 }

-- Read everything a batch's items will touch with one HMGET per hash: the lease records of
-- every item, the counters of every scope (a release's scope from its record) and the
-- policy fields of every acquire. Only a cache fill: the items run as without it.
local function prefetch(n)
  local ids, cfields, pfields, i = {}, {}, {}, 12
  for _ = 1, n do
    local kind = argv[i]
    local size = ITEM_SIZE[kind]
    if not size then
      return
    end
    ids[#ids + 1] = argv[i + 1]
    if kind == 'A' then
      scope_fields(argv[i + 2], argv[i + 3], cfields)
      acquire_policy_fields(argv[i + 2], argv[i + 3], pfields)
    elseif kind == 'X' then
      scope_fields(argv[i + 2], argv[i + 3], cfields)
    end
    i = i + size
  end
  load_fields(K_LEASES, lease_cache, ids, false, true)
  for k = 1, #ids do
    local raw = lease_cache[ids[k]]
    if raw then
      local r = parse(raw)
      if r[3] then
        scope_fields(r[2], r[3], cfields)
      end
    end
  end
  load_fields(K_COUNTS, counts, cfields, 0)
  if #pfields > 0 then
    load_fields(K_POLICY, policy_cache, pfields, false)
  end
end

-- Many acquires, releases and abandons of one node in one call (coalesced by the client).
-- ARGV: 4 item count, 5..11 the acquire defaults and timings (as acquire's 8..13 and 15),
-- then per item: 'A', lease id, tenant, backend, bytes, operation, first; or 'R', lease
-- id, fencing token, outcome; or 'X' (abandon), lease id, tenant, backend, bytes,
-- operation, dimension or '-', event kind.
-- Reply: one reply array per item, in order.
local function batch()
  local n = tonumber(argv[4])
  if not n or n < 1 then
    return { 'PROTOCOL', 'invalid_batch' }
  end
  local d = parse_defaults({ argv[5], argv[6], argv[7], argv[8], argv[9], argv[10], argv[11] })
  prefetch(n)
  local replies, i, reaped = {}, 12, false
  for k = 1, n do
    local kind = argv[i]
    if kind == 'A' then
      if not reaped then
        reap(reap_limit)
        reaped = true
      end
      replies[k] = acquire_one(argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4], argv[i + 5], argv[i + 6], d)
    elseif kind == 'R' then
      replies[k] = release_one(argv[i + 1], argv[i + 2], argv[i + 3])
    elseif kind == 'X' then
      replies[k] = abandon_one(argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4], argv[i + 5], argv[i + 6], argv[i + 7])
    else
      return { 'PROTOCOL', 'invalid_batch_item' }
    end
    i = i + ITEM_SIZE[kind]
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

local function run(call_keys, call_argv)
  begin(call_keys, call_argv)
  local handler = ops[op]
  if not handler then
    return { 'PROTOCOL', 'unknown_op' }
  end
  local result = handler()
  flush()
  return result
end

-- FUNCTION LOAD (the client prepends the shebang and `local FUNCTION_NAME`, the name
-- carrying the code's hash) registers `run`; EVALSHA runs it at once.
if redis.register_function then
  redis.register_function(FUNCTION_NAME, run)
else
  return run(KEYS, ARGV)
end
