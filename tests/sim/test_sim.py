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


def test_a_split_vote_is_retried_soon_not_after_a_whole_timeout():
    """Two replicas of a 3-node cluster whose primary stopped campaign at the same moment
    and each votes for itself. A refusal makes each retry after a random pause under half
    a failover timeout (the spread decides the next round), not after a whole one."""
    import random

    from node.core import replication as R

    T = 2_000_000
    rng = random.Random(3)
    a = R.Replication("a", ["a", "b", "c"], failover_timeout_us=T, rand=rng.random)
    b = R.Replication("b", ["a", "b", "c"], failover_timeout_us=T, rand=rng.random)
    for n in (a, b):
        n.start(0)
    now = 10 * T  # both long past their election timers, with no primary ever heard
    out_a, out_b = a._campaign(now, pre=False), b._campaign(now, pre=False)
    req_a = next(e.msg for e in out_a if isinstance(e, R.Send) and e.to == "b")
    req_b = next(e.msg for e in out_b if isinstance(e, R.Send) and e.to == "a")
    # each has voted for itself in this epoch: each refuses the other
    resp_from_b = next(e.msg for e in b.receive(req_a, now + 1) if isinstance(e, R.Send))
    resp_from_a = next(e.msg for e in a.receive(req_b, now + 1) if isinstance(e, R.Send))
    assert not resp_from_b.granted and not resp_from_a.granted
    a.receive(resp_from_b, now + 2)
    b.receive(resp_from_a, now + 2)
    for n in (a, b):
        assert n.role == R.CANDIDATE
        assert n.election_at - (now + 2) <= T // 2
