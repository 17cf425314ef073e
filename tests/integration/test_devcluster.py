"""`make cluster` (node/devcluster.py): three nodes on the ports it is given, their
ready lines shown, a node that exits reported once while the others go on, and
every node ended by pid when it is stopped."""
from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time

from jobs_helpers import pid_gone
from nodeproc import port_range, wait_until


def _consecutive_free(n: int) -> int:
    """A first port with ``n`` free ports from it, below the ephemeral range."""
    rng = random.SystemRandom()
    for _ in range(200):
        low, high = port_range()
        base = rng.randrange(low, high - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free run of ports")


def _alive(pid: int, data: str) -> bool:
    """Is ``pid`` still one of this test's nodes (a node.main whose arguments name
    its data directory, not a zombie)? Once gone, its pid may be another process's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not pid_gone(pid) and b"node.main" in args and any(data.encode() in a for a in args)


def test_make_cluster_runs_three_nodes_reports_an_exit_once_and_stops_them_all(tmp_path):
    http0 = _consecutive_free(6)
    grpc0 = http0 + 3
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_")} | {
        "SPOOLER_CLUSTER_HTTP_PORT": str(http0), "SPOOLER_CLUSTER_GRPC_PORT": str(grpc0),
        "SPOOLER_CLUSTER_DIR": str(tmp_path / "cluster"), "SPOOLER_ADMIN_KEY": "k-devcluster"}
    p = subprocess.Popen([sys.executable, "-m", "node.devcluster"], stdout=subprocess.PIPE, env=env,
                         stderr=subprocess.DEVNULL)
    lines: "queue.Queue[str]" = queue.Queue()
    seen: list = []
    threading.Thread(target=lambda: [lines.put(x.decode().rstrip()) for x in p.stdout], daemon=True).start()

    def drain():
        while True:
            try:
                seen.append(lines.get_nowait())
            except queue.Empty:
                return seen

    node_pids: list = []
    try:
        def ready():
            return [json.loads(x.split(": ", 1)[1]) for x in drain() if '"event": "ready"' in x]
        up = wait_until(lambda: len(ready()) == 3 and ready(), 30, what="three ready lines")
        assert sorted((r["id"], r["http"]) for r in up) == [
            (f"n{k + 1}", f"127.0.0.1:{http0 + k}") for k in range(3)]
        assert {r["grpc"] for r in up} == {f"127.0.0.1:{grpc0 + k}" for k in range(3)}
        assert any(f"SPOOLER_URL=http://127.0.0.1:{http0}" in x for x in seen)
        # the pids it prints are its three children, the nodes
        pids = dict(x.split("=") for x in next(x for x in seen if "; pids " in x).split("; pids ")[1].split(", "))
        node_pids = [int(x) for x in pids.values()]
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(p.pid)], capture_output=True, text=True)
        kids = {int(line.split()[0]): line for line in out.stdout.splitlines() if "node.main" in line}
        assert sorted(kids) == sorted(node_pids) and "--id n2" in kids[int(pids["n2"])], (pids, out.stdout)
        n2 = int(pids["n2"])
        env_cli = env | {"SPOOLER_URL": f"http://127.0.0.1:{http0}", "SPOOLER_KEY": "k-devcluster"}

        def status():
            r = subprocess.run([sys.executable, "-m", "spooler", "cluster", "status", "--json"], env=env_cli,
                               capture_output=True, text=True, timeout=30)
            return r.returncode == 0 and json.loads(r.stdout)
        wait_until(lambda: (status() or {}).get("primary"), 30, what="a primary")
        os.kill(n2, signal.SIGKILL)
        wait_until(lambda: any(x.startswith("n2 exited with") for x in drain()), 10, what="the exit reported")
        # it is said once, not on every turn of the devcluster's 0.2 s loop
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            drain()
            time.sleep(0.05)
        assert [x for x in seen if "exited" in x] == ["n2 exited with -9; the others keep running"], seen
        assert p.poll() is None  # still running with two nodes
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        for pid in node_pids:  # the devcluster ends its nodes; anything left is ended here
            if _alive(pid, str(tmp_path)):
                os.kill(pid, signal.SIGKILL)
    assert rc == 0
    assert not [pid for pid in node_pids if _alive(pid, str(tmp_path))]


def test_help_prints_what_it_does_and_starts_nothing(tmp_path):
    """`python -m node.devcluster --help` answers and starts no node (it takes no
    arguments; it used to ignore them and start three)."""
    env = {**os.environ, "SPOOLER_CLUSTER_DIR": str(tmp_path / "cluster"),
           "SPOOLER_CLUSTER_HTTP_PORT": "0", "SPOOLER_CLUSTER_GRPC_PORT": "0"}
    for arg, code in (("--help", 0), ("--bogus", 2)):
        p = subprocess.Popen([sys.executable, "-m", "node.devcluster", arg], stdout=subprocess.PIPE, env=env,
                             text=True)
        try:
            out, _ = p.communicate(timeout=30)
        finally:
            if p.poll() is None:  # it started nodes after all: SIGTERM ends them by their pids, then it exits
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=30)
        assert p.returncode == code, (arg, p.returncode, out)
        assert "make cluster" in out
        assert not (tmp_path / "cluster").exists()
