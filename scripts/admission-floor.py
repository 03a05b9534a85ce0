#!/usr/bin/env python3
"""Floor of the admission design: the Redis work an admission cannot avoid, measured.

A "floor" Redis Function does, per admission of a batch of B, only the writes the design
needs, with no checking: acquire = the five counters (service bytes and transfers, tenant
bytes and transfers, backend transfers; one HMGET and one HSET of the counts hash per
call, or HINCRBY per counter with FLOOR_COUNTERS=hincrby), the lease record (the real
script's format and size, one HSET per call), its expiry (one ZADD per call), a fencing
token (one INCRBY per call), one event; release = the counters back, HDEL, ZREM, one
`completed` event. The release carries the lease's fields (the floor reads no record and
checks no token); replies are flat (tokens, or a count); one XTRIM MAXLEN ~ per call.

Variants: floor (an XADD per decision with the real event's 16 fields), floor-batch (one
XADD per call: one field per decision, its 14 values joined with '|'), floor-noevent (no
XADD), real (lua/admission.lua, `batch` op, the protocol of admission-callgrind.py).

For each variant and B it measures
  1. Redis instructions per admission: redis-server under valgrind callgrind, ROUNDS
     rounds of one call of B acquires then one call releasing them (HELD leases held);
  2. Redis CPU per admission without valgrind (INFO cpu used_cpu_sys+used_cpu_user
     delta / admissions) with CONNS connections each looping acquire call -> release
     call, and in the same server `redis-benchmark -c 32 -n 100000 EVALSHA <return 1> 0`
     at the start and end of each repeat (a repeat's baseline is the less disturbed
     of the two: the lower CPU per op, the higher rate).
     Ratio bound = trivial CPU/op / CPU/admission (the bench's ratio if Redis limited
     both); last column = (1 s / CPU per admission) / baseline ops/s (the ratio if the
     admission path kept one Redis core busy against the baseline as measured, which
     need not itself be Redis-bound).
Also the instructions of one trivial `EVALSHA` (user space only: about half of a trivial
call's CPU is the kernel's socket work, which callgrind does not count).

Usage:

    scripts/admission-floor.py [B ...]              (default: 8 16 32 64)

Environment: VARIANTS (comma list, default floor,floor-batch,floor-noevent,real), ROUNDS
(callgrind, default 20), REPEATS (CPU measurement, default 3), ADMISSIONS (per CPU
measurement, default 40000), CONNS (default 4), HELD (leases held throughout, default 24;
above 128 the expiry set leaves Redis's listpack encoding), SKIP_CALLGRIND=1, SKIP_CPU=1,
FLOOR_COUNTERS=hincrby.
"""

import hashlib
import os
import re
import selectors
import subprocess
import sys
import time
import uuid

from redis_probe import Conn, Incomplete, RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_CODE = open(os.path.join(ROOT, "lua", "admission.lua")).read()
REAL_FN = "graviton_admission_real"
REAL_LIB = f"#!lua name={REAL_FN}\nlocal FUNCTION_NAME = '{REAL_FN}'\n{REAL_CODE}"
FLOOR_FN = "graviton_admission_floor"

