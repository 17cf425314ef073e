"""`make bench`: Spooler (1 node and a 3-node cluster) beside its peers, measured in one run.

    .venv/bin/python -m bench.run                       # what `make bench` runs
    .venv/bin/python -m bench.run --no-cluster          # single-node part only
    .venv/bin/python -m bench.run --peers none --no-jobs
    SPOOLER_BENCH_INSTALL_PEERS=1 .venv/bin/python -m bench.run   # apt-get/pip the peers if missing

Prints one JSON object on stdout (progress, and at the end the run's tables in Markdown, go
to stderr) and writes the same JSON to bench/results/latest.json and the tables to
bench/results/latest.md (bench/summary.py). Sections: machine, spooler (bench/spool.py, ONE node), peers
(bench/peers.py: NATS JetStream and RabbitMQ quorum queues, each a 3-node cluster made by the
peer's own cluster.sh), ratios and targets (single node vs peers, the single-node issue's
targets), cluster (bench/cluster.py: Spooler as 3 nodes with quorum confirm, the same workload,
ratios against the same peer runs, failover after SIGKILL and SIGSTOP of the primary, the
peers' own failover.py each on a fresh cluster, and the replication issue's targets), jobs
(bench/jobs.py, the job runner's own benchmark, when it imports), memory (bench/memory.py: a
node's resident size per message held) and memory_beside_peers (each system's resident size
after the same workload). See docs/benchmarks.md.

The benchmark's client runs gRPC's older I/O path (--client-grpc-io, as an SDK user opts in
with SPOOLER_GRPC_IO=legacy); each workload's other_client has the sequential and batch
figures of a client on the SDK's default path, measured in a child process beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "latest.json"

# figure -> (comparison, bound); the targets for a 2-core machine with fsync on
TARGETS = {
    "send_64_in_flight_per_s": (">=", 20_000),
    "send_batch_100_per_s": (">=", 100_000),
    "send_sequential_p50_ms": ("<=", 0.7),
}
# the replication issue's targets (3 nodes, quorum confirm, fsync on every node, 2 cores);
# figure -> (comparison, bound, relative-to-peer figure or None)
CLUSTER_TARGETS = {
    "send_64_in_flight_per_s": (">=", 1.5, "nats-jetstream"),
    "send_batch_100_per_s": (">=", 100_000, None),
    "send_sequential_p50_ms": ("<=", 1.0, None),
    "receive_ack_per_s": (">=", 1.5, "nats-jetstream"),
    "failover_sigkill_s": ("<=", 0.5, None),
    "failover_sigstop_s": ("<=", 0.5, "failover_timeout"),  # timeout + 0.5 s
}
CAVEAT = ("The top-level spooler figures and ratios are ONE Spooler node; the 'cluster' section has 3 Spooler "
          "nodes and their ratios. Each peer runs a 3-node cluster that replicates every message (JetStream R3, "
          "RabbitMQ quorum queue with 3 replicas). Ratios are indicative only. JetStream acks a publish before "
          "fsync (it fsyncs on a timer); Spooler and RabbitMQ quorum queues answer only after fsync.")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _meminfo_kb(field: str):
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


SETTLES: list = []


def settle_disk(what: str) -> None:
    """Before each system is measured: write back every dirty page the machine
    holds (``sync``), so that one system's figures do not pay for the writes of
    the one measured before it (the kernel's writeback would otherwise flush them
    during the next workload's fsyncs). Kept in ``machine.settles``: the dirty kB
    found and how long the sync took (docs/benchmarks-history.md: so far too little to
    move a figure; it rules that cause out)."""
    dirty = _meminfo_kb("Dirty")
    t0 = time.perf_counter()
    os.sync()
    took = time.perf_counter() - t0
    SETTLES.append({"before": what, "dirty_kb": dirty, "sync_s": round(took, 3)})
    log(f"settle before {what}: {dirty} kB dirty, sync took {took:.3f} s")


def machine() -> dict:
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    total_kb = _meminfo_kb("MemTotal")
    mem_gb = round(total_kb / 1024 / 1024, 1) if total_kb is not None else None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    commit = None
    try:  # read-only
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        pass
    return {"nproc": os.cpu_count(), "usable_cpus": usable, "cpu_model": cpu_model, "mem_gb": mem_gb,
            "python": platform.python_version(), "kernel": platform.release(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "git_commit": commit,
            "fdatasync_256b_ms": fsync_probe(), "fdatasync_after_idle_ms": fsync_idle_probe()}


def _on_probe_file(prefix: str, flags: int, run) -> dict:
    """``run(fd)`` on a file in a new temp dir (where the node's and the peers' data
    live during the run), which is then removed; an OSError is the probe's result."""
    d = tempfile.mkdtemp(prefix=prefix)
    try:
        fd = os.open(os.path.join(d, "probe"), flags, 0o600)
        try:
            return run(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return {"error": str(e)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _synced_write(fd: int, offset: int | None = None) -> float:
    """Seconds for a 256-byte write (appended, or at ``offset``) and its fdatasync."""
    t = time.perf_counter()
    if offset is None:
        os.write(fd, b"x" * 256)
    else:
        os.pwrite(fd, b"x" * 256, offset)
    os.fdatasync(fd)
    return time.perf_counter() - t


def fsync_probe(n: int = 300) -> dict:
    """Append 256 bytes + fdatasync, n times: the floor under every durable write on
    this disk."""
    def run(fd):
        lat = sorted(_synced_write(fd) for _ in range(n))
        return {"n": n, "p50": round(statistics.median(lat) * 1e3, 3), "p99": round(lat[int(0.99 * n)] * 1e3, 3)}
    return _on_probe_file("spooler-bench-fsync-", os.O_WRONLY | os.O_CREAT | os.O_APPEND, run)


def fsync_idle_probe(gaps_ms=(0, 0.25, 0.5, 1.0), n: int = 100, rounds: int = 2) -> dict:
    """The same write + fdatasync (256 bytes, overwriting a file of that size, so no
    size changes), each one after an idle gap: {gap in ms: median ms}. On a virtual
    disk a flush that follows a pause can take many times one that follows another
    flush; a one-at-a-time workload pauses between its commits for its own round
    trip, so this is the disk that workload meets. The gaps take turns, ``rounds``
    times, so that a change of the disk's mood during the probe falls on all of them."""
    def run(fd):
        os.write(fd, b"\0" * (256 * n))
        os.fsync(fd)
        lat: dict = {g: [] for g in gaps_ms}
        for _ in range(rounds):
            for g in gaps_ms:
                for i in range(n):
                    if g:
                        time.sleep(g / 1e3)
                    lat[g].append(_synced_write(fd, 256 * i))
        return {str(g): round(statistics.median(v) * 1e3, 3) for g, v in lat.items()}
    return _on_probe_file("spooler-bench-fsync-idle-", os.O_WRONLY | os.O_CREAT, run)


def ratios(spooler: dict, peers: dict) -> dict:
    """spooler / peer for each figure both have (medians). For *_per_s above 1 means Spooler is
    faster; for *_ms below 1 means Spooler's latency is lower."""
    out = {}
    mine = spooler.get("median", {})
    for name, p in peers.items():
        theirs = p.get("median") or {}
        r = {}
        for fig, v in mine.items():
            if fig in theirs and theirs[fig]:
                r[fig] = round(v / theirs[fig], 3)
        # the peers' consumers do not wait for their acks' answers: set our pipelined
        # figure (acks confirmed, but overlapped with the next receive) beside theirs
        if mine.get("receive_ack_pipelined_per_s") and theirs.get("receive_ack_per_s"):
            r["receive_ack_pipelined_vs_their_receive_ack"] = round(
                mine["receive_ack_pipelined_per_s"] / theirs["receive_ack_per_s"], 3)
        if r:
            out[name] = r
    return out


def _bare(t: dict, fig: str, op: str, bound, bare: dict) -> None:
    """Beside a target: what the bare stack (bench/floor.py) gave for the same figure in this
    run, and whether even it meets the target."""
    v = ((bare or {}).get("median") or {}).get(fig)
    if v is not None and bound is not None:
        t["bare_stack"] = v
        t["bare_stack_meets_target"] = v >= bound if op == ">=" else v <= bound


def targets(spooler: dict, nproc, bare: dict = None) -> dict:
    out = {}
    med = spooler.get("median", {})
    for fig, (op, bound) in TARGETS.items():
        v = med.get(fig)
        t = {"target": f"{op} {bound}"}
        _bare(t, fig, op, bound, bare)
        if v is None:
            t.update(value=None, passed=None, note="not measured")
        else:
            passed = v >= bound if op == ">=" else v <= bound
            # factor: how many times better the figure must get to meet the target (<= 1: met)
            factor = bound / v if op == ">=" else v / bound
            t.update(value=v, passed=passed, factor_to_target=round(factor, 2))
            if not passed:
                t["missed_by_pct"] = round(abs(v - bound) / bound * 100, 1)
        out[fig] = t
    if nproc != 2:
        out["note"] = f"targets are stated for a 2-core machine; this one has {nproc}"
    return out


def _judge(v, op, bound) -> dict:
    t = {"value": v, "bound": round(bound, 3)}
    if v is None:
        t.update(passed=None, note="not measured")
        return t
    passed = v >= bound if op == ">=" else v <= bound
    t.update(passed=passed, factor_to_target=round(bound / v if op == ">=" else v / bound, 2) if v else None)
    if not passed:
        t["missed_by"] = round(abs(v - bound), 3)
        t["missed_by_pct"] = round(abs(v - bound) / bound * 100, 1)
    return t


def cluster_targets(cl: dict, peers: dict, nproc, bare: dict = None) -> dict:
    """The replication issue's targets against the 3-node medians. Relative targets use the
    peer's median from this same run."""
    out = {}
    med = (cl.get("spooler") or {}).get("median", {})
    fo = cl.get("failover") or {}
    vals = dict(med)
    vals["failover_sigkill_s"] = (fo.get("sigkill") or {}).get("median_s")
    vals["failover_sigstop_s"] = (fo.get("sigstop") or {}).get("median_s")
    for fig, (op, k, rel) in CLUSTER_TARGETS.items():
        v = vals.get(fig)
        if rel is None:
            t = {"target": f"{op} {k}"}
            t.update(_judge(v, op, k))
            _bare(t, fig, op, k, bare)
        elif rel == "failover_timeout":
            timeout = (fo.get("sigstop") or {}).get("failover_timeout_s")
            t = {"target": f"{op} failover timeout ({timeout} s) + {k} s"}
            t.update(_judge(v, op, timeout + k) if timeout is not None else {"value": v, "passed": None})
        else:
            theirs = ((peers.get(rel) or {}).get("median") or {}).get(fig)
            t = {"target": f"{op} {k} x {rel} ({theirs})"}
            if not theirs:
                t.update(value=v, passed=None, note=f"{rel} not measured in this run")
            else:
                t.update(_judge(v, op, k * theirs))
                _bare(t, fig, op, k * theirs, bare)
                if v is not None:
                    t["ratio_to_peer"] = round(v / theirs, 3)
        out[fig] = t
    if nproc != 2:
        out["note"] = f"targets are stated for a 2-core machine; this one has {nproc}"
    return out


def run_cluster(a, peers_mod, peer_results: dict) -> dict:
    from bench import cluster as cluster_mod
    out = {"setup": "3 spooler-node processes on 127.0.0.1, a send answered after fsync on a quorum (2 of 3), "
                    f"every node fsyncs every record, failover timeout {a.failover_timeout} s"}
    log(f"cluster: 3 nodes, failover timeout {a.failover_timeout} s, same workload x{a.repeats}")
    settle_disk("spooler 3 nodes")
    out["spooler"] = cluster_mod.run_workload(n=a.n, n_seq=a.n_seq, n_batches=a.batches, repeats=a.repeats,
                                              failover_timeout_s=a.failover_timeout, log=log)
    if "error" in out["spooler"]:
        log(f"cluster: ERROR {out['spooler']['error']}")
    out["ratios"] = ratios(out["spooler"], peer_results)
    out["ratios_note"] = ("3-node Spooler median / the peer's median (the peer runs of this invocation, "
                          "3 nodes each); *_per_s > 1: Spooler faster; *_ms < 1: Spooler's latency lower")
    fo = {}
    for kind in ("sigkill", "sigstop"):
        log(f"cluster: failover after {kind.upper()} of the primary, x{a.failover_repeats}, fresh cluster each")
        fo[kind] = cluster_mod.run_failover(kind, repeats=a.failover_repeats,
                                            failover_timeout_s=a.failover_timeout, log=log)
    fo["peers"] = {}
    for name in peers_mod.PEERS:
        p = peer_results.get(name) or {}
        if p.get("skipped") in ("--peers none", "not selected (--peers)"):
            fo["peers"][name] = {"skipped": p["skipped"]}
            continue
        log(f"peers: {name}: failover.py x{a.peer_failover_repeats}, fresh cluster each")
        fo["peers"][name] = peers_mod.run_failover(name, repeats=a.peer_failover_repeats, log=log)
    out["failover"] = fo
    return out


def run_jobs() -> dict:
    try:
        from bench import jobs  # another engineer's module: bench/jobs.py, run() -> dict
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        return jobs.run()
    except Exception as e:  # noqa: BLE001
        return {"error": f"run() raised {type(e).__name__}: {e}"}


def memory_beside_peers(result: dict) -> dict:
    """Resident memory (MiB, summed over a system's processes) after the same workload:
    Spooler's 1 node and 3 nodes, and each peer's 3 nodes; the peak (VmHWM) and what was
    resident at the end. Ratios: Spooler's 3 nodes / the peer's, peak against peak."""
    out = {}
    one = (result.get("spooler") or {}).get("memory")
    three = ((result.get("cluster") or {}).get("spooler") or {}).get("memory")
    if one:
        out["spooler_1_node"] = {"peak_rss_mib": one["peak_rss_mib"], "rss_mib": one["rss_mib"]}
    if three:
        out["spooler_3_nodes"] = {"peak_rss_mib": three["peak_rss_mib"], "rss_mib": three["rss_mib"]}
    for name, p in (result.get("peers") or {}).items():
        m = p.get("memory")
        if not m:
            continue
        out[name] = {"peak_rss_mib": m["peak_rss_mib"], "rss_mib": m["rss_mib"], "processes": len(m["processes"])}
        if three and m["peak_rss_mib"]:
            out[name]["spooler_3_nodes_peak_over_this"] = round(three["peak_rss_mib"] / m["peak_rss_mib"], 2)
    return out


def settle_client_io(choice: str) -> str:
    """Put this process's gRPC client on ``choice`` before anything imports grpc, the way a
    user of the SDK opts in (spooler/grpc_io.py), without handing SPOOLER_GRPC_IO on to the
    nodes this process starts: they make their own choice (node/process.py). Returns what
    the process runs with ("operator" when GRPC_EXPERIMENTS was set already)."""
    from spooler import grpc_io

    env = dict(os.environ, SPOOLER_GRPC_IO=choice)
    got = grpc_io.prepare(env, default=choice)
    if "GRPC_EXPERIMENTS" in env:
        os.environ["GRPC_EXPERIMENTS"] = env["GRPC_EXPERIMENTS"]
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=int(os.environ.get("SPOOLER_BENCH_N", "5000")),
                    help="messages for 64-in-flight and receive+ack (also passed to the peers' bench.py)")
    ap.add_argument("--n-seq", type=int, default=1000, help="sequential sends")
    ap.add_argument("--batches", type=int, default=200, help="send_batch calls of 100 messages")
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("SPOOLER_BENCH_REPEATS", "3")))
    ap.add_argument("--peers", default=os.environ.get("SPOOLER_BENCH_PEERS", "all"),
                    help="all | none | comma list of nats-jetstream,rabbitmq-quorum")
    ap.add_argument("--no-jobs", action="store_true", help="skip bench/jobs.py")
    ap.add_argument("--no-bare", action="store_true", help="skip bench/floor.py (the bare stack)")
    ap.add_argument("--no-memory", action="store_true", help="skip bench/memory.py (a node's memory per message)")
    ap.add_argument("--no-cluster", action="store_true", default=os.environ.get("SPOOLER_BENCH_CLUSTER") == "0",
                    help="skip the 3-node part (workload, failover, the peers' failover.py)")
    ap.add_argument("--failover-timeout", type=float, default=2.0, help="the nodes' --failover-timeout, seconds")
    ap.add_argument("--failover-repeats", type=int, default=3, help="failovers per signal, each on a fresh cluster")
    ap.add_argument("--peer-failover-repeats", type=int, default=1,
                    help="runs of each peer's failover.py, each on a fresh cluster")
    ap.add_argument("--client-grpc-io", choices=("legacy", "default"),
                    default=os.environ.get("SPOOLER_BENCH_CLIENT_IO", "legacy"),
                    help="gRPC I/O path of the benchmark's client (SPOOLER_GRPC_IO, spooler/grpc_io.py); "
                         "a child process measures the other path's sequential and batch figures beside it")
    ap.add_argument("--out", default=str(RESULTS), help="where to write the JSON as well")
    a = ap.parse_args(argv)
    client_io = settle_client_io(a.client_grpc_io)

    from bench import floor
    from bench import peers as peers_mod
    from bench import spool
    from bench import summary

    t0 = time.perf_counter()
    result = {"benchmark": "spooler single-node and 3-node vs peers",
              "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "caveat": CAVEAT, "machine": machine()}
    result["machine"]["client_grpc_io"] = client_io
    log(f"the benchmark's client runs gRPC's {client_io} I/O path; the nodes run theirs (legacy by default)")

    log(f"spooler: 1 node, N={a.n}, sequential {a.n_seq}, {a.batches} batches of 100, x{a.repeats}")
    settle_disk("spooler 1 node")
    result["spooler"] = spool.run(n=a.n, n_seq=a.n_seq, n_batches=a.batches, repeats=a.repeats, log=log)
    if "error" in result["spooler"]:
        log(f"spooler: ERROR {result['spooler']['error']}")

    if a.no_memory:
        result["memory"] = {"skipped": "--no-memory"}
    else:
        from bench import memory
        log("memory: one fresh node per scenario: batches, keyed sends, leases")
        result["memory"] = memory.run(log=log)

    if a.no_bare:
        result["bare_stack"] = {"skipped": "--no-bare"}
    else:
        settle_disk("bare stack")
        result["bare_stack"] = floor.run(n=a.n, n_seq=a.n_seq, n_batches=a.batches, repeats=a.repeats, log=log)
    bare = result["bare_stack"]
    result["spooler_share_of_bare"] = floor.share(result["spooler"].get("median", {}), bare.get("one_node") or {})

    if a.no_jobs:
        result["jobs"] = {"skipped": "--no-jobs"}
    else:
        log("jobs: bench/jobs.py run()")
        result["jobs"] = run_jobs()

    if a.peers == "none":
        result["peers"] = {name: {"skipped": "--peers none"} for name in peers_mod.PEERS}
    else:
        only = None if a.peers == "all" else {x.strip() for x in a.peers.split(",") if x.strip()}
        result["peers"] = {}
        for name in peers_mod.PEERS:
            if only is not None and name not in only:
                result["peers"][name] = {"skipped": "not selected (--peers)"}
                continue
            settle_disk(name)
            result["peers"][name] = peers_mod.run_peer(name, n=a.n, repeats=a.repeats, log=log)
            p = result["peers"][name]
            if "skipped" in p or "error" in p:
                log(f"peers: {name}: {p.get('skipped') or p.get('error')}")

    result["ratios"] = ratios(result["spooler"], result["peers"])
    result["ratios_note"] = ("1-node spooler median / peer median; *_per_s > 1: Spooler faster; *_ms < 1: "
                             "Spooler's latency lower. The 3-node ratios are in cluster.ratios.")
    result["targets"] = targets(result["spooler"], result["machine"]["nproc"], bare.get("one_node"))
    if a.no_cluster:
        result["cluster"] = {"skipped": "--no-cluster"}
    else:
        result["cluster"] = run_cluster(a, peers_mod, result["peers"])
        result["cluster"]["targets"] = cluster_targets(result["cluster"], result["peers"], result["machine"]["nproc"],
                                                       bare.get("three_nodes"))
        result["cluster"]["spooler_share_of_bare"] = floor.share(
            (result["cluster"].get("spooler") or {}).get("median", {}), bare.get("three_nodes") or {})
        passed = {k: v.get("passed") for k, v in result["cluster"]["targets"].items() if isinstance(v, dict)}
        log(f"cluster targets: {passed}")
    result["memory_beside_peers"] = memory_beside_peers(result)
    result["machine"]["settles"] = SETTLES
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)

    text = json.dumps(result, indent=2)
    out = Path(a.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        log(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    except OSError as e:
        log(f"could not write {a.out}: {e}")
    # the tables after the JSON is safe: a failure here costs the tables only
    tables = out.with_suffix(".md") if out.suffix != ".md" else out.with_name(out.name + ".tables.md")
    try:
        md = summary.table(result)
        tables.write_text(md)
        print(md, file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the run's figures are in the JSON already
        log(f"could not make or write the tables ({tables.name}): {type(e).__name__}: {e}")
    print(text)
    return 1 if "error" in result["spooler"] or "error" in (result["cluster"].get("spooler") or {}) else 0


if __name__ == "__main__":
    sys.exit(main())
