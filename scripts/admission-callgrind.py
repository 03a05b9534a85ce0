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

import glob
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

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


def encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Conn:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def _line(self):
        while b"\r\n" not in self.buf:
            self.buf += self.sock.recv(1 << 16)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read(self):
        line = self._line()
        t, rest = line[:1], line[1:]
        if t in (b"+", b":"):
            return rest.decode()
        if t == b"-":
            raise RuntimeError(rest.decode())
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.sock.recv(1 << 16)
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data.decode()
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise RuntimeError(f"bad reply {line!r}")

    def call(self, *args):
        self.sock.sendall(encode(args))
        return self._read()


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


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def measure(b, rounds, keep):
    work = tempfile.mkdtemp(prefix="adm-cg-")
    port = free_port()
    out = os.path.join(work, "callgrind.out.%p")
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", work],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                conn = Conn(port)
                conn.call("PING")
                break
            except (OSError, RuntimeError):
                time.sleep(0.1)
        conn.call("FUNCTION", "LOAD", "REPLACE", LIBRARY)
        # Leases held throughout, as the bench's other clients hold theirs, so the hashes
        # and the expiry set are never emptied (and recreated) between rounds.
        if HELD > 0:
            held = [str(uuid.uuid4()) for _ in range(HELD)]
            replies = fcall(conn, ["batch", *COMMON, str(HELD), *DEFAULTS, *acquire_items(held, 0)])
            assert CHECK == "0" or all(r[0] == "ADMITTED" for r in replies), replies
        for k in range(5):
            round_trip(conn, b, k)
        subprocess.run(["callgrind_control", "-z", str(server.pid)], check=True, stdout=subprocess.DEVNULL)
        for k in range(rounds):
            round_trip(conn, b, k)
        subprocess.run(["callgrind_control", "-d", str(server.pid)], check=True, stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        dumps = sorted(glob.glob(os.path.join(work, "callgrind.out.*")))
        dump = [d for d in dumps if re.search(r"\.\d+\.\d+$", d)] or dumps
        total = 0
        with open(dump[-1]) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    total = int(line.split()[1])
                    break
        per = total / (rounds * b)
        print(f"B={b}: {per:,.0f} instructions per admission ({total:,} over {rounds} rounds)")
        if keep:
            dest = os.path.join(os.getcwd(), "callgrind-out")
            os.makedirs(dest, exist_ok=True)
            shutil.copy(dump[-1], os.path.join(dest, f"B{b}.out"))
        return per
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


def main():
    sizes = [int(a) for a in sys.argv[1:]] or [8, 32]
    rounds = int(os.environ.get("ROUNDS", "20"))
    keep = os.environ.get("KEEP") == "1"
    for b in sizes:
        measure(b, rounds, keep)


if __name__ == "__main__":
    main()