# The floor. ARGV: 1 events ('item', 'batch', 'none'), 2 counters ('hset', 'hincrby'),
# 3 stream MAXLEN (approximate), 4 ttl ms, 5 item count, then per item
# 'A', lease, tenant, backend, bytes, operation   or
# 'R', lease, token, tenant, backend, bytes, operation, outcome.
# Reply: the tokens of the acquires (integers), or the number of releases.
FLOOR_LIB = r"""#!lua name=graviton_admission_floor
local decimal, decimal_count, tnames, bnames, names_count

local function run(keys, argv)
  local call, tonumber, unpack, sformat = redis.call, _G.tonumber, _G.unpack, string.format
  local K_COUNTS, K_EXP, K_LEASES, K_FENCE, K_EVENTS = keys[1], keys[2], keys[3], keys[4], keys[6]
  local events, hincr, max_events, ttl, n = argv[1], argv[2] == 'hincrby', argv[3], tonumber(argv[4]), tonumber(argv[5])
  if decimal == nil or decimal_count > 4096 then
    decimal, decimal_count = {}, 0
  end
  if tnames == nil or names_count > 4096 then
    tnames, bnames, names_count = {}, {}, 0
  end
  local function fmt(x)
    local s = decimal[x]
    if s == nil then
      s = sformat('%d', x)
      decimal[x] = s
      decimal_count = decimal_count + 1
    end
    return s
  end
  local clock = call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  local now_s, exp_s, version = fmt(now), fmt(now + ttl), '0'

  -- Field names of each item's scope, and the number of acquires.
  local i, acquires, names, seen, fields = 6, 0, {}, {}, { 's:b', 's:c' }
  for k = 1, n do
    local tenant, backend
    if argv[i] == 'A' then
      tenant, backend, acquires = argv[i + 2], argv[i + 3], acquires + 1
    else
      tenant, backend = argv[i + 3], argv[i + 4]
    end
    local t = tnames[tenant]
    if t == nil then
      t = { 't:' .. tenant .. ':b', 't:' .. tenant .. ':c' }
      tnames[tenant] = t
      names_count = names_count + 1
    end
    local b = bnames[backend]
    if b == nil then
      b = 'b:' .. backend .. ':c'
      bnames[backend] = b
      names_count = names_count + 1
    end
    names[k] = { t[1], t[2], b }
    if not hincr then
      if not seen[t[1]] then
        seen[t[1]] = true
        fields[#fields + 1] = t[1]
        fields[#fields + 1] = t[2]
      end
      if not seen[b] then
        seen[b] = true
        fields[#fields + 1] = b
      end
    end
    if argv[i] == 'A' then i = i + 6 else i = i + 8 end
  end

  local v = {}
  if not hincr then
    local raw = call('HMGET', K_COUNTS, unpack(fields))
    for k = 1, #fields do
      v[fields[k]] = tonumber(raw[k]) or 0
    end
  end
  local token = 0
  if acquires > 0 then
    token = call('INCRBY', K_FENCE, acquires) - acquires
  end

  local lset, zadd, gone, tokens, entry = {}, {}, {}, {}, nil
  if events == 'batch' then
    entry = { K_EVENTS, '*', 'schema', 'graviton-admission-event-v2', 'at_ms', now_s }
  end
  i = 6
  for k = 1, n do
    local nm = names[k]
    local kind, id, tok, tenant, backend, bytes_s, operation, outcome, o1, o2, o3, o4, o5
    if argv[i] == 'A' then
      id, tenant, backend, bytes_s, operation = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4], argv[i + 5]
      kind, outcome = 'admitted', 'admitted'
      token = token + 1
      tok = sformat('%d', token)
      tokens[#tokens + 1] = token
      lset[#lset + 1] = id
      lset[#lset + 1] = tok .. '|' .. tenant .. '|' .. backend .. '|' .. bytes_s .. '|' .. now_s .. '|' .. operation .. '|' .. version
      zadd[#zadd + 1] = exp_s
      zadd[#zadd + 1] = id
      i = i + 6
      local bytes = tonumber(bytes_s)
      if hincr then
        o1 = call('HINCRBY', K_COUNTS, 's:b', bytes_s)
        o2 = call('HINCRBY', K_COUNTS, 's:c', '1')
        o3 = call('HINCRBY', K_COUNTS, nm[1], bytes_s)
        o4 = call('HINCRBY', K_COUNTS, nm[2], '1')
        o5 = call('HINCRBY', K_COUNTS, nm[3], '1')
      else
        o1, o2 = v['s:b'] + bytes, v['s:c'] + 1
        o3, o4, o5 = v[nm[1]] + bytes, v[nm[2]] + 1, v[nm[3]] + 1
      end
    else
      id, tok, tenant, backend = argv[i + 1], argv[i + 2], argv[i + 3], argv[i + 4]
      bytes_s, operation, outcome = argv[i + 5], argv[i + 6], argv[i + 7]
      kind = 'completed'
      gone[#gone + 1] = id
      i = i + 8
      local bytes = tonumber(bytes_s)
      if hincr then
        o1 = call('HINCRBY', K_COUNTS, 's:b', '-' .. bytes_s)
        o2 = call('HINCRBY', K_COUNTS, 's:c', '-1')
        o3 = call('HINCRBY', K_COUNTS, nm[1], '-' .. bytes_s)
        o4 = call('HINCRBY', K_COUNTS, nm[2], '-1')
        o5 = call('HINCRBY', K_COUNTS, nm[3], '-1')
      else
        o1, o2 = v['s:b'] - bytes, v['s:c'] - 1
        o3, o4, o5 = v[nm[1]] - bytes, v[nm[2]] - 1, v[nm[3]] - 1
      end
    end
    if not hincr then
      v['s:b'], v['s:c'], v[nm[1]], v[nm[2]], v[nm[3]] = o1, o2, o3, o4, o5
    end
    if events ~= 'none' then
      o1, o2, o3, o4, o5 = fmt(o1), fmt(o2), fmt(o3), fmt(o4), fmt(o5)
      if events == 'item' then
        call('XADD', K_EVENTS, '*',
          'schema', 'graviton-admission-event-v1', 'kind', kind, 'at_ms', now_s,
          'lease', id, 'fencing_token', tok, 'tenant', tenant, 'backend', backend,
          'bytes', bytes_s, 'operation', operation, 'outcome', outcome,
          'policy_version', version,
          'service_bytes', o1, 'service_transfers', o2, 'tenant_bytes', o3,
          'tenant_transfers', o4, 'backend_transfers', o5)
      else
        entry[#entry + 1] = id
        entry[#entry + 1] = kind .. '|' .. tok .. '|' .. tenant .. '|' .. backend .. '|' .. bytes_s .. '|'
          .. operation .. '|' .. outcome .. '|' .. version .. '|' .. o1 .. '|' .. o2 .. '|' .. o3 .. '|' .. o4 .. '|' .. o5
      end
    end
  end

  if not hincr then
    local set = {}
    for k = 1, #fields do
      set[#set + 1] = fields[k]
      set[#set + 1] = fmt(v[fields[k]])
    end
    call('HSET', K_COUNTS, unpack(set))
  end
  if #lset > 0 then
    call('HSET', K_LEASES, unpack(lset))
    call('ZADD', K_EXP, unpack(zadd))
  end
  if #gone > 0 then
    call('HDEL', K_LEASES, unpack(gone))
    call('ZREM', K_EXP, unpack(gone))
  end
  if events == 'batch' then
    call('XADD', unpack(entry))
  end
  if events ~= 'none' then
    call('XTRIM', K_EVENTS, 'MAXLEN', '~', max_events)
  end
  if acquires > 0 then
    return tokens
  end
  return #gone
end

redis.register_function('graviton_admission_floor', run)
"""

