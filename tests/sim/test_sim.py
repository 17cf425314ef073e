"""Thousands of seeded runs of the replication core (see tests/sim/sim.py)."""
import os

import pytest

from sim.sim import run_seed

SEEDS_3 = int(os.environ.get("SIM_SEEDS", "600"))
SEEDS_5 = int(os.environ.get("SIM_SEEDS_5", "150"))


@pytest.mark.parametrize("block", range(10))
def test_three_nodes(block):
    n = SEEDS_3 // 10
    for seed in range(block * n, (block + 1) * n):
        run_seed(seed, nodes=3)


@pytest.mark.parametrize("block", range(5))
def test_five_nodes(block):
    n = SEEDS_5 // 5
    for seed in range(100_000 + block * n, 100_000 + (block + 1) * n):
        run_seed(seed, nodes=5)


def test_progress_is_made():
    """The simulation is not vacuous: writes get committed and primaries change."""
    total_acked, epochs = 0, 0
    for seed in range(20):
        s = run_seed(seed, nodes=3)
        total_acked += len(s.acked)
        epochs += len(s.primaries)
    assert total_acked > 200
    assert epochs > 30
