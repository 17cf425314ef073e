"""Seeded process-failover drills against a real 3-node cluster (see drill.py).

The short drills (plain, power loss, partitions through the fault proxy) run in the normal
suite; the long ones are ``@pytest.mark.slow``
(``pytest -m slow tests/drills/test_drills.py``). Many seeds: ``python -m tests.drills.run``.
"""
import json

import pytest

from drills.checker import format_table
from drills.drill import run_drill

pytestmark = pytest.mark.integration


def _run(seed, duration_s, tmp_path, power_loss=False, partitions=False, cascades=False, disk_loss=False):
    report = run_drill(seed, duration_s, nodes=3, workdir=str(tmp_path / f"seed-{seed}"), power_loss=power_loss,
                       partitions=partitions, cascades=cascades, disk_loss=disk_loss)
    table = format_table(report)
    print(f"seed {seed}: {report['wall_s']:.1f}s wall, nemeses {json.dumps(report['nemesis_counts'])}\n{table}")
    assert report["drain_complete"], report["notes"]
    assert not report["thread_errors"], report["thread_errors"]
    assert report["required_zeros_ok"], f"history kept in {report['history']}\n{table}"
    assert report["nodes_agree"] is True and report["integrity_ok"] is True
    assert report["confirmed_sends"] > 0 and report["deliveries"] >= report["confirmed_sends"]
    return report


def test_short_failover_drill(tmp_path):
    r = _run(1, 14.0, tmp_path)
    assert sum(r["nemesis_counts"].get(k, 0) for k in ("kill_primary", "stop_primary", "kill_replica")) >= 1


def test_short_power_loss_drill(tmp_path):
    """Every SIGKILL is a power cut: nodes lose all they had not fsync'd."""
    r = _run(7, 14.0, tmp_path, power_loss=True)
    assert sum(v for k, v in r["nemesis_counts"].items() if k.startswith("power_loss")) >= 1, r["nemesis_counts"]


def test_short_partition_drill(tmp_path):
    """Node-to-node traffic crosses the fault proxy; seed 18 blackholes the primary, then holds
    every byte the (new) primary sends to the others while theirs reach it."""
    r = _run(18, 14.0, tmp_path, partitions=True)
    parts = {k: v for k, v in r["nemesis_counts"].items() if k.startswith("partition_")}
    assert parts.get("partition_blackhole_primary", 0) >= 1, r["nemesis_counts"]
    assert sum(parts.values()) >= 2, r["nemesis_counts"]
    assert len(r["rejoins"]) == sum(parts.values()), (r["rejoins"], r["notes"])
    links = r["proxy_links"]
    assert len(links) == 6 and all(x["mode"] == "ok" for x in links.values()), links
    # the primary's log shipping crossed the proxy (every node was primary or replica of one)
    assert sum(1 for x in links.values() if x["bytes_fwd"] > 0 and x["bytes_back"] > 0) >= 4, links


def test_short_cascade_drill(tmp_path):
    """Overlapping faults; seed 4 kills a replica and then stops the primary (no quorum
    left until the replica is back), then kills a new primary right after its election."""
    r = _run(4, 14.0, tmp_path, cascades=True)
    counts = r["nemesis_counts"]
    assert counts.get("cascade_kill_replica_stop_primary", 0) >= 1, counts
    assert counts.get("cascade_kill_primary_twice", 0) >= 1, counts
    assert counts.get("kill_primary", 0) >= 2 * counts["cascade_kill_primary_twice"], counts


def test_short_disk_loss_drill(tmp_path):
    """R1a under load: a replica's disk is lost and its replacement joins with --join
    (seed 7 also kills the primary); nothing confirmed is lost, and it joins."""
    r = _run(7, 10.0, tmp_path, disk_loss=True)
    counts = r["nemesis_counts"]
    assert counts.get("disk_loss_replica", 0) >= 1 and counts.get("joined", 0) == counts["disk_loss_replica"], counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4, 5, 6])
def test_long_failover_drill(seed, tmp_path):
    _run(seed, 60.0, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 8, 20, 29, 37])
def test_long_partition_drill(seed, tmp_path):
    _run(seed, 60.0, tmp_path, partitions=True)
