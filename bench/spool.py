"""Spooler's single-node workload: one real spooler-node, the asyncio SDK, 256-byte messages.

Figures (each measured ``repeats`` times, each time in a fresh queue on the same node):

* ``send_sequential_*``: ``n_seq`` sends one after another, each awaited before the next
  (``AsyncClient.send``; a lone send goes out at once as a one-message send batch on the
  client's Session stream).
  Messages per second, and p50/p99 of the per-send latency in ms.
* ``send_64_in_flight_per_s``: ``n`` sends with at most 64 awaiting their answer, through the
  SDK's auto-batching (concurrent sends coalesce into send batches, all on one Session stream).
* ``send_batch_100_per_s``: ``n_batches`` calls of ``send_batch`` with 100 bodies each, one
  request at a time (one request = one log record in the compact form).
* ``send_batch_100_4_in_flight_per_s``: the same, with up to 4 ``send_batch`` calls awaiting
  their answer at once (extra figure: lets the node's group commit share one fsync between
  batches; the target is judged on ``send_batch_100_per_s``).
* ``receive_ack_per_s``: a queue holding ``n`` messages (filled untimed) is drained by
  ``receive(max_messages=100)`` followed by one ``settle_batch`` acking those messages, one
  round trip at a time, until all ``n`` are acked.
* ``receive_ack_pipelined_per_s``: the same, except that the next receive goes out while
  the previous batch's acks are on their way (at most one ``settle_batch`` unanswered; the
  clock stops when the last one is answered). Extra figure: the shape of the peers'
  consumers, whose acks are sent without waiting for an answer; the target is judged on
  ``receive_ack_per_s``.

Every answer to a send or an ack means the record is fsync'd (the node's store commits with
synchronous=FULL); there is no switch to turn that off.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from nodeproc import NodeProc  # noqa: E402  (tests/nodeproc.py)

BODY = b"x" * 256
FIGURES = ("send_sequential_per_s", "send_sequential_p50_ms", "send_sequential_p99_ms",
           "send_64_in_flight_per_s", "send_batch_100_per_s", "send_batch_100_4_in_flight_per_s",
           "receive_ack_per_s", "receive_ack_pipelined_per_s")
PHASE_TIMEOUT_S = 120.0


def _round(fig, v):
    return round(v, 3) if fig.endswith("_ms") else round(v)


def _pct(sorted_xs, q):
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


async def _sequential(c, q, n):
    await c.send(q, BODY)  # warm the path (not counted)
    lat = []
    t = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter()
        await c.send(q, BODY)
        lat.append(time.perf_counter() - s)
    dt = time.perf_counter() - t
    lat.sort()
    # p50 as the median and p99 as sorted[int(0.99 n)], the way the peers' bench.py compute them
    return {"send_sequential_per_s": round(n / dt),
            "send_sequential_p50_ms": round(statistics.median(lat) * 1e3, 3),
            "send_sequential_p99_ms": round(_pct(lat, 0.99) * 1e3, 3)}


async def _in_flight(c, q, n, depth=64):
    sem = asyncio.Semaphore(depth)

    async def one():
        async with sem:
            await c.send(q, BODY)

    rpcs0 = c.send_rpcs
    t = time.perf_counter()
    await asyncio.gather(*[one() for _ in range(n)])
    dt = time.perf_counter() - t
    return {"send_64_in_flight_per_s": round(n / dt)}, {"send_rpcs": c.send_rpcs - rpcs0}


async def _batched(c, q, n_batches, size=100, depth=1):
    bodies = [BODY] * size
    sem = asyncio.Semaphore(depth)

    async def one():
        async with sem:
            await c.send_batch(q, bodies)

    t = time.perf_counter()
    if depth == 1:
        for _ in range(n_batches):
            await c.send_batch(q, bodies)
    else:
        await asyncio.gather(*[one() for _ in range(n_batches)])
    dt = time.perf_counter() - t
    key = "send_batch_100_per_s" if depth == 1 else f"send_batch_100_{depth}_in_flight_per_s"
    return {key: round(n_batches * size / dt)}


async def _receive_ack(c, q, n, pipelined=False):
    for i in range(0, n, 1000):  # fill, untimed
        await c.send_batch(q, [BODY] * min(1000, n - i))
    got = errors = 0
    acks = None  # pipelined: the settle_batch still on its way
    t = time.perf_counter()
    while got < n:
        msgs = await c.receive(q, wait_s=1, max_messages=100)
        if not msgs:
            continue
        if acks is not None:
            errors += sum(1 for r in await acks if isinstance(r, Exception))
        acks = asyncio.ensure_future(c.settle_batch([(m.token, "ack", 0) for m in msgs]))
        if not pipelined:
            errors += sum(1 for r in await acks if isinstance(r, Exception))
            acks = None
        got += len(msgs)
    if acks is not None:
        errors += sum(1 for r in await acks if isinstance(r, Exception))
    dt = time.perf_counter() - t
    key = "receive_ack_pipelined_per_s" if pipelined else "receive_ack_per_s"
    return {key: round(got / dt)}, {"ack_errors": errors}


def _node_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _commit_metrics(http_url: str, key: str) -> dict:
    import urllib.request
    req = urllib.request.Request(http_url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("spooler_commit_seconds_sum", "spooler_commit_seconds_count",
                     "spooler_commit_batch_records_sum"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


class _Probe:
    """Where the time goes in one phase: wall, client CPU, node CPU, group commits (count, mean
    duration of write + fsync, records per commit) from the node's /metrics."""

    def __init__(self, node):
        self.node = node

    async def __aenter__(self):
        self.m0 = await asyncio.to_thread(_commit_metrics, self.node.http_url, self.node.admin_key)
        self.cpu0, self.ncpu0, self.t0 = time.process_time(), _node_cpu_s(self.node.pid), time.perf_counter()
        return self

    async def __aexit__(self, *exc):
        wall = time.perf_counter() - self.t0
        cpu, ncpu = time.process_time() - self.cpu0, _node_cpu_s(self.node.pid) - self.ncpu0
        m1 = await asyncio.to_thread(_commit_metrics, self.node.http_url, self.node.admin_key)
        d = {k: m1.get(k, 0) - self.m0.get(k, 0) for k in m1}
        commits = d.get("spooler_commit_seconds_count", 0)
        self.result = {"wall_s": round(wall, 3), "client_cpu_s": round(cpu, 3), "node_cpu_s": round(ncpu, 3),
                       "group_commits": int(commits),
                       "commit_ms_mean": round(d["spooler_commit_seconds_sum"] / commits * 1e3, 3) if commits else None,
                       "records_per_commit": round(d["spooler_commit_batch_records_sum"] / commits, 1) if commits else None,
                       "commit_share_of_wall": round(d["spooler_commit_seconds_sum"] / wall, 2) if wall else None}
        return False


