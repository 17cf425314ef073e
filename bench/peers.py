"""Run the peers' own benchmarks (NATS JetStream R3, RabbitMQ quorum queues R3) in this run.

The peers' scripts live beside the repository in ``shared/peers/<peer>/`` (README.md,
cluster.sh up/down, bench.py printing JSON); they are run from there, never copied.
Each cluster is brought up with its cluster.sh (in a private temp dir), its bench.py runs
``repeats`` times on that one cluster, and the cluster is always brought down again; any
process it recorded that is still alive afterwards is killed by pid.

A peer whose server binary or Python client is missing is skipped with the reason, unless
``SPOOLER_BENCH_INSTALL_PEERS=1``: then this tries ``apt-get install`` / ``pip install`` first.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO.parent / "shared" / "peers"
FIGURES = ("send_sequential_per_s", "send_sequential_p50_ms", "send_sequential_p99_ms",
           "send_64_in_flight_per_s", "receive_ack_per_s")

PEERS = {
    "nats-jetstream": {
        "dir": "jetstream", "apt": "nats-server", "pip": "nats-py", "module": "nats",
        "binaries": ["nats-server"], "dir_env": "JS_DIR",
        # client 4231..4251, routes 6231..6251 (cluster.sh)
        "ports": [4231, 4241, 4251, 6231, 6241, 6251],
        "up_timeout_s": 60,
        "describe": "3 nats-server processes, stream R3, file storage, work-queue retention; "
                    "acks a publish once a quorum holds it in memory, fsyncs on a timer (2 min default)",
    },
    "rabbitmq-quorum": {
        "dir": "rabbitmq", "apt": "rabbitmq-server", "pip": "aio-pika", "module": "aio_pika",
        "binaries": ["rabbitmq-server", "/usr/lib/rabbitmq/bin/rabbitmq-server", "epmd"], "dir_env": "RMQ_DIR",
        "ports": [5681, 5682, 5683, 25681, 25682, 25683, 4391],
        "up_timeout_s": 180,
        "describe": "3 RabbitMQ nodes, quorum queue with 3 replicas, persistent messages, publisher "
                    "confirms; a confirm means fdatasync on a quorum (per the peer's README)",
    },
}


def _have_binary(b: str) -> bool:
    return os.path.exists(b) if b.startswith("/") else shutil.which(b) is not None


def _have_module(m: str) -> bool:
    importlib.invalidate_caches()
    try:
        return importlib.util.find_spec(m) is not None
    except (ImportError, ValueError):
        return False


def _missing(spec) -> list:
    miss = [b for b in spec["binaries"] if not _have_binary(b)]
    if not _have_module(spec["module"]):
        miss.append(f"python module {spec['module']} ({spec['pip']})")
    return miss


def _install(spec, log) -> str:
    """Best effort; returns a note on what was tried."""
    notes = []
    if any(not _have_binary(b) for b in spec["binaries"]):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            notes.append("cannot apt-get install (not root or no apt-get)")
        else:
            log(f"peers: apt-get install {spec['apt']}")
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
            r = subprocess.run(["apt-get", "install", "-y", "-qq", spec["apt"]], env=env, capture_output=True,
                               text=True, timeout=600)
            notes.append(f"apt-get install {spec['apt']}: rc {r.returncode}")
    if not _have_module(spec["module"]):
        log(f"peers: pip install {spec['pip']}")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec["pip"]], capture_output=True,
                           text=True, timeout=300)
        notes.append(f"pip install {spec['pip']}: rc {r.returncode}")
    return "; ".join(notes)


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _recorded_pids(state_dir: Path) -> list:
    """Every pid cluster.sh wrote down: jetstream's ``pids`` (one per line), rabbitmq's
    ``pids`` ("name pid" lines) and each rabbitmq node's ``n*/beam.pid``."""
    pids = []
    files = [state_dir / "pids", *sorted(state_dir.glob("n*/beam.pid"))]
    for f in files:
        try:
            for tok in f.read_text().split():
                if tok.isdigit():
                    pids.append(int(tok))
        except OSError:
            pass
    return pids


