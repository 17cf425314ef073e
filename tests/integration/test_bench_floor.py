"""bench/floor.py, the bare stack that `make bench` sets beside every send figure: its
processes serve the three shapes, answer every message, and end; and the figures it
puts beside the targets come out right."""
import asyncio
import json
import os
import sqlite3

import pytest

from bench import floor, run

pytestmark = pytest.mark.integration


def test_bare_stack_runs_every_shape_and_stores_every_request(tmp_path):
    # a 3-node shape, small: the primary and both replicas each commit every request
    procs = []
    try:
        reps = []
        for i in range(2):
            p, addr = floor._start("replica", str(tmp_path), [], i)
            procs.append(p)
            reps.append(addr)
        p, target = floor._start("primary", str(tmp_path), reps, 0)
        procs.append(p)
        out = asyncio.run(floor._workload(target, n=300, n_seq=20, n_batches=5))
        for p in procs:  # before reading the files: the nodes are done with them
            p.kill()
            p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert set(out) == {"send_sequential_per_s", "send_sequential_p50_ms", "send_64_in_flight_per_s",
                        "send_batch_100_per_s"}
    assert all(v > 0 for v in out.values())
    # 1 warm-up + 20 sequential + the 300 sends in at most 100 per request + 5 batches,
    # on every node (a replica may trail the primary by the requests it had not answered)
    bodies = {}
    for name in ("primary0", "replica0", "replica1"):
        db = sqlite3.connect(os.path.join(tmp_path, f"{name}.db"))
        rows = db.execute("SELECT rec FROM log ORDER BY lsn").fetchall()
        db.close()
        bodies[name] = sum(len(r[0]) for r in rows) // len(floor.BODY)
    assert bodies["primary0"] == 1 + 20 + 300 + 5 * 100
    assert max(bodies["replica0"], bodies["replica1"]) == bodies["primary0"]


def test_share_and_targets_set_the_bare_stack_beside_spooler():
    bare = {"median": {"send_sequential_p50_ms": 0.8, "send_batch_100_per_s": 60_000,
                       "send_64_in_flight_per_s": 25_000}}
    mine = {"send_sequential_p50_ms": 1.6, "send_batch_100_per_s": 30_000, "send_64_in_flight_per_s": 12_500}
    # below 1 always means Spooler is slower than the bare stack, for rates and for latency
    assert floor.share(mine, bare) == {"send_sequential_p50_ms": 0.5, "send_batch_100_per_s": 0.5,
                                       "send_64_in_flight_per_s": 0.5}
    t = run.targets({"median": mine}, 2, bare)
    assert t["send_sequential_p50_ms"]["bare_stack_meets_target"] is False   # 0.8 > 0.7
    assert t["send_64_in_flight_per_s"]["bare_stack_meets_target"] is True  # 25,000 >= 20,000
    assert t["send_batch_100_per_s"]["bare_stack"] == 60_000
    assert json.dumps(t)  # the run writes it as JSON
