"""Seeded process-failover drills against a real 3-node cluster (see drill.py).

The short drill runs in the normal suite; the long ones are ``@pytest.mark.slow``
(``pytest -m slow tests/drills/test_drills.py``). Many seeds: ``python -m tests.drills.run``.
"""
import json

import pytest

from drills.checker import format_table
from drills.drill import run_drill

pytestmark = pytest.mark.integration


def _run(seed, duration_s, tmp_path):
    report = run_drill(seed, duration_s, nodes=3, workdir=str(tmp_path / f"seed-{seed}"))
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


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4, 5, 6])
def test_long_failover_drill(seed, tmp_path):
    _run(seed, 60.0, tmp_path)
