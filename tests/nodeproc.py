"""Start and stop real spooler-node processes for tests and drills.

Every process is ended by its pid (SIGKILL as a last resort), also when the
test fails; waits poll with a deadline and dump the node's log on timeout.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Optional

ADMIN_KEY = "test-admin-key"

# Whether the test now running may start a node: tests/conftest.py sets it before
# each test's setup (True when the test carries pytest's ``integration`` marker),
# so a node started by a test outside that tier fails the test instead of
# slipping into ``-m 'not integration'``. None outside pytest (the benchmark, the
# drills' runner): no check.
may_start_nodes: Optional[bool] = None


class UnmarkedNodeStart(AssertionError):
    """A test without the ``integration`` marker started a node."""


class NodeProc:
    DEFAULT_ENTRY = ("-m", "node.main")  # this checkout's build

    def __init__(self, data_dir: str, node_id: str = "n1", admin_key: str = ADMIN_KEY, extra_args=(),
                 http_port: int = 0, grpc_port: int = 0, env: Optional[dict] = None, env_only: bool = False,
                 entry: Optional[list] = None):
        """``env_only``: start ``spooler-node`` with no flags at all; ``env`` carries
        every setting (SPOOLER_ID, SPOOLER_DATA, ...), as a container's manifest
        does, and the test's own SPOOLER_* variables are not passed on.
        ``entry``: the interpreter's arguments before the node's flags (by
        default ``-m node.main``; ``-c CODE`` runs a node with a fault put in)."""
        self.entry = list(entry or self.DEFAULT_ENTRY)
        self.env_only = env_only
        self.data_dir = data_dir
        self.node_id = node_id
        self.admin_key = admin_key
        self.extra_args = list(extra_args)
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(data_dir, f"{node_id}.log")
        self.http_url = ""
        self.grpc_target = ""
        self.epoch = 0

    def start(self, timeout_s: float = 20.0) -> "NodeProc":
        if may_start_nodes is False:
            raise UnmarkedNodeStart("this test starts a spooler-node: mark it integration "
                                    "(every test under tests/integration/ is)")
        os.makedirs(self.data_dir, exist_ok=True)
        cmd = [sys.executable, *self.entry]
        # every /metrics read answered afresh: a render that took long is otherwise
        # answered again for ten times its length, and under load a read right after
        # a call showed the figures of before it (a before/after count then failed)
        fresh = {"SPOOLER_TEST_METRICS_REUSE_FROM_S": "inf"}
        env = {**os.environ, **fresh, **(self.env or {})}
        if self.env_only:
            env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_")} | fresh | (self.env or {})
        else:
            if not self.http_port or not self.grpc_port:
                # ports drawn below the range for outgoing connections (free_ports), not
                # the kernel's pick: a node started again on its port (restart) found one
                # from that range taken meanwhile by some connection (seen under two test
                # workers and a drill: "cannot listen for gRPC ...: Address already in use")
                http, grpc_port = free_ports(2)
                self.http_port, self.grpc_port = self.http_port or http, self.grpc_port or grpc_port
            cmd += ["--id", self.node_id, "--data", self.data_dir, "--http", f"127.0.0.1:{self.http_port}",
                    "--grpc", f"127.0.0.1:{self.grpc_port}", "--admin-key", self.admin_key, *self.extra_args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env)
        # the ready line, read with the deadline (a blocking readline would wait for
        # ever on a node that hangs before it prints anything): the raw descriptor,
        # with select; nothing else reads this pipe
        deadline = time.monotonic() + timeout_s
        fd, buf = self.proc.stdout.fileno(), b""
        while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # it exited
            buf += chunk
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict) and ev.get("event") == "ready":
                    self.http_url = "http://" + ev["http"]
                    self.grpc_target = ev["grpc"]
                    self.http_port = int(ev["http"].rpartition(":")[2])
                    self.grpc_port = int(ev["grpc"].rpartition(":")[2])
                    self.epoch = ev["epoch"]
                    return self
        self.kill()
        raise RuntimeError(f"node {self.node_id} did not become ready; log:\n{self.read_log()}")

    def read_log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-5000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL by pid and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._close()

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, then SIGKILL if it does not exit."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._close()
        return self.proc.returncode

    def _close(self):
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None

    def restart(self) -> "NodeProc":
        self.kill()
        return self.start()

    def metric(self, name: str) -> float:
        """One unlabelled sample of the node's /metrics."""
        with urllib.request.urlopen(self.http_url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def samples(self, *names: str) -> list:
        """Every sample of the node's /metrics whose name is among ``names``, as
        prometheus_client parses them (name, labels, value)."""
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(self.http_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in names]

    def get(self, path: str, key: Optional[str] = None):
        req = urllib.request.Request(self.http_url + path, headers={"Authorization": f"Bearer {key or self.admin_key}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")


def sh_then(script: str, argv) -> list:
    """``argv`` run by ``sh`` after ``script`` (e.g. ``exec 0<&-`` to start it with
    stdin closed, ``ulimit -n 200``), instead of ``preexec_fn``. A ``preexec_fn``
    makes subprocess fork rather than vfork, and in a test process that has grpc
    loaded, gRPC's fork handlers start a poller in the child whose descriptor
    subprocess then closes before the exec: the child dies of SIGABRT, now and then
    ("epoll_wait error: Bad file descriptor")."""
    return ["sh", "-c", script + '; exec "$@"', "sh", *argv]


def wait_until(pred, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"):
    """Poll ``pred`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def reaches(read, expected, timeout_s: float = 10.0, what: str = "a figure"):
    """Poll ``read()`` until it returns ``expected``; fail with the last value read.
    For figures that settle a moment after the call that moves them (a /metrics
    counter counted when a commit applies, a gauge a timer updates). (The test
    nodes never reuse a /metrics render: SPOOLER_TEST_METRICS_REUSE_FROM_S.)"""
    seen = []
    try:
        wait_until(lambda: seen.append(read()) or seen[-1] == expected, timeout_s, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}: last read {seen[-1] if seen else None!r}, expected {expected!r}") from None


async def until(pred, timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"):
    """``wait_until`` for a test's event loop: poll ``pred`` without blocking the loop."""
    import asyncio
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple:
    """[low, high) of the ports this process draws explicit ports from: below the
    kernel's ephemeral range, and under pytest-xdist a share of it of its own per
    worker (PYTEST_XDIST_WORKER gw0, gw1, ... of PYTEST_XDIST_WORKER_COUNT), so
    that two workers never pick the same port at the same moment, nor one a
    port another uses as an address where nothing listens."""
    low, high = 10000, _ephemeral_low()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        # (a worker xdist starts again in a crashed one's place gets the next id,
        # gw2 of two: its share is gw0's)
        k = int(count)
        i = int(worker[2:]) % k
        span = (high - low) // k
        low, high = low + i * span, low + (i + 1) * span
    return low, high


_HANDED_OUT: set = set()  # ports free_ports gave this process (see there)


def free_ports(n: int, lowest: int = 0, highest: int = 0) -> list:
    """n distinct free TCP ports on 127.0.0.1, for nodes that must know each other's
    ports before any of them starts.

    They are drawn at random from below the kernel's ephemeral range (port_range)
    and checked with a bind, so no connect() or bind to port 0 elsewhere on the
    machine can take one between this choice and the node's own bind (a port from
    bind(0) could be: that race once cost a drill seed its start). Only a process
    that picks an explicit port in the same range at the same moment still could.

    A port handed out is not handed out again by this process for a while
    (_HANDED_OUT): a port drawn for a node that has not bound it yet passes the
    bind check, and a second draw took it (a node's HTTP port drawn equal to the
    gRPC port start_cluster had drawn for it: "the same address as --grpc")."""
    import random
    import socket
    rng = random.SystemRandom()
    low, high = port_range()
    lowest, high = lowest or low, highest or high
    inside = {p for p in _HANDED_OUT if lowest <= p < high}
    if len(inside) > (high - lowest) // 2:
        _HANDED_OUT.difference_update(inside)  # (a long run: the oldest draws are long bound or gone)
    ports: list = []
    for _ in range(1000 if high - lowest >= n else 0):
        if len(ports) == n:
            _HANDED_OUT.update(ports)
            return ports
        p = rng.randrange(lowest, high)
        if p in ports or p in _HANDED_OUT:
            continue
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            continue  # someone has it (or it is in TIME_WAIT): draw again
        finally:
            s.close()
        ports.append(p)
    if len(ports) == n:
        _HANDED_OUT.update(ports)
        return ports
    socks = [socket.socket() for _ in range(n)]  # no room below the range: the kernel's picks
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_cluster(base_dir: str, n: int = 3, failover_timeout_s: float = 1.0, extra_args=(), env=None,
                  per_node_args=None, per_node_env=None, entry=None) -> dict:
    """Start n nodes n1..nN with one --peers list, in parallel; returns {id: NodeProc}.
    per_node_args(id) -> extra arguments for that node; per_node_env(id) -> more
    environment for it; entry: how every node is run (NodeProc's, e.g. an older
    build: tests/drills/builds.py). The caller kills them."""
    import threading
    ids = [f"n{i + 1}" for i in range(n)]
    ports = dict(zip(ids, free_ports(n)))
    peers = ",".join(f"{i}=127.0.0.1:{p}" for i, p in ports.items())
    nodes = {i: NodeProc(os.path.join(base_dir, i), node_id=i, grpc_port=ports[i],
                         env={**(env or {}), **per_node_env(i)} if per_node_env else env,
                         extra_args=["--peers", peers, "--failover-timeout", str(failover_timeout_s), *extra_args,
                                     *(per_node_args(i) if per_node_args else ())], entry=entry) for i in ids}
    errors_ = []

    def start(node):
        try:
            node.start()
        except Exception as e:  # reported below, after every start returned
            errors_.append(e)

    threads = [threading.Thread(target=start, args=(x,)) for x in nodes.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors_:
        for x in nodes.values():
            x.kill()
        raise errors_[0]
    return nodes
