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


def test_a_replica_drops_its_primary_only_after_a_failover_timeout_without_it():
    """A broken stream makes a replica campaign early (a pre-vote, which a live primary's
    other replica refuses), but a live primary reconnects within that time: the replica
    keeps naming it (keeps forwarding to it, stays ready). Only a whole failover timeout
    without a word from it makes the replica drop it."""
    import random

    from node.core import replication as R

    T = 2_000_000
    b = R.Replication("b", ["a", "b", "c"], failover_timeout_us=T, rand=random.Random(5).random)
    b.start(0)
    now = 1_000
    b.receive(R.AppendReq(1, "a", 0, 0, 0, [], 0, now), now)
    assert (b.role, b.primary) == (R.REPLICA, "a")

    b.primary_stream_broken(now + 1)
    soon = b.election_at
    assert soon - now < T // 4  # the early campaign is armed
    out = b.tick(soon)
    assert any(isinstance(e, R.Send) and isinstance(e.msg, R.VoteReq) and e.msg.pre for e in out), out
    assert b.primary == "a", "dropped a primary heard from a moment ago"
    assert not any(isinstance(e, R.Role) for e in out), out

    late = now + T
    out = b.tick(max(late, b.election_at))
    assert b.primary is None
    assert R.Role(R.REPLICA, 1, None) in out, out