BASE = "graviton:{bench}"
KEYS = [
    f"{BASE}:admission:{name}"
    for name in ["counts", "expirations", "leases", "fence", "policy", "events", "waiters", "waiting"]
]
TENANTS = [hashlib.sha256(f"tenant\0{i}".encode()).hexdigest() for i in range(8)]
BACKEND = hashlib.sha256(b"backend\0fs").hexdigest()
BYTES = str(16 << 20)
MAX_EVENTS = "100000"
TTL = "30000"
# Real script: max_events, reap batch; the acquire defaults and timings.
COMMON = [MAX_EVENTS, "256"]
DEFAULTS = [str(1 << 40), "1000000", str(1 << 40), "1000000", "1000000", TTL, "7400"]
HELD = int(os.environ.get("HELD", "24"))
COUNTERS = os.environ.get("FLOOR_COUNTERS", "hset")
EVENTS = {"floor": "item", "floor-batch": "batch", "floor-noevent": "none"}


# One variant's protocol: the request of an acquire call and of the release call that
# follows it (from the acquire's reply), and reply checks.
def acquire_request(variant, ids, k):
    if variant == "real":
        items = []
        for j, lease in enumerate(ids):
            items += ["A", lease, TENANTS[(k + j) % len(TENANTS)], BACKEND, BYTES, "upload", "1"]
        return ["FCALL", REAL_FN, len(KEYS), *KEYS, "batch", *COMMON, str(len(ids)), *DEFAULTS, *items]
    items = []
    for j, lease in enumerate(ids):
        items += ["A", lease, TENANTS[(k + j) % len(TENANTS)], BACKEND, BYTES, "upload"]
    return ["FCALL", FLOOR_FN, len(KEYS), *KEYS, EVENTS[variant], COUNTERS, MAX_EVENTS, TTL, str(len(ids)), *items]


