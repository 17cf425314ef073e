"""Spooler as a 3-node cluster on 127.0.0.1: the peers' workload, and failover time.

Three real ``spooler-node`` processes (tests/nodeproc.py) with ``--peers`` naming all three and
``--failover-timeout T`` (default 2 s). A send is answered only after fsync on a quorum (2 of 3)
of nodes; every node fsyncs every record it stores.

* ``run_workload``: one fresh cluster; the asyncio SDK talks to the primary directly and runs
  bench/spool.py's workload (sequential, 64 in flight, batch of 100, batch of 100 x4 in flight,
  receive + ack; 256-byte messages) ``repeats`` times. ``extra.where_time_goes`` records per
  phase the primary's and each replica's CPU seconds and group commits (from each node's
  ``/metrics``: ``spooler_commit_seconds`` sum/count, ``spooler_commit_batch_records``).
* ``run_failover(kind)``: ``repeats`` times, each on a fresh cluster. A client sends 256-byte
  messages over HTTP, sequentially, to a replica (which forwards to the primary) until 20 got
  201; then the primary is sent SIGKILL (or SIGSTOP) by pid between two sends, and the client
  keeps sending to the live nodes (rotating to the next one on any error, 10 ms between
  attempts, each attempt timing out after 0.5 s as in the peers' failover.py) until the next
  201. The figure is the time from the signal to that 201. A side thread polls the survivors'
  ``GET /v1/cluster`` every 10 ms to note when one of them reported itself primary of a newer
  epoch. In ``finally`` every stopped node gets SIGCONT and every node SIGKILL, by pid.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time

from bench import spool
from bench.spool import FIGURES, NodeProc, _commit_metrics, _node_cpu_s, _round
from nodeproc import free_ports  # noqa: E402 (bench.spool put tests/ on sys.path)

IDS = ("n1", "n2", "n3")
WARM_SENDS = 20
ATTEMPT_TIMEOUT_S = 0.5
RETRY_SLEEP_S = 0.01
FAILOVER_DEADLINE_S = 30.0


class Cluster:
    """Three nodes in a temp dir; ``close()`` sends SIGCONT to any stopped node, SIGKILLs every
    node by pid and removes the data."""

    def __init__(self, failover_timeout_s: float):
        self.dir = tempfile.mkdtemp(prefix="spooler-bench-cluster-")
        ports = dict(zip(IDS, free_ports(len(IDS))))
        peers = ",".join(f"{i}=127.0.0.1:{p}" for i, p in ports.items())
        self.nodes = {i: NodeProc(os.path.join(self.dir, i), node_id=i, grpc_port=ports[i],
                                  extra_args=["--peers", peers, "--failover-timeout", str(failover_timeout_s)])
                      for i in IDS}
        self.stopped: set = set()

    def start(self, timeout_s: float = 20.0) -> "Cluster":
        errs = []

        def start(n):
            try:
                n.start(timeout_s)
            except Exception as e:  # noqa: BLE001
                errs.append(f"{n.node_id}: {e}")
        threads = [threading.Thread(target=start, args=(n,)) for n in self.nodes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errs:
            raise RuntimeError("a node did not start: " + "; ".join(errs)[-1500:])
        return self

    @staticmethod
    def view(n, timeout_s: float = 2.0):
        import json
        import urllib.request
        try:
            req = urllib.request.Request(n.http_url + "/v1/cluster",
                                         headers={"Authorization": f"Bearer {n.admin_key}"})
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except Exception:  # noqa: BLE001
            return None

    def primary(self, exclude=()):
        for i, n in self.nodes.items():
            if i in exclude or i in self.stopped or not n.alive():
                continue
            v = self.view(n)
            if v and v.get("role") == "primary":
                return i, v.get("epoch")
        return None

    def wait_primary(self, timeout_s: float = 20.0, exclude=()):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = self.primary(exclude)
            if p:
                return p
            time.sleep(0.02)
        raise RuntimeError(f"no primary within {timeout_s}s")

    def close(self) -> None:
        for i, n in self.nodes.items():
            try:
                if i in self.stopped and n.alive():
                    os.kill(n.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for n in self.nodes.values():
            try:
                n.kill()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tails(self) -> dict:
        return {i: n.read_log()[-1200:] for i, n in self.nodes.items()}


# ----------------------------------------------------------------------------- workload

def _until_201(node, queue: str = "bench-ready", timeout_s: float = 20.0) -> float:
    """A freshly elected primary answers 503 until its quorum is in place: create a queue and
    send to it until the first 201. Returns the seconds that took."""
    from spooler.http import HttpClient
    c = HttpClient(node.http_url, node.admin_key, timeout_s=5)
    t0 = time.perf_counter()
    made = False
    while True:
        try:
            if not made:
                c.put_queue(queue)
                made = True
            c.send(queue, spool.BODY)
            return round(time.perf_counter() - t0, 3)
        except Exception:  # noqa: BLE001
            if time.perf_counter() - t0 > timeout_s:
                raise
            time.sleep(0.02)


class _ClusterProbe:
    """spool._Probe for three nodes: the SDK client's CPU, and per node its CPU and group
    commits (count, mean write + fsync time, records per commit) over one phase."""

    def __init__(self, cluster: Cluster, primary_id: str):
        self.cluster, self.primary_id = cluster, primary_id

    def __call__(self, _node):
        return self

    async def __aenter__(self):
        ns = self.cluster.nodes
        self.m0 = {i: await asyncio.to_thread(_commit_metrics, n.http_url, n.admin_key) for i, n in ns.items()}
        self.ncpu0 = {i: _node_cpu_s(n.pid) for i, n in ns.items()}
        self.cpu0, self.t0 = time.process_time(), time.perf_counter()
        return self

    async def __aexit__(self, *exc):
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - self.cpu0
        ns = self.cluster.nodes
        per = {}
        for i, n in ns.items():
            ncpu = _node_cpu_s(n.pid) - self.ncpu0[i]
            m1 = await asyncio.to_thread(_commit_metrics, n.http_url, n.admin_key)
            d = {k: m1.get(k, 0) - self.m0[i].get(k, 0) for k in m1}
            c = d.get("spooler_commit_seconds_count", 0)
            per[i] = {"role": "primary" if i == self.primary_id else "replica", "node_cpu_s": round(ncpu, 3),
                      "group_commits": int(c),
                      "commit_ms_mean": round(d["spooler_commit_seconds_sum"] / c * 1e3, 3) if c else None,
                      "records_per_commit": round(d["spooler_commit_batch_records_sum"] / c, 1) if c else None,
                      "commit_share_of_wall": round(d.get("spooler_commit_seconds_sum", 0) / wall, 2) if wall else None}
        self.result = {"wall_s": round(wall, 3), "client_cpu_s": round(cpu, 3), "nodes": per}
        return False


def run_workload(n: int = 5000, n_seq: int = 1000, n_batches: int = 200, repeats: int = 3,
                 failover_timeout_s: float = 2.0, log=print) -> dict:
    out = {"system": "spooler", "nodes": 3, "replicas": 3, "confirm": "fsync on a quorum (2 of 3)",
           "fsync": True, "message_bytes": len(spool.BODY), "failover_timeout_s": failover_timeout_s,
           "client": "asyncio SDK (gRPC) to the primary",
           "params": {"n_64_in_flight": n, "n_receive_ack": n, "n_sequential": n_seq,
                      "batches_of_100": n_batches, "repeats": repeats}}
    samples = {f: [] for f in FIGURES}
    extra = {"send_rpcs_64_in_flight": [], "ack_errors": [], "where_time_goes": {}}
    out["extra"] = extra
    cl = Cluster(failover_timeout_s)
    try:
        t0 = time.perf_counter()
        cl.start()
        p, epoch = cl.wait_primary()
        out["cluster_up_s"] = round(time.perf_counter() - t0, 2)
        out["primary_at_start"] = {"node": p, "epoch": epoch}
        out["ready_s"] = _until_201(cl.nodes[p])
        log(f"cluster: 3 nodes up in {out['cluster_up_s']} s, primary {p} epoch {epoch}, "
            f"first 201 {out['ready_s']} s later")
        asyncio.run(spool._workload(cl.nodes[p], n, n_seq, n_batches, repeats, log, samples, extra,
                                    probe=_ClusterProbe(cl, p), label="spooler 3-node"))
        out["other_client"] = spool._other_client(cl.nodes[p].grpc_target, cl.nodes[p].admin_key, n_seq,
                                                  n_batches, repeats, log)
        out["primary_at_end"] = dict(zip(("node", "epoch"), cl.primary() or (None, None)))
        if out["primary_at_end"] != out["primary_at_start"]:
            out["warning"] = "the primary changed during the workload"
    except BaseException as e:  # noqa: BLE001 - report, and still stop the nodes
        out["error"] = f"{type(e).__name__}: {e}"
        out["node_log_tails"] = cl.log_tails()
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        from bench.memory import proc_memory
        out["memory"] = proc_memory([n.pid for n in cl.nodes.values() if n.proc is not None])
        cl.close()
    out["median"] = {k: _round(k, statistics.median(v)) for k, v in samples.items() if v}
    out["samples"] = samples
    return out


# ----------------------------------------------------------------------------- failover

def _failover_once(kind: str, failover_timeout_s: float, log) -> dict:
    from spooler.http import HttpClient

    sig = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}[kind]
    cl = Cluster(failover_timeout_s)
    res = {}
    try:
        cl.start()
        p, epoch = cl.wait_primary()
        res.update(old_primary=p, old_epoch=epoch)
        others = [i for i in IDS if i != p]
        clients = {i: HttpClient(cl.nodes[i].http_url, cl.nodes[i].admin_key, timeout_s=ATTEMPT_TIMEOUT_S)
                   for i in IDS}
        setup = HttpClient(cl.nodes[p].http_url, cl.nodes[p].admin_key, timeout_s=10)
        deadline = time.monotonic() + 15
        while True:
            try:
                setup.put_queue("fo")
                break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        # steady state: sequential sends through a replica (forwarded to the primary)
        ok, deadline = 0, time.monotonic() + 15
        while ok < WARM_SENDS:
            try:
                clients[others[0]].send("fo", spool.BODY)
                ok += 1
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
                time.sleep(RETRY_SLEEP_S)

        seen = {}
        stop_watch = threading.Event()

        def watch():  # when does a survivor first call itself primary of a newer epoch?
            while not stop_watch.is_set():
                for i in others:
                    v = Cluster.view(cl.nodes[i], timeout_s=0.3)
                    if v and v.get("role") == "primary" and (v.get("epoch") or 0) > (epoch or 0):
                        seen.setdefault("t", time.perf_counter())
                        seen.setdefault("node", i)
                        seen.setdefault("epoch", v.get("epoch"))
                if "t" in seen:
                    return
                time.sleep(0.01)

        victim = cl.nodes[p]
        w = threading.Thread(target=watch, daemon=True)
        t0 = time.perf_counter()
        os.kill(victim.pid, sig)
        if kind == "sigstop":
            cl.stopped.add(p)
        w.start()
        attempts, errs, k, t_ok = 0, {}, 0, None
        while time.perf_counter() - t0 < FAILOVER_DEADLINE_S:
            target = others[k % len(others)]
            attempts += 1
            try:
                clients[target].send("fo", spool.BODY)
                t_ok = time.perf_counter()
                res["answered_by"] = target
                break
            except Exception as e:  # noqa: BLE001
                name = type(e).__name__
                errs[name] = errs.get(name, 0) + 1
                k += 1
                time.sleep(RETRY_SLEEP_S)
        stop_watch.set()
        w.join(timeout=2)
        if t_ok is None:
            res["error"] = f"no 201 within {FAILOVER_DEADLINE_S}s"
        else:
            res["seconds"] = round(t_ok - t0, 3)
        res.update(attempts=attempts, errors=errs)
        if t_ok is None or (kind == "sigkill" and t_ok - t0 > 0.5) or (
                kind == "sigstop" and t_ok - t0 > failover_timeout_s + 0.5):
            res["survivor_log_tails"] = {i: cl.nodes[i].read_log()[-1500:] for i in others}
        if "t" in seen:
            res.update(new_primary=seen["node"], new_epoch=seen["epoch"],
                       new_primary_seen_s=round(seen["t"] - t0, 3))
    except BaseException as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["node_log_tails"] = cl.log_tails()
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        cl.close()
    return res


def run_failover(kind: str, repeats: int = 3, failover_timeout_s: float = 2.0, log=print) -> dict:
    """kind: "sigkill" or "sigstop"; each repeat on a fresh 3-node cluster."""
    runs = []
    for r in range(1, repeats + 1):
        res = _failover_once(kind, failover_timeout_s, log)
        runs.append(res)
        log(f"cluster failover {kind} {r}/{repeats}: " +
            (f"{res['seconds']} s to the next 201 (new primary seen at {res.get('new_primary_seen_s')} s, "
             f"{res['attempts']} attempts, errors {res['errors']})" if "seconds" in res else res.get("error", "?")))
    secs = [x["seconds"] for x in runs if "seconds" in x]
    out = {"signal": kind.upper(), "failover_timeout_s": failover_timeout_s, "samples_s": secs, "runs": runs,
           "method": (f"HTTP client sending sequentially through a replica; {kind.upper()} of the primary by pid "
                      f"between two sends; then sends to the live nodes, rotating on error, {RETRY_SLEEP_S * 1e3:g} ms "
                      f"between attempts, {ATTEMPT_TIMEOUT_S} s per attempt; time from the signal to the next 201; "
                      "each run on a fresh cluster")}
    if secs:
        out["median_s"] = round(statistics.median(secs), 3)
    if len(secs) < repeats:
        out["error"] = f"{repeats - len(secs)} of {repeats} runs gave no figure"
    return out


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps({"sigkill": run_failover("sigkill", 1, log=lambda m: print(m, file=sys.stderr))}, indent=2))
