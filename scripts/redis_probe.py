"""Shared by scripts/admission-callgrind.py and scripts/admission-floor.py (imported from
the scripts' own directory): a minimal RESP client, a throwaway redis-server on a free
loopback port (optionally under valgrind's callgrind), and the instructions that server
ran between two points of a measurement."""

import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time


def encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Incomplete(Exception):
    pass


def parse(buf, pos=0):
    """One RESP reply from buf at pos: (value, next pos); Incomplete if buf is short."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    t, rest = buf[pos:pos + 1], buf[pos + 1:end]
    pos = end + 2
    if t in (b"+", b":"):
        return rest.decode(), pos
    if t == b"-":
        raise RuntimeError(rest.decode())
    if t == b"$":
        n = int(rest)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise Incomplete
        return buf[pos:pos + n].decode(), pos + n + 2
    if t == b"*":
        n = int(rest)
        if n < 0:
            return None, pos
        out = []
        for _ in range(n):
            v, pos = parse(buf, pos)
            out.append(v)
        return out, pos
    raise RuntimeError(f"bad reply {buf[pos:pos + 40]!r}")


class Conn:
    """One connection; `call` waits for the reply, `send` + `try_reply` drive it from a
    selector (the caller appends what it receives to `buf`)."""

    def __init__(self, port, nodelay=False):
        self.sock = socket.create_connection(("127.0.0.1", port))
        if nodelay:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, args):
        self.sock.sendall(encode(args))

    def try_reply(self):
        try:
            value, pos = parse(self.buf)
        except Incomplete:
            return Incomplete
        self.buf = self.buf[pos:]
        return value

    def read(self):
        while True:
            value = self.try_reply()
            if value is not Incomplete:
                return value
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError("connection closed")
            self.buf += data

    def call(self, *args):
        self.send(args)
        return self.read()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class RedisServer:
    """`with RedisServer(prefix, valgrind) as redis:` a redis-server without persistence in
    a fresh directory, answering PING on `redis.port` through `redis.conn`, with the
    Redis Function `libraries` loaded; stopped and its directory removed on exit. Under valgrind, `zero_counts()` and `instructions()`
    bracket what is measured."""

    def __init__(self, prefix, valgrind=False, nodelay=False, libraries=()):
        self.prefix, self.valgrind, self.nodelay = prefix, valgrind, nodelay
        self.libraries = libraries

    def __enter__(self):
        self.work = tempfile.mkdtemp(prefix=self.prefix)
        self.port = free_port()
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", self.work]
        if self.valgrind:
            out = os.path.join(self.work, "callgrind.out.%p")
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + cmd
        self.server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(600):
                try:
                    self.conn = Conn(self.port, self.nodelay)
                    self.conn.call("PING")
                    break
                except (OSError, RuntimeError):
                    time.sleep(0.1)
            else:
                raise RuntimeError("redis-server did not start")
            for library in self.libraries:
                self.conn.call("FUNCTION", "LOAD", "REPLACE", library)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_):
        self.server.terminate()
        self.server.wait()
        shutil.rmtree(self.work, ignore_errors=True)

    def zero_counts(self):
        subprocess.run(["callgrind_control", "-z", str(self.server.pid)], check=True,
                       stdout=subprocess.DEVNULL)

    def instructions(self):
        """Dump the counts; (instructions since `zero_counts`, path of the dump)."""
        subprocess.run(["callgrind_control", "-d", str(self.server.pid)], check=True,
                       stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        dumps = sorted(glob.glob(os.path.join(self.work, "callgrind.out.*")))
        dump = ([d for d in dumps if re.search(r"\.\d+\.\d+$", d)] or dumps)[-1]
        with open(dump) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1]), dump
        return 0, dump
