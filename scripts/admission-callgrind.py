#!/usr/bin/env python3
"""Redis instructions per admission of lua/admission.lua, independent of machine load.

Runs `redis-server` under `valgrind --tool=callgrind`, loads the script as a Redis
Function, warms up, then zeroes the counters and runs ROUNDS rounds of one `batch` call
of B acquires followed by one `batch` call releasing the same B leases (the bench's
shape: 8 tenants, backend `fs`, 16 MiB footprints). Prints instructions per admission
(acquire + release) from the dump. Usage:

    scripts/admission-callgrind.py [B ...]          (default: 8 32)

Environment: ROUNDS (default 20), HELD (leases held throughout, default 24), KEEP=1 keeps the callgrind output files (for
`callgrind_annotate`) in ./callgrind-out/, ADM_SCRIPT=path measures another
version of the script (same protocol).
"""

import hashlib
import os
import shutil
import sys
import uuid

from redis_probe import RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = open(os.environ.get("ADM_SCRIPT") or os.path.join(ROOT, "lua", "admission.lua")).read()
FUNCTION = "graviton_admission_callgrind"
LIBRARY = f"#!lua name={FUNCTION}\nlocal FUNCTION_NAME = '{FUNCTION}'\n{CODE}"
BASE = "graviton:{bench}"
KEYS = [
    f"{BASE}:admission:{name}"
    for name in ["counts", "expirations", "leases", "fence", "policy", "events", "waiters", "waiting"]
]
TENANTS = [hashlib.sha256(f"tenant\0{i}".encode()).hexdigest() for i in range(8)]
BACKEND = hashlib.sha256(b"backend\0fs").hexdigest()
# max_events, reap batch; then the acquire defaults and timings (five limits, ttl, waiter ttl).
COMMON = ["100000", "256"]
# CHECK=0: do not check the replies (for stripped-down variants of the script).
CHECK = os.environ.get("CHECK", "1")
# Leases acquired before the measurement and held throughout (HELD, default 24).
HELD = int(os.environ.get("HELD", "24"))
DEFAULTS = [str(1 << 40), "1000000", str(1 << 40), "1000000", "1000000", "30000", "7400"]


def fcall(conn, argv):
    return conn.call("FCALL", FUNCTION, len(KEYS), *KEYS, *argv)


def acquire_items(ids, k):
    items = []
    for j, lease in enumerate(ids):
        items += ["A", lease, TENANTS[(k + j) % len(TENANTS)], BACKEND, str(16 << 20), "upload", "1"]
    return items


def round_trip(conn, b, k):
    ids = [str(uuid.uuid4()) for _ in range(b)]
    replies = fcall(conn, ["batch", *COMMON, str(b), *DEFAULTS, *acquire_items(ids, k)])
    items = []
    for lease, reply in zip(ids, replies):
        assert CHECK == "0" or reply[0] == "ADMITTED", reply
        items += ["R", lease, reply[1], "completed"]
    replies = fcall(conn, ["batch", *COMMON, str(b), *DEFAULTS, *items])
    assert CHECK == "0" or all(r[0] == "RELEASED" for r in replies), replies


def measure(b, rounds, keep):
    with RedisServer("adm-cg-", valgrind=True, libraries=(LIBRARY,)) as redis:
        conn = redis.conn
        # Leases held throughout, as the bench's other clients hold theirs, so the hashes
        # and the expiry set are never emptied (and recreated) between rounds.
        if HELD > 0:
            held = [str(uuid.uuid4()) for _ in range(HELD)]
            replies = fcall(conn, ["batch", *COMMON, str(HELD), *DEFAULTS, *acquire_items(held, 0)])
            assert CHECK == "0" or all(r[0] == "ADMITTED" for r in replies), replies
        for k in range(5):
            round_trip(conn, b, k)
        redis.zero_counts()
        for k in range(rounds):
            round_trip(conn, b, k)
        total, dump = redis.instructions()
        per = total / (rounds * b)
        print(f"B={b}: {per:,.0f} instructions per admission ({total:,} over {rounds} rounds)")
        if keep:
            dest = os.path.join(os.getcwd(), "callgrind-out")
            os.makedirs(dest, exist_ok=True)
            shutil.copy(dump, os.path.join(dest, f"B{b}.out"))
        return per


def main():
    sizes = [int(a) for a in sys.argv[1:]] or [8, 32]
    rounds = int(os.environ.get("ROUNDS", "20"))
    keep = os.environ.get("KEEP") == "1"
    for b in sizes:
        measure(b, rounds, keep)


if __name__ == "__main__":
    main()
