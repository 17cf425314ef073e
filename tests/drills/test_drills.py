"""Seeded process-failover drills against a real 3-node cluster (see drill.py).

The short drill runs in the normal suite; the long ones are ``@pytest.mark.slow``
(``pytest -m slow tests/drills/test_drills.py``). Many seeds: ``python -m tests.drills.run``.
"""
import json

import pytest

from drills.checker import format_table
from drills.drill import run_drill

pytestmark = pytest.mark.integration


def _run(seed, duration_s, tmp_path, power_loss=False):
    report = run_drill(seed, duration_s, nodes=3, workdir=str(tmp_path / f"seed-{seed}"), power_loss=power_loss)
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


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4, 5, 6])
def test_long_failover_drill(seed, tmp_path):
    _run(seed, 60.0, tmp_path)