def _become_subreaper() -> None:
    """Orphans of cluster.sh (its backgrounded servers) are re-parented to this process instead
    of pid 1, so that they can be reaped here (see _alive) and leave no zombies behind."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: BLE001 - not Linux or no libc: zombies are then pid 1's business
        pass


def _reap_adopted() -> None:
    """Reap exited orphans adopted as subreaper (e.g. the short-lived ``epmd -daemon`` forks of
    rabbitmqctl). Called only after cluster.sh down, when no subprocess of ours is running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _alive(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our (adopted) child and it has exited: reaped
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run(cmd, env, cwd, timeout_s) -> tuple:
    """Run in its own process group; on timeout kill that group (by its id) and report."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return None, out, (err or "") + f"\n[timed out after {timeout_s}s]"


def _parse_json(stdout: str):
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _check(name: str, log) -> tuple:
    """(spec, pdir, None) when the peer can run, else (spec, pdir, {"skipped": ...})."""
    spec = PEERS[name]
    pdir = PEERS_DIR / spec["dir"]
    if not (pdir / "cluster.sh").exists() or not (pdir / "bench.py").exists():
        return spec, pdir, {"skipped": f"peer scripts not found at ../shared/peers/{spec['dir']} (relative to the repo)"}
    miss = _missing(spec)
    if miss:
        if os.environ.get("SPOOLER_BENCH_INSTALL_PEERS") != "1":
            return spec, pdir, {"skipped": "missing: " + ", ".join(miss) +
                                " (set SPOOLER_BENCH_INSTALL_PEERS=1 to install, or install by hand)"}
        note = _install(spec, log)
        miss = _missing(spec)
        if miss:
            return spec, pdir, {"skipped": "still missing after install attempt: " + ", ".join(miss), "install": note}
    busy = [p for p in spec["ports"] if _port_busy(p)]
    if busy:
        return spec, pdir, {"skipped": f"ports already in use on 127.0.0.1: {busy} (another {name} cluster running?)"}
    return spec, pdir, None


class _PeerCluster:
    """``cluster.sh up`` in a private temp dir; on exit ``cluster.sh down``, then SIGKILL by pid
    whatever it recorded that is still alive, reap, remove the dir. Exit records into ``out``."""

    def __init__(self, name: str, spec: dict, pdir: Path, out: dict, log):
        self.name, self.spec, self.pdir, self.out, self.log = name, spec, pdir, out, log
        self.state_dir = Path(tempfile.mkdtemp(prefix=f"bench-{spec['dir']}-peer-"))
        self.env = {**os.environ, spec["dir_env"]: str(self.state_dir)}
        self.cmd = ["bash", str(pdir / "cluster.sh")]
        self.pids: list = []
        self.up_ok = False

    def __enter__(self):
        _become_subreaper()
        t0 = time.perf_counter()
        self.log(f"peers: {self.name}: cluster.sh up")
        rc, so, se = _run([*self.cmd, "up"], self.env, self.pdir, self.spec["up_timeout_s"])
        self.pids = _recorded_pids(self.state_dir)
        if rc != 0:
            self.out["error"] = f"cluster.sh up failed (rc {rc}): {(se or so).strip()[-800:]}"
        else:
            self.up_ok = True
            self.out["cluster_up_s"] = round(time.perf_counter() - t0, 1)
        return self

    def __exit__(self, *exc):
        out = self.out
        pids = sorted(set(self.pids + _recorded_pids(self.state_dir)))
        try:
            _run([*self.cmd, "down"], self.env, self.pdir, 90)
        except Exception as e:  # noqa: BLE001
            out["down_error"] = f"{type(e).__name__}: {e}"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2 if left else 0)
        for p in pids:
            _alive(p)  # reap what was adopted
        _reap_adopted()
        if left:
            out["killed_after_down"] = left
        shutil.rmtree(self.state_dir, ignore_errors=True)
        return False


def run_peer(name: str, n: int = 5000, repeats: int = 3, log=print) -> dict:
    spec, pdir, skip = _check(name, log)
    if skip:
        return skip
    out = {"system": name, "nodes": 3, "replicas": 3, "setup": spec["describe"], "runs": []}
    try:
        with _PeerCluster(name, spec, pdir, out, log) as pc:
            for r in range(1, repeats + 1 if pc.up_ok else 1):
                rc, so, se = _run([sys.executable, str(pdir / "bench.py"), str(n)], pc.env, pdir, 180)
                res = _parse_json(so) if rc == 0 else None
                if res is None:
                    out["runs"].append({"error": f"bench.py rc {rc}: {(se or so).strip()[-800:]}"})
                    log(f"peers: {name} run {r}/{repeats} failed: rc {rc}")
                    continue
                notes = [l for l in (se or "").splitlines() if l.strip()][-2:]
                if notes:
                    res["stderr"] = notes
                out["runs"].append(res)
                log(f"peers: {name} run {r}/{repeats}: " +
                    json.dumps({k: res.get(k) for k in FIGURES}))
            if pc.up_ok:  # the cluster's footprint after the workload, as bench.spool and bench.cluster read ours
                from bench.memory import proc_memory
                out["memory"] = proc_memory(sorted(set(pc.pids + _recorded_pids(pc.state_dir))))
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    good = [x for x in out["runs"] if "error" not in x]
    out["samples"] = {f: [x[f] for x in good if f in x] for f in FIGURES}
    out["median"] = {f: (round(statistics.median(v), 3) if f.endswith("_ms") else round(statistics.median(v)))
                     for f, v in out["samples"].items() if v}
    if not good and "error" not in out:
        out["error"] = "no successful bench.py run"
    return out


_FAILOVER_RE = re.compile(r"failover:.*?(\d+(?:\.\d+)?)s after SIGKILL")


def run_failover(name: str, repeats: int = 1, log=print) -> dict:
    """The peer's own failover.py (seconds from SIGKILL of the leader to the next acked/confirmed
    publish), each time on a fresh cluster (cluster.sh up, failover.py, cluster.sh down)."""
    spec, pdir, skip = _check(name, log)
    if skip:
        return skip
    if not (pdir / "failover.py").exists():
        return {"skipped": f"no failover.py in ../shared/peers/{spec['dir']}"}
    out = {"system": name, "script": f"../shared/peers/{spec['dir']}/failover.py", "runs": []}
    for r in range(1, repeats + 1):
        run = {}
        try:
            with _PeerCluster(name, spec, pdir, run, log) as pc:
                if pc.up_ok:
                    rc, so, se = _run([sys.executable, str(pdir / "failover.py")], pc.env, pdir, 150)
                    lines = [l for l in (so or "").splitlines() if l.strip()]
                    run["stdout"] = lines[-4:]
                    m = next((_FAILOVER_RE.search(l) for l in lines if _FAILOVER_RE.search(l)), None)
                    if m:
                        run["seconds"] = float(m.group(1))
                    else:
                        run["error"] = f"failover.py rc {rc}: no seconds in its output: {(se or so).strip()[-600:]}"
        except Exception as e:  # noqa: BLE001
            run["error"] = f"{type(e).__name__}: {e}"
        out["runs"].append(run)
        log(f"peers: {name} failover {r}/{repeats}: " + (f"{run['seconds']} s" if "seconds" in run
                                                          else run.get("error", "?")))
    secs = [x["seconds"] for x in out["runs"] if "seconds" in x]
    out["samples_s"] = secs
    if secs:
        out["median_s"] = round(statistics.median(secs), 3)
    else:
        out["error"] = "no failover.py run gave a figure"
    return out


def run(n: int = 5000, repeats: int = 3, log=print, only=None) -> dict:
    return {name: run_peer(name, n=n, repeats=repeats, log=log) for name in PEERS if not only or name in only}


if __name__ == "__main__":
    print(json.dumps(run(only=sys.argv[1:] or None), indent=2))
