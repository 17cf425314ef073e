"""Job-runner benchmark: 1,000 `true` jobs drained by 4 worker processes.

Measures the whole path (claim under BEGIN IMMEDIATE + spawn + record, each
commit fsync'd) as jobs/s, and the claim latency under contention (p50/p99 of
claim_next across all workers). Target on 2 cores: >= 150 jobs/s.

    python -m bench.jobs            # prints JSON
    from bench.jobs import run; run()
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_JOBS_PER_S = 150.0


def _percentile(samples, q):
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _child(spool_dir: str) -> None:
    """One worker process (concurrency 1, --drain); prints its claim latencies."""
    from spooler.jobs import knobs
    from spooler.jobs.worker import Worker

    w = Worker(spool_dir, knobs.load(), concurrency=1, drain=True)
    summary = w.run()
    print(json.dumps({"summary": summary, "claim_latencies_s": w.claim_latencies_s}))


def run(n_jobs: int = 1000, workers: int = 4) -> dict:
    from spooler.jobs.store import Store

    with tempfile.TemporaryDirectory(prefix="spoolctl-bench-") as tmp:
        spool_dir = os.path.join(tmp, "spool")
        store = Store(spool_dir)
        for _ in range(n_jobs):
            store.submit(["true"])
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for k in ("SPOOLCTL_TEST_HEARTBEAT_INTERVAL", "SPOOLCTL_TEST_REAP_THRESHOLD"):
            env.pop(k, None)
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "bench.jobs", "--child", spool_dir], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(workers)]
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise RuntimeError(f"bench worker failed: {err.decode(errors='replace')[-2000:]}")
                outs.append(json.loads(out))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        wall_s = time.perf_counter() - t0
        counts = store.counts()
        first_start, last_end = next(iter(store.conn.execute(
            "SELECT MIN(started_at), MAX(finished_at) FROM attempts")))
        store.close()
    lat = [x for o in outs for x in o["claim_latencies_s"]]
    ms = (lambda v: None if v is None else round(v * 1000, 3))
    steady_s = max(1e-9, last_end - first_start)
    return {
        "benchmark": "spoolctl local jobs",
        "jobs": n_jobs,
        "workers": workers,
        "succeeded": counts["succeeded"],
        "wall_s": round(wall_s, 3),
        "jobs_per_s": round(n_jobs / wall_s, 1),               # including worker start-up
        "jobs_per_s_steady": round(n_jobs / steady_s, 1),      # first claim to last record
        "claim_latency_ms": {"p50": ms(_percentile(lat, 0.50)), "p99": ms(_percentile(lat, 0.99)),
                             "max": ms(max(lat) if lat else None), "count": len(lat)},
        "busy_timeouts": sum(o["summary"]["busy_timeouts"] for o in outs),
        "target_jobs_per_s": TARGET_JOBS_PER_S,
        "meets_target": n_jobs / wall_s >= TARGET_JOBS_PER_S,
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        print(json.dumps(run(), indent=2))