def release_request(variant, ids, k, reply):
    if variant == "real":
        items = []
        for lease, r in zip(ids, reply):
            assert r[0] == "ADMITTED", r
            items += ["R", lease, r[1], "completed"]
        return ["FCALL", REAL_FN, len(KEYS), *KEYS, "batch", *COMMON, str(len(ids)), *DEFAULTS, *items]
    assert len(reply) == len(ids), reply
    items = []
    for j, (lease, token) in enumerate(zip(ids, reply)):
        items += ["R", lease, token, TENANTS[(k + j) % len(TENANTS)], BACKEND, BYTES, "upload", "completed"]
    return ["FCALL", FLOOR_FN, len(KEYS), *KEYS, EVENTS[variant], COUNTERS, MAX_EVENTS, TTL, str(len(ids)), *items]


def check_release(variant, reply, b):
    if variant == "real":
        assert all(r[0] == "RELEASED" for r in reply), reply
    else:
        assert int(reply) == b, reply


def round_trip(conn, variant, b, k):
    ids = [str(uuid.uuid4()) for _ in range(b)]
    reply = conn.call(*acquire_request(variant, ids, k))
    check_release(variant, conn.call(*release_request(variant, ids, k, reply)), b)


def floor_server(prefix, valgrind=False):
    """A throwaway redis-server with the real script and the floor loaded."""
    return RedisServer(prefix, valgrind=valgrind, nodelay=True, libraries=(REAL_LIB, FLOOR_LIB))


def setup(conn, variant):
    """Empty state, fence at a clock-like value (16-digit tokens, as the real script's),
    HELD leases held throughout, 5 warm-up rounds."""
    conn.call("FLUSHALL")
    conn.call("SET", KEYS[3], str(int(time.time() * 1e6)))
    held = [str(uuid.uuid4()) for _ in range(HELD)]
    conn.call(*acquire_request(variant, held, 0))
    for k in range(5):
        round_trip(conn, variant, 8, k)


def callgrind(variant, b, rounds):
    with floor_server("adm-floor-cg-", valgrind=True) as redis:
        setup(redis.conn, variant)
        redis.zero_counts()
        for k in range(rounds):
            round_trip(redis.conn, variant, b, k)
        total, _ = redis.instructions()
        return total / (rounds * b)


def cpu_seconds(conn):
    info = conn.call("INFO", "cpu")
    fields = dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)
    return float(fields["used_cpu_sys"]) + float(fields["used_cpu_user"])


def baseline(port, conn, sha):
    before = cpu_seconds(conn)
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-c", "32", "-n", "100000", "-q",
                          "EVALSHA", sha, "0"], check=True, capture_output=True, text=True).stdout
    used = cpu_seconds(conn) - before
    rate = float(re.findall(r"([\d.]+) requests per second", out)[-1])
    return rate, used / 100000 * 1e6