async def _workload(node, n, n_seq, n_batches, repeats, log, samples, extra, probe=None, label="spooler"):
    """Fills ``samples`` and ``extra`` as it goes, so a failure keeps what was measured.
    ``node`` is the node the SDK talks to (the primary in a cluster); ``probe(node)`` makes the
    per-phase measurement (default: _Probe, that one node's CPU and commits)."""
    from spooler import AsyncClient

    target, key = node.grpc_target, node.admin_key

    async with AsyncClient(target, key) as c:
        for r in range(1, repeats + 1):
            names = {k: f"bench-{k}-{r}" for k in ("seq", "inflight", "batch", "batch4", "recv", "recvp")}
            for name in names.values():
                await c.put_queue(name)
            phases = [
                ("sequential", lambda: _sequential(c, names["seq"], n_seq)),
                ("64_in_flight", lambda: _in_flight(c, names["inflight"], n)),
                ("batch_100", lambda: _batched(c, names["batch"], n_batches)),
                ("batch_100_4_in_flight", lambda: _batched(c, names["batch4"], n_batches, depth=4)),
                ("receive_ack", lambda: _receive_ack(c, names["recv"], n)),
                ("receive_ack_pipelined", lambda: _receive_ack(c, names["recvp"], n, pipelined=True)),
            ]
            for phase_name, phase in phases:
                try:
                    async with (probe or _Probe)(node) as pr:
                        res = await asyncio.wait_for(phase(), PHASE_TIMEOUT_S)
                    extra["where_time_goes"].setdefault(phase_name, []).append(pr.result)
                except Exception as e:
                    raise RuntimeError(f"run {r}/{repeats} phase {phase_name}: {type(e).__name__}: {e}") from e
                if isinstance(res, tuple):
                    res, info = res
                    if "send_rpcs" in info:
                        extra["send_rpcs_64_in_flight"].append(info["send_rpcs"])
                    if "ack_errors" in info:
                        extra["ack_errors"].append(info["ack_errors"])
                for k, v in res.items():
                    samples[k].append(v)
                log(f"{label} run {r}/{repeats} {phase_name}: {res}")
            for name in names.values():
                try:
                    await c.delete_queue(name)
                except Exception:
                    pass


def _other_client(target, key, n_seq, n_batches, repeats, log) -> dict:
    from spooler import grpc_io

    mine = "legacy" if os.environ.get("GRPC_EXPERIMENTS") == grpc_io.LEGACY else "default"
    other = "default" if mine == "legacy" else "legacy"
    log(f"client on gRPC's {other} I/O path (the workload's client: {mine}): sequential and "
        f"batch of 100, x{repeats}")
    r = other_client(target, key, other, n_seq, n_batches, repeats)
    log(f"client on {other}: {r.get('median') or r.get('error')}")
    return r


def run(n: int = 5000, n_seq: int = 1000, n_batches: int = 200, repeats: int = 3, log=print) -> dict:
    """Start one node, run the workload ``repeats`` times, stop the node. Never raises for a
    node failure: the result then carries ``error`` and whatever samples were taken."""
    data_dir = tempfile.mkdtemp(prefix="spooler-bench-")
    out = {"system": "spooler", "nodes": 1, "replicas": 1, "fsync": True, "message_bytes": len(BODY),
           "params": {"n_64_in_flight": n, "n_receive_ack": n, "n_sequential": n_seq,
                      "batches_of_100": n_batches, "repeats": repeats}}
    node = NodeProc(data_dir, node_id="bench1")
    samples = {f: [] for f in FIGURES}
    extra = {"send_rpcs_64_in_flight": [], "ack_errors": [], "where_time_goes": {}}
    out["extra"] = extra
    try:
        node.start()
        asyncio.run(_workload(node, n, n_seq, n_batches, repeats, log, samples, extra))
        out["other_client"] = _other_client(node.grpc_target, node.admin_key, n_seq, n_batches, repeats, log)
    except BaseException as e:  # noqa: BLE001 - report, never hide, and still stop the node
        out["error"] = f"{type(e).__name__}: {e}"
        out["node_alive"] = node.alive()
        out["node_log_tail"] = node.read_log()[-2000:]
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        if node.proc is not None:
            from bench.memory import proc_memory
            out["memory"] = proc_memory([node.pid])  # the node's footprint after the workload
        node.kill()
        shutil.rmtree(data_dir, ignore_errors=True)
    out["median"] = {k: _round(k, statistics.median(v)) for k, v in samples.items() if v}
    out["samples"] = samples
    return out


CLIENT_IO_FIGURES = ("send_sequential_p50_ms", "send_sequential_per_s", "send_batch_100_per_s")


def other_client(target: str, key: str, io: str, n_seq: int, n_batches: int, repeats: int,
                 timeout_s: float = 300.0) -> dict:
    """The sequential and batch-of-100 figures again, from a child process whose client runs
    gRPC's other I/O path (``io``: SPOOLER_GRPC_IO, spooler/grpc_io.py), against the same
    node while it is up: the SDK's default beside the benchmark client's opt-in, in one run.
    Never raises: a failure is reported in the result."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | {"SPOOLER_GRPC_IO": io}
    cmd = [sys.executable, "-m", "bench.spool", "--client-only", target, "--key", key, "--n-seq", str(n_seq),
           "--batches", str(n_batches), "--repeats", str(repeats)]
    try:
        p = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:  # subprocess.run kills the child by its pid on the timeout
        return {"client_grpc_io": io, "error": f"no answer within {timeout_s} s"}
    if p.returncode != 0:
        return {"client_grpc_io": io, "error": p.stderr[-1000:]}
    return json.loads(p.stdout)


async def _client_only(target: str, key: str, n_seq: int, n_batches: int, repeats: int) -> dict:
    import spooler
    from spooler import AsyncClient

    samples = {f: [] for f in CLIENT_IO_FIGURES}
    async with AsyncClient(target, key) as c:
        for r in range(1, repeats + 1):
            for name, phase in (("seq", lambda q: _sequential(c, q, n_seq)),
                                ("batch", lambda q: _batched(c, q, n_batches))):
                q = f"bench-client-io-{name}-{r}"
                await c.put_queue(q)
                for k, v in (await phase(q)).items():
                    if k in samples:
                        samples[k].append(v)
                await c.delete_queue(q)
    return {"client_grpc_io": spooler.GRPC_IO, "median": {k: _round(k, statistics.median(v)) for k, v in
                                                          samples.items() if v}, "samples": samples}


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m bench.spool")
    ap.add_argument("--client-only", metavar="TARGET", help="only the client: sequential and batch figures "
                    "against a running node (what other_client runs)")
    ap.add_argument("--key", default="")
    ap.add_argument("--n-seq", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.client_only:
        out = asyncio.run(_client_only(a.client_only, a.key, a.n_seq, a.batches, a.repeats))
    else:
        out = run(n_seq=a.n_seq, n_batches=a.batches, repeats=a.repeats)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