def drive(port, conn, variant, b, admissions, conns):
    """CONNS connections, each looping acquire call -> release call of B items; returns
    (admissions/s, Redis CPU µs per admission)."""
    setup(conn, variant)
    calls = max(1, admissions // b)
    clients = [Conn(port, nodelay=True) for _ in range(conns)]
    sel = selectors.DefaultSelector()
    state = {}
    started = 0

    def start(c):
        nonlocal started
        ids = [str(uuid.uuid4()) for _ in range(b)]
        k = started
        started += 1
        c.send(acquire_request(variant, ids, k))
        state[c] = ("A", ids, k)

    before = cpu_seconds(conn)
    t0 = time.perf_counter()
    for c in clients:
        sel.register(c.sock, selectors.EVENT_READ, c)
        start(c)
    done = 0
    # Until every call started has answered (the last ones' CPU is in the delta too).
    while state:
        for key, _ in sel.select():
            c = key.data
            data = c.sock.recv(1 << 16)
            if not data:
                raise RuntimeError("connection closed")
            c.buf += data
            reply = c.try_reply()
            if reply is Incomplete:
                continue
            phase, ids, k = state[c]
            if phase == "A":
                c.send(release_request(variant, ids, k, reply))
                state[c] = ("R", ids, k)
                continue
            check_release(variant, reply, b)
            done += 1
            if started < calls:
                start(c)
            else:
                del state[c]
                sel.unregister(c.sock)
    elapsed = time.perf_counter() - t0
    used = cpu_seconds(conn) - before
    for c in clients:
        c.sock.close()
    n = done * b
    return n / elapsed, used / n * 1e6


def rng(values, f="{:.1f}"):
    lo, hi = min(values), max(values)
    return f.format(lo) if f.format(lo) == f.format(hi) else f"{f.format(lo)}–{f.format(hi)}"


def trivial_callgrind(calls=2000):
    """Redis instructions per `EVALSHA <return 1> 0` (one client, one call at a time)."""
    with floor_server("adm-floor-cg-", valgrind=True) as redis:
        sha = redis.conn.call("SCRIPT", "LOAD", "return 1")
        for _ in range(100):
            redis.conn.call("EVALSHA", sha, "0")
        redis.zero_counts()
        for _ in range(calls):
            redis.conn.call("EVALSHA", sha, "0")
        total, _ = redis.instructions()
        return total / calls


def load():
    return open("/proc/loadavg").read().split()[0]


def main():
    sizes = [int(a) for a in sys.argv[1:]] or [8, 16, 32, 64]
    variants = os.environ.get("VARIANTS", "floor,floor-batch,floor-noevent,real").split(",")
    rounds = int(os.environ.get("ROUNDS", "20"))
    repeats = int(os.environ.get("REPEATS", "3"))
    admissions = int(os.environ.get("ADMISSIONS", "40000"))
    conns = int(os.environ.get("CONNS", "4"))
    instr, runs, base, loads = {}, {}, [], [load()]
    print(f"load average at start: {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)
    if os.environ.get("SKIP_CALLGRIND") != "1":
        instr["trivial"] = trivial_callgrind()
        print(f"callgrind EVALSHA return 1: {instr['trivial']:,.0f} instructions per call", flush=True)
        for v in variants:
            for b in sizes:
                instr[v, b] = callgrind(v, b, rounds)
                print(f"callgrind {v} B={b}: {instr[v, b]:,.0f} instructions per admission", flush=True)
        loads.append(load())
    if os.environ.get("SKIP_CPU") != "1":
        with floor_server("adm-floor-cpu-") as redis:
            port, conn = redis.port, redis.conn
            sha = conn.call("SCRIPT", "LOAD", "return 1")
            for r in range(repeats):
                first = baseline(port, conn, sha)
                print(f"repeat {r + 1}: baseline {first[0]:,.0f} ops/s, {first[1]:.2f} µs Redis CPU/op (load {load()})",
                      flush=True)
                measured = {}
                for v in variants:
                    for b in sizes:
                        measured[v, b] = drive(port, conn, v, b, admissions, conns)
                        a, c = measured[v, b]
                        print(f"  {v} B={b}: {a:,.0f} admissions/s, {c:.1f} µs Redis CPU/admission", flush=True)
                last = baseline(port, conn, sha)
                loads.append(load())
                print(f"repeat {r + 1}: baseline {last[0]:,.0f} ops/s, {last[1]:.2f} µs Redis CPU/op (load {load()})",
                      flush=True)
                base += [first, last]
                # This repeat's baseline: the less disturbed of its two measurements
                # (preemption only raises the CPU per trivial op and lowers its rate).
                ops, cpu_op = max(first[0], last[0]), min(first[1], last[1])
                for key, (a, c) in measured.items():
                    runs.setdefault(key, []).append((c, cpu_op / c, 1e6 / c / ops))
    loads.append(load())
    print(f"load average at end: {' '.join(open('/proc/loadavg').read().split()[:3])}"
          f" (1-min samples during the run: {', '.join(loads)})")
    print()
    if "trivial" in instr:
        print(f"callgrind, EVALSHA `return 1`: {instr['trivial']:,.0f} instructions per call (user space only)")
    if base:
        print(f"redis-benchmark -c 32 -n 100000 EVALSHA `return 1`: {rng([x[0] for x in base], '{:,.0f}')} ops/s, "
              f"{rng([x[1] for x in base], '{:.2f}')} µs Redis CPU/op ({len(base)} runs)")
    print()
    print("| variant | B | Redis instr. / admission | Redis CPU µs / admission | "
          "ratio bound (CPU/op trivial ÷ CPU/admission) | Redis-bound admissions/s ÷ baseline ops/s |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        for b in sizes:
            i = f"{instr[v, b]:,.0f}" if (v, b) in instr else "—"
            r = runs.get((v, b))
            if r:
                print(f"| {v} | {b} | {i} | {rng([x[0] for x in r])} | {rng([x[1] for x in r], '{:.2f}')} | "
                      f"{rng([x[2] for x in r], '{:.2f}')} |")
            else:
                print(f"| {v} | {b} | {i} | — | — | — |")


if __name__ == "__main__":
    main()
