"""A real 3-node cluster on 127.0.0.1: election, replication, failover, rejoin."""
import json
import os
import signal
import time
import urllib.request
import uuid

import pytest

from contract_client import Api
from nodeproc import NodeProc, free_ports, start_cluster, wait_until
from spooler import errors
from spooler.http import HttpClient

FAILOVER_S = 2.0  # (not 1 s: a loaded machine can stall a primary for a second)


@pytest.fixture
def cluster(tmp_path):
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S)
    stopped = set()
    try:
        yield nodes, stopped
    finally:
        for i, n in nodes.items():
            if i in stopped and n.alive():
                os.kill(n.pid, signal.SIGCONT)
            n.kill()


def view(n):
    try:
        return n.get("/v1/cluster")[1]
    except Exception:
        return None


def document(n, timeout_s=10.0):
    """The node's cluster document, polled with a deadline: one fetch can fail
    while the machine is loaded, and an assertion on ``None`` would say nothing."""
    return wait_until(lambda: view(n), timeout_s, what=f"the cluster document of {n.node_id}")


def primary_of(nodes, exclude=()):
    for i, n in nodes.items():
        if i in exclude or not n.alive():
            continue
        v = view(n)
        if v and v["role"] == "primary":
            return i, v["epoch"]
    return None


def client(n):
    return HttpClient(n.http_url, n.admin_key, timeout_s=10)


def until_ok(fn, timeout_s=15, what="success"):
    """Retry a call while the cluster answers 'not now' (no primary yet, epoch not open)."""
    def attempt():
        try:
            return fn()
        except (errors.Unavailable, errors.OperationUnconfirmed):
            return None
    return wait_until(attempt, timeout_s, interval_s=0.02, what=what)


def send_until_ok(c, queue, body, timeout_s=15):
    """One message, sent until a 201. Its tries share a dedup key: one that ended
    operation_unconfirmed may have been stored, and the next must not store the
    message twice (the tests count what was sent)."""
    key = uuid.uuid4().hex
    return until_ok(lambda: c.send(queue, body, dedup_key=key), timeout_s, what="a 201")


def all_applied(nodes, lsn_at_least):
    vs = [view(n) for n in nodes.values() if n.alive()]
    return all(v and v["appliedLsn"] >= lsn_at_least for v in vs)


def test_elects_one_primary_and_replicates(cluster):
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    replica = next(i for i in nodes if i != p)
    c = client(nodes[replica])  # any node serves: this one forwards to the primary
    until_ok(lambda: c.put_queue("q", leaseTimeoutSeconds=30))
    ids = [send_until_ok(c, "q", f"m{i}".encode())["id"] for i in range(20)]
    top = view(nodes[p])["appliedLsn"]
    wait_until(lambda: all_applied(nodes, top), 10, what="every node applied the writes")
    views = [view(n) for n in nodes.values()]
    assert sum(1 for v in views if v["role"] == "primary") == 1
    assert {v["epoch"] for v in views} == {epoch}
    assert client(nodes[p]).get_queue("q")["stats"]["sentTotal"] == 20
    # a replica renders the primary's answer (gRPC's doubles) as the primary does: whole seconds as integers
    settings = c.get_queue("q")["settings"]
    assert settings == client(nodes[p]).get_queue("q")["settings"]
    assert all(type(settings[k]) is int for k in ("leaseTimeoutSeconds", "retentionSeconds", "dedupWindowSeconds"))
    d = c.receive("q", wait_s=5)
    assert d.id == ids[0]
    # a replica's own group commits show in its metrics, like the primary's: the
    # replica sent each send at once stored each (--eager-replicas quorum), the
    # other a frame a tick (tests/integration/test_eager_replicas_cluster.py)
    counts = []
    for i in nodes:
        if i == p:
            continue
        with urllib.request.urlopen(nodes[i].http_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        counts.append(next(float(line.split()[-1]) for line in text.splitlines()
                           if line.startswith("spooler_commit_seconds_count")))
    assert max(counts) >= 20 and min(counts) >= 1, counts


def test_sigkill_primary_fails_over_without_loss(cluster):
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q", leaseTimeoutSeconds=60))
    sent = [send_until_ok(c, "q", f"m{i}".encode())["id"] for i in range(30)]
    leased = wait_until(lambda: c.receive("q", wait_s=1), 10, what="a lease")
    nodes[p].kill()
    q, epoch2 = wait_until(lambda: primary_of(nodes, exclude=(p,)), 15, what="a new primary")
    assert q != p and epoch2 > epoch
    c2 = client(nodes[q])
    send_until_ok(c2, "q", b"after")
    st = c2.get_queue("q")["stats"]
    assert st["sentTotal"] == 31  # every 201 survived the primary
    with pytest.raises(errors.StaleLease) as e:
        c2.ack(leased.token)
    assert e.value.reason == "primary_changed"
    # the leased message is visible again with its retry count (after the lease fence)
    again = until_ok(lambda: c2.receive("q", wait_s=1), 10, what="the redelivery")
    assert (again.id, again.retry_count) == (leased.id, 0)
    # the old primary comes back as a replica and catches up
    nodes[p].start()
    top = document(nodes[q])["appliedLsn"]
    wait_until(lambda: (view(nodes[p]) or {}).get("appliedLsn", -1) >= top, 15, what="the old primary catching up")
    assert document(nodes[p])["role"] == "replica"
    assert primary_of(nodes)[0] == q
    got = set()
    while True:
        d = c2.receive("q")
        if d is None:
            break
        got.add(d.id)
        c2.ack(d.token)
    assert set(sent) - {again.id} <= got


def test_a_dead_primarys_leased_message_is_handed_out_by_the_first_receive_after_it(cluster):
    """R3. Right after a primary dies its successor waits out the old leases (R2:
    at most half a failover timeout past the old primary's last contact; the
    replicas see the dead primary's streams break and elect within about 0.1 s,
    so most of that wait comes after the election). A receive that does not
    wait, asked then, of a queue whose messages are visible, is held until the
    successor may lease and hands the message out with its retry count kept
    (API.md: "visible again at once"): never 204 ("nothing became visible"),
    and not 503 either. Without the hold it answered 503 with Retry-After until
    the wait was over (seen: 0.9 s of them with a 2 s failover timeout)."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("dead", leaseTimeoutSeconds=60))
    send_until_ok(c, "dead", b"x")
    leased = wait_until(lambda: c.receive("dead", wait_s=1), 10, what="a lease")
    nodes[p].kill()
    killed_at = time.monotonic()
    q, _ = wait_until(lambda: primary_of(nodes, exclude=(p,)), 15, interval_s=0.01, what="a new primary")
    c2, answers = client(nodes[q]), []
    first_at = time.monotonic() - killed_at  # the first receive's start, after the kill
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            d = c2.receive("dead")
        except errors.Unavailable as e:
            answers.append(("503", e.retry_after_s))
        else:
            answers.append(("200",) if d else ("204",))
            if d:
                break
        time.sleep(0.02)
    took = time.monotonic() - killed_at
    assert answers and answers[-1] == ("200",), answers
    assert ("204",) not in answers, answers
    assert all(a[1] > 0 for a in answers if a[0] == "503"), answers  # each says when to come back
    assert (d.id, d.retry_count) == (leased.id, 0)
    # not sooner than the old primary could still have been leasing: its last contact
    # (at most a heartbeat, FAILOVER_S / 10, before the kill) plus half a failover
    # timeout; a successor that did not wait hands the message out at once
    earliest = FAILOVER_S / 2 - FAILOVER_S / 10 - 0.1
    assert took >= earliest, (took, answers)
    if first_at < earliest:  # asked while the successor surely still waited: held, then answered
        assert answers == [("200",)], (first_at, answers)
    print(f"redelivered {took:.2f} s after the SIGKILL; first asked {first_at:.2f} s after it; answers {answers}")


def _meta(node, key):
    import sqlite3
    db = sqlite3.connect(f"file:{os.path.join(node.data_dir, 'spool.db')}?mode=ro", uri=True, timeout=5)
    try:
        row = db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return row[0] if row else None
    finally:
        db.close()


def test_replicas_persist_the_longest_lease_they_acknowledged(cluster):
    """R2 with different --failover-timeout (DESIGN, "Serving and leasing"): a
    replica's restart stands in for the contact and the vote it lost, with the
    longest lease it acknowledged, which must therefore be on its disk: here the
    primary's half failover timeout (0.5 s), in microseconds."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("ls"))
    send_until_ok(c, "ls", b"x")
    for i, n in nodes.items():
        if i != p:
            assert wait_until(lambda: (_meta(n, "lease_seen_us") or 0) >= 500_000, 10,
                              what=f"{i}'s lease_seen_us") is True
            assert _meta(n, "lease_seen_us") <= 1_000_000


def test_a_vote_is_on_the_voters_disk(cluster):
    """R2: a node persists its epoch and its vote before it answers. After an
    election every node's store holds the epoch, and a majority's holds a vote for
    the primary in that epoch (the sim checks the order; this checks the real store)."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    until_ok(lambda: client(nodes[p]).put_queue("v"))
    seen = []

    def persisted():
        # the primary and epoch as they are now (a loaded machine may have elected again)
        cur = primary_of(nodes)
        votes = [(_meta(n, "repl_epoch"), _meta(n, "voted_for")) for n in nodes.values()]
        seen[:] = [cur, votes]
        if cur is None:
            return None
        q, epoch = cur
        majority = sum(1 for e, v in votes if int(e or 0) == epoch and v == q) >= 2
        # the third node keeps the epoch once it has heard the primary
        return votes if majority and all(int(e or 0) == epoch for e, _ in votes) else None
    try:
        wait_until(persisted, 15, what="a majority's votes and every node's epoch on disk")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen (primary, epoch), [(epoch, vote)]: {seen}") from None


def test_sigstop_primary_is_replaced_and_steps_down(cluster):
    nodes, stopped = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"))
    send_until_ok(c, "q", b"before")
    os.kill(nodes[p].pid, signal.SIGSTOP)
    stopped.add(p)
    q, epoch2 = wait_until(lambda: primary_of(nodes, exclude=(p,)), 15, what="a new primary")
    assert epoch2 > epoch
    send_until_ok(client(nodes[q]), "q", b"during")
    os.kill(nodes[p].pid, signal.SIGCONT)
    stopped.discard(p)
    # the paused primary learns of the new epoch and steps down
    wait_until(lambda: (view(nodes[p]) or {}).get("role") == "replica", 15, what="the old primary stepping down")
    assert primary_of(nodes)[0] == q
    send_until_ok(client(nodes[p]), "q", b"via the old primary")  # now forwarded
    assert client(nodes[q]).get_queue("q")["stats"]["sentTotal"] == 3


def test_a_deposed_primary_that_rejoins_ends_its_own_leases_with_the_count_kept(cluster):
    """R3 on the old primary itself: its leases live in its memory alone, and the
    new epoch's first record, applied once it rejoins, ends them. Promoted back,
    it hands the message out again at once with its retry count unchanged, not
    after the old lease's 60 s with the count raised; the old token is stale
    (primary_changed)."""
    nodes, stopped = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("r3", leaseTimeoutSeconds=60))
    send_until_ok(c, "r3", b"held")
    held = until_ok(lambda: c.receive("r3"), what="the lease on the first primary")
    os.kill(nodes[p].pid, signal.SIGSTOP)
    stopped.add(p)
    q, epoch2 = wait_until(lambda: primary_of(nodes, exclude=(p,)), 15, what="a new primary")
    os.kill(nodes[p].pid, signal.SIGCONT)
    stopped.discard(p)
    wait_until(lambda: (v := view(nodes[p])) and v["role"] == "replica" and v["epoch"] == epoch2, 15,
               what="the old primary to follow the new one")
    top = document(nodes[q])["appliedLsn"]
    wait_until(lambda: (view(nodes[p]) or {}).get("appliedLsn", -1) >= top, 15, what="the old primary to catch up")
    until_ok(lambda: client(nodes[q]).promote(p), what="the switch back")
    wait_until(lambda: (primary_of(nodes) or ("",))[0] == p, 15, what="the old primary to lead again")
    again = until_ok(lambda: client(nodes[p]).receive("r3"), 20, what="the message handed out again")
    assert (again.id, again.body, again.retry_count) == (held.id, b"held", 0), again
    with pytest.raises(errors.StaleLease) as e:
        client(nodes[p]).ack(held.token)
    assert e.value.reason == errors.StaleLease.PRIMARY_CHANGED


def test_planned_switchover(cluster):
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"))
    for i in range(10):
        send_until_ok(c, "q", f"{i}".encode())
    target = next(i for i in nodes if i != p)
    d = c.promote(target)
    # the answer already names the new primary and its epoch (not "primary": null)
    assert d["primary"] == target and d["epoch"] > epoch and d["role"] == "replica"
    new, epoch2 = wait_until(lambda: primary_of(nodes), 10, what="the new primary")
    assert new == target and epoch2 > epoch
    c2 = client(nodes[target])
    send_until_ok(c2, "q", b"after")
    assert c2.get_queue("q")["stats"]["sentTotal"] == 11
    # and back, over gRPC: the epoch trailer is the epoch the answer names
    import grpc
    from spooler.pb import api_pb2, api_pb2_grpc
    with grpc.insecure_channel(nodes[target].grpc_target) as ch:
        info, call = api_pb2_grpc.SpoolerStub(ch).Promote.with_call(
            api_pb2.PromoteRequest(node=p), metadata=(("authorization", f"Bearer {nodes[target].admin_key}"),),
            timeout=15)
    assert info.primary == p and info.epoch > epoch2, info
    assert int(dict(call.trailing_metadata())["spooler-epoch"]) == info.epoch
    assert info.commit_lsn >= 12 and info.applied_lsn >= 12, info  # the lsn fields ride on gRPC too
    # a promote sent to a replica is forwarded; its answer is the same document
    # as the primary's (the lsn fields and the replicas' entries included)
    third = next(i for i in nodes if i not in (p, target))
    wait_until(lambda: primary_of(nodes) == (p, info.epoch), 10, what="the switch back")
    wait_until(lambda: (view(nodes[third]) or {}).get("primary") == p, 10, what="the third node to follow")
    d3 = until_ok(lambda: client(nodes[third]).promote(target), what="a forwarded promote")
    assert d3["primary"] == target and d3["nodeId"] == p and d3["role"] == "replica", d3
    assert set(d3) == set(d) and d3["commitLsn"] >= info.commit_lsn and d3["appliedLsn"] >= info.applied_lsn, d3
    assert next(n for n in d3["nodes"] if n["id"] == p)["lsn"] >= d3["appliedLsn"]  # its own entry, as at home


HANDOVER_FAILOVER_S = 6.0


def _readyz(n):
    try:
        with urllib.request.urlopen(n.http_url + "/readyz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _drain(c, queue) -> dict:
    """Receive and ack until the queue answers empty: {message id: retry count}."""
    got = {}
    while True:
        d = until_ok(lambda: c.receive(queue) or "none", what="a receive")
        if d == "none":
            return got
        got[d.id] = d.retry_count
        c.ack(d.token)


def _sent_and_caught_up(nodes) -> tuple:
    """20 messages confirmed in queue "q", and every member holding them:
    (primary, its epoch, the messages' ids)."""
    p, epoch = wait_until(lambda: primary_of(nodes), 30, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"))
    sent = {send_until_ok(c, "q", f"m{i}".encode())["id"] for i in range(20)}
    top = view(nodes[p])["commitLsn"]
    wait_until(lambda: all_applied(nodes, top), 10, what="every member caught up")
    return p, epoch, sent


def test_a_primary_told_to_stop_hands_over_first(tmp_path):
    """SIGTERM on the primary: it switches over to the member with the most of the
    log before it stops (Driver.hand_over), so its successor hands out
    messages at once. Without the handover the successor is elected as soon as the
    old primary's streams end, but first waits out the old primary's lease: about
    half the failover timeout (3 s here; 1.0 s measured with the default 2 s).
    Nothing confirmed is lost, and the old primary's leases are stale as after any
    primary change."""
    nodes = start_cluster(str(tmp_path), 3, HANDOVER_FAILOVER_S)
    try:
        p, epoch = wait_until(lambda: primary_of(nodes), 30, what="a primary")
        c = client(nodes[p])
        until_ok(lambda: c.put_queue("q", leaseTimeoutSeconds=60))
        sent = {send_until_ok(c, "q", f"m{i}".encode())["id"] for i in range(20)}
        leased = c.receive("q")
        others = {i: client(nodes[i]) for i in nodes if i != p}

        def receive_anywhere():
            for o in others.values():
                try:
                    m = o.receive("q")
                except (errors.Unavailable, errors.OperationUnconfirmed):
                    continue
                if m is not None:
                    return m
            return None

        t0 = time.monotonic()
        nodes[p].proc.send_signal(signal.SIGTERM)
        first = wait_until(receive_anywhere, 20, interval_s=0.01, what="a delivery after the stop")
        took = time.monotonic() - t0
        assert nodes[p].proc.wait(20) == 0
        # it exits as soon as it has handed over: the stream its successor opened to
        # it ends (Driver.end_inbound) instead of holding the gRPC server's stop
        # for its grace period (1 s; 1.1 s from SIGTERM to exit was measured then)
        after = time.monotonic() - t0 - took
        assert after < 0.7, f"exited {after:.2f} s after its successor's first delivery"
        log = nodes[p].read_log()
        q, epoch2 = primary_of(nodes, exclude=(p,))
        assert epoch2 > epoch and f"handed over to {q}" in log, log[-3000:]
        # half the lease wait the handover saves (a handover takes tens of ms; a
        # review measured 0.6 s with the test VFS holding each fsync for 100 ms)
        assert took < HANDOVER_FAILOVER_S / 4, f"first delivery {took:.2f} s after SIGTERM"
        c2 = others[q]
        with pytest.raises(errors.StaleLease) as e:
            c2.ack(leased.token)
        assert e.value.reason == "primary_changed"
        c2.ack(first.token)
        got = {first.id: first.retry_count, **_drain(c2, "q")}
        assert set(got) == sent and set(got.values()) == {0}  # the stale lease's message too, uncounted
        assert c2.get_queue("q")["stats"]["sentTotal"] == 20
    finally:
        for n in nodes.values():
            n.kill()


def test_a_stopping_primary_whose_successor_hangs_stops_anyway_and_loses_nothing(tmp_path):
    """The member a stopping primary would hand over to is hung (SIGSTOP): the
    handover is given up after HANDOVER_WAIT_S (1 s), not after a failover timeout,
    and the primary exits. Once the hung member is back, it and the third elect a
    primary, and every confirmed message is there."""
    nodes = start_cluster(str(tmp_path), 3, HANDOVER_FAILOVER_S)
    stopped = None
    try:
        p, epoch, sent = _sent_and_caught_up(nodes)
        stopped = min(i for i in nodes if i != p)  # caught up like the other: the lowest id is the target
        os.kill(nodes[stopped].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        nodes[p].proc.send_signal(signal.SIGTERM)
        # not ready from the stop's start: while it still waits for its target,
        # its log does not yet say it gave up
        wait_until(lambda: _readyz(nodes[p]) != 200, 10, interval_s=0.01, what="/readyz 503")
        assert "stopping without a handover" not in nodes[p].read_log()
        assert nodes[p].proc.wait(20) == 0
        took = time.monotonic() - t0
        log = nodes[p].read_log()
        assert f"stopping without a handover to {stopped}" in log, log[-3000:]
        # the wait is HANDOVER_WAIT_S (1 s), then the stop's own few tenths; waiting
        # for the failover timeout instead would be 6 s
        assert took < 3.5, f"exited {took:.2f} s after SIGTERM"
        os.kill(nodes[stopped].pid, signal.SIGCONT)
        stopped = None
        q, epoch2 = wait_until(lambda: primary_of(nodes, exclude=(p,)), 30, what="a new primary")
        assert epoch2 > epoch
        assert set(_drain(client(nodes[q]), "q")) == sent
    finally:
        if stopped is not None:
            os.kill(nodes[stopped].pid, signal.SIGCONT)
        for n in nodes.values():
            n.kill()


def test_every_member_told_to_stop_at_once_stops_at_once_and_loses_nothing(tmp_path):
    """`make cluster`'s Ctrl-C: SIGTERM to all three at once. The replicas end
    their inbound streams (Driver.end_inbound) instead of holding their gRPC
    server's stop for its grace period (1 s): each exits within 0.7 s. The
    primary's handover target is stopping too, so its stream breaks, and the
    primary gives it up and tries the next, which is gone as well, instead of
    waiting out the handover's bound for it (3 s here; 1 s by default). If
    TimeoutNow reached the target just before its own stop, the primary steps
    down for its campaign and waits at most HANDOVER_HEAR_S (0.5 s) more: it
    exits within 1.5 s either way. Before both, every node exited 1.07 to 1.19 s
    after SIGTERM with the default bound. On restart every confirmed message is
    there."""
    nodes = start_cluster(str(tmp_path), 3, HANDOVER_FAILOVER_S, env={"SPOOLER_TEST_HANDOVER_WAIT": "3"})
    try:
        p, epoch, sent = _sent_and_caught_up(nodes)
        t0 = time.monotonic()
        for n in nodes.values():
            n.proc.send_signal(signal.SIGTERM)
        took = {}
        deadline = t0 + 20
        while len(took) < len(nodes) and time.monotonic() < deadline:
            for i, n in nodes.items():
                if i not in took and n.proc.poll() is not None:
                    took[i] = time.monotonic() - t0
            time.sleep(0.005)
        assert len(took) == len(nodes), took
        for n in nodes.values():
            assert n.proc.returncode == 0, n.read_log()[-3000:]
        log = nodes[p].read_log()
        assert "did not catch up" not in log, log[-3000:]
        assert took[p] < 1.5 and all(t < 0.7 for i, t in took.items() if i != p), (p, took)
        for n in nodes.values():
            n.restart()
        q, _ = wait_until(lambda: primary_of(nodes), 30, what="a primary after the restart")
        assert set(_drain(client(nodes[q]), "q")) == sent
    finally:
        for n in nodes.values():
            n.kill()


def test_a_switchover_that_does_not_happen_is_not_a_200(cluster):
    """A promote whose target cannot take over (it is down) ends unavailable, with
    the primary unchanged and serving again; a 200 would read as success."""
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"))
    target = next(i for i in nodes if i != p)
    nodes[target].kill()
    with pytest.raises(errors.Unavailable) as e:
        c.promote(target)
    assert target in str(e.value) and f"{p} is primary" in str(e.value)
    assert primary_of(nodes) == (p, epoch)  # no election: the target never got TimeoutNow
    send_until_ok(c, "q", b"still served")  # it took writes again once the attempt ended
    # and from spoolctl: an error and a non-zero exit, not "primary is now ..."
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "spooler", "--server", nodes[p].http_url, "--key",
                        nodes[p].admin_key, "cluster", "promote", target], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unavailable" in (r.stdout + r.stderr), (r.returncode, r.stdout, r.stderr)


def test_a_minority_confirms_nothing(cluster):
    """Two of three nodes gone: the survivor answers unavailable (or, for a write
    already in flight, operation_unconfirmed) and never 201."""
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"))
    send_until_ok(c, "q", b"before")
    for i, n in nodes.items():
        if i != p:
            n.kill()

    def refused():
        try:
            c.send("q", b"during")
        except errors.Unavailable:
            return True
        except errors.OperationUnconfirmed:  # a write that went out while it still served
            return False
        return False
    wait_until(refused, 15, what="the lone primary to refuse writes outright")
    # past the failover timeout it knows it has no majority: every write is refused
    # at once as unavailable (known not accepted), none left to time out unconfirmed
    for _ in range(5):
        with pytest.raises(errors.Unavailable):
            c.send("q", b"during")
    with pytest.raises(errors.Unavailable):
        c.receive("q")  # and it hands out no leases
    # and it steps down: no longer primary by its own account (not only refusing)
    wait_until(lambda: (v := view(nodes[p])) and v["role"] != "primary", 15, what="the lone primary to step down")
    assert primary_of(nodes) is None


def test_a_cut_off_primary_leases_nothing_while_the_new_one_leases(tmp_path):
    """The primary is cut off from both replicas (fault proxy, every link reset)
    while a client talking to it directly keeps asking it for messages. Once the
    new primary (elected by the other two, holding the same messages) has leased,
    and in any case past a failover timeout from the cut, every such receive is
    refused 503 and none leases: the two never hand out leases at the same time
    (the drills' "leases behind a newer epoch"). Then the old primary says it is
    no longer primary. Without the majority-contact checks (serving, leasing,
    the step-down) it went on leasing after the new primary had leased. (The
    partition drill does not show this: no drill client need reach the old
    primary while it is cut off.)"""
    from tests.drills.cluster import Cluster

    with Cluster(str(tmp_path / "c"), failover_timeout_s=FAILOVER_S, partitions=True) as c:
        old = c.primary()
        on_old = HttpClient(c.url(old), c.admin_key, timeout_s=5)
        until_ok(lambda: on_old.put_queue("cut", leaseTimeoutSeconds=60), what="the queue")
        for i in range(40):  # more than the old primary can lease before it stops
            send_until_ok(on_old, "cut", b"m%d" % i)
        c.wait_converged()
        c.proxy.isolate(old, "drop")
        cut_at = time.monotonic()  # (the links are reset when isolate returns)
        answers: list = []  # (asked, s after the cut; the old primary's answer; asked after the new one leased)
        new: dict = {}      # when the new primary first leased

        def step():
            asked = time.monotonic()
            try:
                d = on_old.receive("cut")
                got = f"leased {d.id}" if d else "nothing"
            except errors.Unavailable:
                got = "unavailable"
            except errors.SpoolerError as e:
                got = type(e).__name__
            answers.append((round(asked - cut_at, 2), got, asked > new.get("leased", float("inf"))))
            if "leased" not in new:
                cp = c.current_primary(timeout_s=0.5)
                if cp and cp[0] != old:
                    try:  # (it waits out the old primary's leases first: 503 meanwhile)
                        if HttpClient(c.url(cp[0]), c.admin_key, timeout_s=5).receive("cut"):
                            new["leased"] = time.monotonic()
                    except errors.Unavailable:
                        pass
            return "leased" in new and sum(1 for a in answers if a[0] > FAILOVER_S and a[2]) >= 10
        wait_until(step, 40, interval_s=0.1, what="the new primary to lease, and ten receives on the old one after")
        late = [a for a in answers if a[2] or a[0] > FAILOVER_S]
        assert late and all(got == "unavailable" for _, got, _ in late), answers
        wait_until(lambda: (v := c.info(old)) and v["role"] != "primary", 10, what="the old primary to step down")
        c.proxy.heal()


def test_a_cut_off_primary_stops_renewing_when_it_stops_leasing(tmp_path):
    """A renewal is lease time granted without a log record, so a primary cut
    off from both replicas (fault proxy) must stop renewing when it stops
    leasing: half a failover timeout after its majority's last contact, not
    when it stops serving writes, a whole timeout after. Renewals of a lease it
    granted before the cut are asked every 0.1 s; every one asked past half a
    failover timeout from the cut is refused 503 (a successor's wait for the
    old leases counts on that margin). Without the gate in
    ``Service._renewed`` those in the second half of the timeout were renewed."""
    from tests.drills.cluster import Cluster

    timeout_s = 4.0  # a second half long enough to ask in, on a loaded machine
    with Cluster(str(tmp_path / "c"), failover_timeout_s=timeout_s, partitions=True) as c:
        old = c.primary()
        on_old = HttpClient(c.url(old), c.admin_key, timeout_s=5)
        until_ok(lambda: on_old.put_queue("held", leaseTimeoutSeconds=60), what="the queue")
        send_until_ok(on_old, "held", b"m")
        d = until_ok(lambda: on_old.receive("held"), what="a lease")
        c.wait_converged()
        c.proxy.isolate(old, "drop")
        cut_at = time.monotonic()  # (the links are reset when isolate returns)
        answers: list = []  # (asked, s after the cut; the answer)

        def step():
            asked = time.monotonic() - cut_at
            try:
                on_old.renew(d.token)
                got = "renewed"
            except errors.Unavailable:
                got = "unavailable"
            except errors.SpoolerError as e:
                got = type(e).__name__
            answers.append((round(asked, 2), got))
            return asked > timeout_s
        wait_until(step, 30, interval_s=0.1, what="renewals for a failover timeout after the cut")
        assert sum(1 for t, _ in answers if timeout_s / 2 < t < timeout_s) >= 3, answers  # the window was tried
        assert all(got == "unavailable" for t, got in answers if t > timeout_s / 2), answers
        c.proxy.heal()


def test_the_cluster_document_says_how_long_ago_each_member_was_heard(cluster):
    """On the primary each replica's entry has lastContactMs (its latest
    acknowledgement), on a replica the primary's entry has it; a killed replica's
    figure grows while the live one's stays fresh, and spoolctl prints both."""
    import subprocess
    import sys
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    gone, live = [i for i in nodes if i != p]

    def heard(of, at):
        v = view(nodes[at])
        return v and next(n for n in v["nodes"] if n["id"] == of).get("lastContactMs", "absent")

    fresh_ms = FAILOVER_S * 1e3  # heartbeats come far more often than the failover timeout
    def fresh(of, at):
        h = heard(of, at)
        return isinstance(h, float) and h < fresh_ms
    wait_until(lambda: fresh(gone, p) and fresh(live, p), 10, what="both replicas heard by the primary")
    # On a replica that follows the primary, the primary's entry says how long ago
    # it was heard; its own entry says nothing of contact, nor the other replica's
    # (they exchange nothing while a primary serves: "unreachable" there would be
    # false). All three read from one document of a replica that names the primary:
    # one that knows none (elected a moment ago, the primary's first frame not in
    # yet; or after a stall of a failover timeout) lists every member with a figure,
    # and says so ("primary": null): read unchecked, that failed this test once
    # under CI's load, and the one failure before it read the same way.
    def following():
        v = view(nodes[live])
        if not v or v["primary"] != p:
            return None
        entry = {n["id"]: n.get("lastContactMs", "absent") for n in v["nodes"]}
        return (v, entry) if isinstance(entry[p], float) and entry[p] < fresh_ms else None
    v, entry = wait_until(following, 10, what="a replica following the primary, which it heard lately")
    assert entry[live] == "absent" and entry[gone] == "absent", v
    nodes[gone].kill()
    def silent():
        h = heard(gone, p)  # (None while a view fails under load: poll again)
        return isinstance(h, float) and h > 2 * fresh_ms
    wait_until(silent, 10, what="the killed replica's silence to show")
    wait_until(lambda: fresh(live, p), 10, what="the live replica still heard")
    out = subprocess.run([sys.executable, "-m", "spooler", "--server", nodes[p].http_url, "--key",
                          nodes[p].admin_key, "cluster", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.split()[0] == gone)
    assert float(line.split("heard ")[1].split(" s ago")[0]) >= 2 * FAILOVER_S, out.stdout


def test_every_node_says_which_members_it_cannot_reach_in_its_document_and_metrics(cluster):
    """After a SIGKILL of the primary the new primary listed the dead one as
    "replica, never heard", and with no quorum the survivor listed every member
    with no figure at all: nothing said "down". Each member's entry now says
    whether this node heard it within the failover timeout (``reachable``, from
    any call they exchanged), and /metrics says the same (with whether a
    primary is known) for alerting."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")

    def reach(at):
        v = view(nodes[at])
        return v and {n["id"]: n.get("reachable") for n in v["nodes"]}

    def metric(at, line):
        req = urllib.request.Request(nodes[at].http_url + "/metrics",
                                     headers={"Authorization": f"Bearer {nodes[at].admin_key}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return line in resp.read().decode().splitlines()

    others = [i for i in nodes if i != p]
    wait_until(lambda: reach(p) == {p: None, others[0]: True, others[1]: True}, 10, what="both replicas reachable")
    wait_until(lambda: reach(others[0]) == {p: True, others[0]: None, others[1]: None}, 10,
               what="a replica to judge its primary alone")
    assert metric(p, "spooler_is_primary 1.0") and metric(p, "spooler_primary_known 1.0")
    assert metric(p, f'spooler_member_reachable{{member="{others[0]}"}} 1.0')
    nodes[p].kill()
    q, _ = wait_until(lambda: primary_of(nodes, exclude=(p,)), 15, what="a new primary")
    wait_until(lambda: (reach(q) or {}).get(p) is False, 10, what="the new primary to call the old one unreachable")
    assert metric(q, f'spooler_member_reachable{{member="{p}"}} 0.0')
    r = next(i for i in others if i != q)
    assert (reach(q) or {}).get(r) is True
    nodes[q].kill()
    # the survivor has no primary and no quorum: both others unreachable, no primary known
    wait_until(lambda: (reach(r) or {}) == {p: False, q: False, r: None}, 15, what="the survivor to see both gone")
    wait_until(lambda: metric(r, "spooler_primary_known 0.0"), 10, what="the survivor to stop naming a primary")
    assert metric(r, "spooler_is_primary 0.0")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "spooler", "--server", nodes[r].http_url, "--key",
                          nodes[r].admin_key, "cluster", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sum("UNREACHABLE" in x for x in out.stdout.splitlines()) == 2, out.stdout


def test_a_replica_left_alone_is_not_ready_and_forwards_nothing(cluster):
    """The primary and the other replica gone: within a failover timeout the survivor
    stops naming the dead primary, answers /readyz 503 and every call 503 unavailable
    (with Retry-After), never 500 and never a 200 'ready' behind a primary it cannot reach."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"))
    send_until_ok(c, "q", b"before")
    r = next(i for i in nodes if i != p)
    wait_until(lambda: (view(nodes[r]) or {}).get("primary") == p, 10, what="the replica to follow the primary")
    for i, n in nodes.items():
        if i != r:
            n.kill()

    lone = Api(nodes[r].http_url, nodes[r].admin_key)
    wait_until(lambda: lone.req("GET", "/readyz", key=None).status == 503, 10,
               what="the lone replica to stop calling itself ready")
    # and the gRPC health status says the same, for load balancers that ask it
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(nodes[r].grpc_target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                   == health_pb2.HealthCheckResponse.NOT_SERVING, 5, what="gRPC health to say NOT_SERVING")
    assert document(nodes[r])["primary"] is None
    for method, path, body in (("POST", "/v1/queues/q/messages", b"during"), ("PUT", "/v1/queues/q2", b"{}"),
                               ("GET", "/v1/queues/q", b"")):
        resp = lone.req(method, path, body)  # invariants: an unavailable carries Retry-After
        assert resp.status == 503 and resp.json()["kind"] == "unavailable", (method, path, resp)
        assert float(resp.h("Retry-After")) > 0, resp
    # a key it does not know may be one the primary created a moment ago: with no
    # primary to ask, that is "not now" (503), not "unknown key" (401)
    resp = lone.req("GET", "/v1/queues/q", key="spk_0123456789ab_not-replicated-here")
    assert resp.status == 503, resp
    # a malformed request is malformed on every node, primary or not: 400 at once,
    # never a Retry-After for something that can never succeed
    token = "AQAAAAAAAAABAAAAAAAAAAHQMgCfbuIycXVldWU"
    for method, path, body, headers in (
            ("POST", "/v1/queues/bad%2F/messages", b"x", {}),
            ("POST", "/v1/queues/q/messages", b"x", {"Spooler-Dedup-Key": "a\tb"}),
            ("POST", "/v1/queues/q/messages", b"x" * (256 * 1024 + 1), {}),
            ("POST", "/v1/queues/bad%2F/receive", b"", {}),
            ("POST", "/v1/leases/abc/renew", b"", {}),
            ("POST", f"/v1/leases/{token}!!/ack", b"", {}),
            ("POST", f"/v1/leases/{token}*/nack", b"", {}),
            ("POST", "/v1/queues/q/messages", b"abc", {"Content-Encoding": "gzip"})):
        resp = lone.req(method, path, body, headers)
        assert resp.status in (400, 413) and resp.json()["kind"] in ("invalid_argument", "message_too_large"), \
            (path, headers, resp)


def test_a_replica_refuses_malformed_keys_and_promotes_as_the_primary_does(cluster):
    """Forwarding must not change an answer: a malformed body is 400 on a replica as on
    the primary (never a 500, never a key silently widened to every queue)."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    r = next(i for i in nodes if i != p)
    wait_until(lambda: (view(nodes[r]) or {}).get("primary") == p, 10, what="the replica to follow the primary")
    bad = [("/v1/keys", {"queue": 5, "scopes": ["send"]}), ("/v1/keys", {"queue": None, "scopes": ["send"]}),
           ("/v1/keys", {"queue": "", "scopes": ["send"]}), ("/v1/keys", {"queue": "q", "scopes": [5]}),
           ("/v1/keys", {"queue": "q", "scopes": "send"}), ("/v1/cluster/promote", {"node": 5}),
           ("/v1/cluster/promote", {"node": "nobody"})]
    for node in (p, r):
        api = Api(nodes[node].http_url, nodes[node].admin_key)
        for path, body in bad:
            resp = api.req("POST", path, json.dumps(body).encode())
            assert resp.status == 400 and resp.json()["kind"] == "invalid_argument", (node, path, body, resp)
    keys = nodes[p].get("/v1/keys")[1]["keys"]
    assert keys == [], keys  # nothing was created on the way
    # JSON's 2.0 is the integer 2 on a replica as on the primary (it was a 500 there)
    for node, name in ((p, "float-p"), (r, "float-r")):
        resp = Api(nodes[node].http_url, nodes[node].admin_key).put_queue(name, {"maxRetries": 2.0})
        assert resp.status == 201 and resp.json()["settings"]["maxRetries"] == 2, (node, resp)
    # the cluster document is answered by each node itself, but a key the replica
    # does not know is still checked (by the primary): 401, as on the primary
    for node in (p, r):
        resp = Api(nodes[node].http_url, nodes[node].admin_key).req("GET", "/v1/cluster",
                                                                     key="spk_0123456789ab_made-up")
        assert resp.status == 401 and resp.json()["kind"] == "unauthenticated", (node, resp)
        # a key gRPC could not carry to the primary is nobody's: 401 on the replica too, not a 500
        for odd in ("caf\u00e9", "x\tx"):
            resp = Api(nodes[node].http_url, nodes[node].admin_key).req("GET", "/v1/queues", key=odd)
            assert resp.status == 401 and resp.json()["kind"] == "unauthenticated", (node, odd, resp)
        # a bad key is a 401 before any check of the request's form, on every node
        # (a replica used to answer these 400, telling a caller with no key that node
        # "nobody" does not exist)
        api = Api(nodes[node].http_url, nodes[node].admin_key)
        for method, path, body in [("PUT", "/v1/queues/q", {"bogus": 1}), ("POST", "/v1/cluster/promote",
                                   {"node": "nobody"}), ("POST", "/v1/leases/abc/ack", None)] + \
                [("POST", path, body) for path, body in bad]:
            resp = api.req(method, path, None if body is None else json.dumps(body).encode(),
                           key="spk_0123456789ab_made-up")
            assert resp.status == 401 and resp.json()["kind"] == "unauthenticated", (node, path, body, resp)
    scoped = Api(nodes[p].http_url, nodes[p].admin_key).req(
        "POST", "/v1/keys", json.dumps({"queue": "q", "scopes": ["send"]}).encode()).json()["key"]
    resp = wait_until(lambda: (lambda x: x if x.status == 200 else None)(
        Api(nodes[r].http_url, nodes[r].admin_key).req("GET", "/v1/cluster", key=scoped)), 10,
        what="the replica to answer a scoped key's cluster call")
    assert resp.json()["nodeId"] == r  # the replica's own view


def test_sdk_with_every_node_follows_the_cluster(cluster):
    """The SDK given every node's address keeps working when the node it talks to dies."""
    from spooler import Client
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    order = [p] + [i for i in nodes if i != p]  # start on the primary, then lose it
    targets = ",".join(nodes[i].grpc_target for i in order)
    with Client(targets, nodes[p].admin_key, timeout_s=5) as c:
        until_ok(lambda: c.put_queue("q"))
        first = until_ok(lambda: c.send("q", b"one"))
        nodes[p].kill()
        second = until_ok(lambda: c.send("q", b"two"), 20)
        assert c.target_now() != nodes[p].grpc_target
        st = until_ok(lambda: c.get_queue("q"))["stats"]
        assert st["sentTotal"] == 2 and first.id != second.id


def test_a_replica_told_to_stop_ends_its_forwarded_long_polls_as_unavailable(cluster):
    """SIGTERM on a replica: long polls it forwarded to the primary end at once as
    unavailable, with the kind (and over gRPC the epoch) that sends the client to
    another node, not as a bare CANCELLED when the server's grace runs out; and
    the replica exits soon after."""
    import threading
    import time
    import grpc
    from contract_client import Api
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    r = next(i for i in nodes if i != p)
    wait_until(lambda: (view(nodes[r]) or {}).get("primary") == p, 10, what="the replica to follow the primary")
    until_ok(lambda: client(nodes[p]).put_queue("lp"))
    api = Api(nodes[r].http_url, nodes[r].admin_key)
    out = {}

    def poll():
        out["resp"] = api.receive("lp", wait=20)
    th = threading.Thread(target=poll)
    th.start()
    ch, g = _grpc_long_poll(nodes[r], "lp")
    try:
        wait_until(lambda: nodes[p].metric("spooler_receives_waiting") >= 2, 10, what="both forwarded polls to wait")
        t = time.monotonic()
        nodes[r].proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as e:
            g.result()
        trailers = dict(e.value.trailing_metadata() or ())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (e.value.code(), e.value.details())
        assert trailers.get("spooler-error-kind") == "unavailable" and trailers.get("spooler-epoch"), trailers
        th.join(15)
        assert not th.is_alive()
        resp = out["resp"]
        assert resp.status == 503 and resp.json()["kind"] == "unavailable", resp
        assert nodes[r].proc.wait(timeout=15) == 0
        assert time.monotonic() - t < 10, "the replica took its whole grace and more to stop"
    finally:
        ch.close()
        th.join(25)


def _grpc_long_poll(node, queue):
    """A 20 s gRPC Receive on ``node``, under way: (channel, future)."""
    import grpc
    from spooler.pb import api_pb2, api_pb2_grpc
    ch = grpc.insecure_channel(node.grpc_target)
    md = (("authorization", f"Bearer {node.admin_key}"),)
    return ch, api_pb2_grpc.SpoolerStub(ch).Receive.future(api_pb2.ReceiveRequest(queue=queue, wait_seconds=20),
                                                           metadata=md, timeout=30)


def _long_poll(api, queue, out):
    import threading

    def poll():
        t = time.monotonic()
        out["resp"] = api.receive(queue, wait=20)
        out["after_s"] = time.monotonic() - t
    th = threading.Thread(target=poll)
    th.start()
    return th


def test_long_polls_on_a_primary_that_steps_down_end_at_once(cluster):
    """A promote moves the primary: long polls waiting on the old one answer
    unavailable (the client moves on) then, not when their 20 s run out."""
    import grpc
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    target = next(i for i in nodes if i != p)
    until_ok(lambda: client(nodes[p]).put_queue("lp"))
    wait_until(lambda: all_applied(nodes, view(nodes[p])["appliedLsn"]), 10, what="replicas caught up")
    out = {}
    th = _long_poll(Api(nodes[p].http_url, nodes[p].admin_key), "lp", out)
    ch, g = _grpc_long_poll(nodes[p], "lp")
    try:
        wait_until(lambda: nodes[p].metric("spooler_receives_waiting") >= 2, 10, what="both polls to wait")
        t = time.monotonic()
        client(nodes[p]).promote(target)
        with pytest.raises(grpc.RpcError) as e:
            g.result()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (e.value.code(), e.value.details())
        th.join(25)
        assert out["resp"].status == 503 and out["resp"].json()["kind"] == "unavailable", out["resp"]
        assert time.monotonic() - t < 10, "the long polls waited out their 20 s on a node no longer primary"
    finally:
        ch.close()
        th.join(25)


def test_long_polls_on_a_primary_that_loses_its_majority_end_at_once(cluster):
    """Cut off from both replicas (SIGSTOP), the primary stops serving after the
    failover timeout: its long polls answer unavailable then, not after 20 s."""
    nodes, stopped = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    until_ok(lambda: client(nodes[p]).put_queue("lp"))
    out = {}
    th = _long_poll(Api(nodes[p].http_url, nodes[p].admin_key), "lp", out)
    try:
        wait_until(lambda: nodes[p].metric("spooler_receives_waiting") >= 1, 10, what="the poll to wait")
        for i in nodes:
            if i != p:
                stopped.add(i)
                os.kill(nodes[i].pid, signal.SIGSTOP)
        th.join(25)
        assert out["resp"].status == 503 and out["resp"].json()["kind"] == "unavailable", out["resp"]
        assert out["after_s"] < 12, f"answered after {out['after_s']:.1f} s: the poll waited out its 20 s"
    finally:
        th.join(25)


def test_a_replica_answers_an_unknown_settle_action_as_the_primary_does(cluster):
    """A settle item with an action number the contract does not know reaches the
    primary through a replica as it came: the same per-item error, in the same words."""
    import grpc

    from spooler.pb import api_pb2, api_pb2_grpc
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    r = next(i for i in nodes if i != p)
    wait_until(lambda: (view(nodes[r]) or {}).get("primary") == p, 10, what="the replica to follow the primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("ua"))
    send_until_ok(c, "ua", b"x")
    token = c.receive("ua").token
    answers = {}
    for node in (p, r):
        with grpc.insecure_channel(nodes[node].grpc_target) as ch:
            resp = api_pb2_grpc.SpoolerStub(ch).SettleBatch(
                api_pb2.SettleBatchRequest(items=[api_pb2.SettleBatchRequest.Item(token=token, action=7)]),
                metadata=(("authorization", f"Bearer {nodes[node].admin_key}"),), timeout=10)
        (item,) = resp.results
        answers[node] = (item.error.kind, item.error.message)
    assert answers[p] == answers[r], answers
    assert answers[p][0] == "invalid_argument" and "7" in answers[p][1], answers
    # the lease is untouched: an ack still works
    c.ack(token)


def test_a_replica_passes_on_how_long_the_primarys_leases_last(cluster):
    """Receive and renew through a replica: the SDK hears the primary's lease length
    (lease_seconds_left), which it times renewals by, and not a zero."""
    from spooler import Client
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    r = next(i for i in nodes if i != p)
    wait_until(lambda: (view(nodes[r]) or {}).get("primary") == p, 10, what="the replica to follow the primary")
    with Client(nodes[r].grpc_target, nodes[r].admin_key, timeout_s=5) as c:
        until_ok(lambda: c.put_queue("ll", leaseTimeoutSeconds=7))
        until_ok(lambda: c.send("ll", b"x"))
        [m] = until_ok(lambda: c.receive("ll", wait_s=5))
        assert 6.5 < m.expires_at.left_s <= 7.0, m.expires_at.left_s
        renewed = c.renew(m.token)
        assert 6.5 < renewed.left_s <= 7.0 and renewed.deadline is not None
        [out] = c.settle_batch([(m.token, "renew", 0.0)])
        assert 6.5 < out.left_s <= 7.0
        c.ack(m.token)


def test_a_replacement_on_an_empty_store_votes_only_once_it_holds_the_clusters_history(cluster, tmp_path):
    """docs/operations.md, "Replace a node". A replica A is down while a write is
    confirmed by the primary P and the other replica B. Then B's disk is lost and P
    crashes. A comes back on its own (stale) store and B's replacement starts on an
    empty one with --join. Had the replacement voted, A would be elected with the
    confirmed write missing; it does not vote, so nobody is primary until P is back,
    nothing confirmed is lost, and the replacement then joins and votes again."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    a, b = [i for i in nodes if i != p]
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"))
    send_until_ok(c, "q", b"before")
    top = view(nodes[p])["commitLsn"]
    wait_until(lambda: all((view(nodes[i]) or {}).get("appliedLsn", -1) >= top for i in (a, b)), 15,
               what="both replicas caught up")
    nodes[a].kill()
    send_until_ok(c, "q", b"confirmed while A was down")
    nodes[b].kill()
    nodes[p].kill()
    nodes[b].data_dir = str(tmp_path / "b-replacement")  # an empty store, as after a lost disk
    nodes[b].extra_args.append("--join")
    nodes[a].start()
    nodes[b].start()
    assert next(n for n in document(nodes[b])["nodes"] if n["id"] == b).get("joining") is True
    # five failover timeouts without a primary: A never gets the replacement's vote
    deadline = time.monotonic() + 5 * FAILOVER_S
    while time.monotonic() < deadline:
        assert primary_of(nodes, exclude=(p,)) is None, "elected without the confirmed write"
        time.sleep(0.05)

    nodes[p].start()
    q, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary once P is back")
    assert until_ok(lambda: client(nodes[q]).get_queue("q"))["stats"]["sentTotal"] == 2  # nothing confirmed lost
    me = lambda: next(n for n in (view(nodes[b]) or {"nodes": []})["nodes"] if n["id"] == b)  # noqa: E731
    wait_until(lambda: "joining" not in me(), 15, what="the replacement joining")
    # it votes again: without the primary, the other two elect one of themselves
    nodes[q].kill()
    r, _ = wait_until(lambda: primary_of(nodes, exclude=(q,)), 15, what="a primary elected with its vote")
    assert until_ok(lambda: client(nodes[r]).get_queue("q"))["stats"]["sentTotal"] == 2


def test_the_cluster_document_names_only_the_contracts_two_roles():
    """A node that is campaigning is a candidate inside; API.md knows "primary"
    and "replica" only, at the top and for every node."""
    from types import SimpleNamespace

    from node.core import replication as R
    from node.replication.driver import Driver
    d = Driver(SimpleNamespace(), "n1", {"n1": "h1:1", "n2": "h2:1", "n3": "h3:1"}, 1.0)
    for role, primary in ((R.CANDIDATE, None), (R.REPLICA, "n2"), (R.PRIMARY, "n1")):
        d.core.role, d.core.primary = role, primary
        doc = d.status()
        roles = {n["id"]: n["role"] for n in doc["nodes"]}
        assert set(roles.values()) <= {"primary", "replica"} and doc["role"] in ("primary", "replica")
        assert [i for i, r in roles.items() if r == "primary"] == ([primary] if primary else [])


def test_batches_too_large_for_one_frame_together_replicate_without_a_failover(tmp_path):
    """Four concurrent send batches of 8 MiB each (each within the limits): their
    records together are more than one 16 MiB node-to-node message may carry. They
    go to the replicas as several frames: every batch is confirmed, the primary
    stays, and every node applies them (one frame of all of them failed on every
    send, broke the stream again and again and deposed the primary).

    The failover timeout is 5 s here, not 2: 32 MiB written and fsync'd on three
    nodes can hold a node's event loop for seconds on a loaded machine (seen in a
    full run beside a 100-seed drill: the primary, past 2 s without a majority's
    answer, stepped down and left every batch unconfirmed). A stream that breaks
    on every frame still deposes the primary at 5 s, and fails the test."""
    import asyncio
    from spooler import AsyncClient

    nodes = start_cluster(str(tmp_path), 3, 5.0)
    try:
        p, epoch = wait_until(lambda: primary_of(nodes), 30, what="a primary")
        body, n_bodies = b"x" * (256 * 1024), 32   # 8 MiB: the send batch limit

        # (the queue first, retried while the new primary opens its epoch; the sends
        # below are not retried, so that each batch's own outcome shows)
        until_ok(lambda: client(nodes[p]).put_queue("big"))

        async def main():
            async with AsyncClient(nodes[p].grpc_target, nodes[p].admin_key, timeout_s=30, retry_attempts=1) as c:
                return await asyncio.gather(*[c.send_batch("big", [body] * n_bodies) for _ in range(4)],
                                            return_exceptions=True)

        results = asyncio.run(main())
        outcomes = [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else len(r) for r in results]
        if outcomes != [n_bodies] * 4:
            # (the nodes' logs say why; printed whole, as an assertion's message is cut short)
            for i, n in nodes.items():
                print(f"---- log of {i}\n{n.read_log()}")
        assert outcomes == [n_bodies] * 4, outcomes
        assert primary_of(nodes) == (p, epoch), "the primary changed"
        top = view(nodes[p])["appliedLsn"]
        wait_until(lambda: all_applied(nodes, top), 20, what="every node applied the batches")
        assert client(nodes[p]).get_queue("big")["stats"]["sentTotal"] == 4 * n_bodies
    finally:
        for n in nodes.values():
            n.kill()


def test_a_node_the_members_do_not_count_says_so_in_its_own_log(tmp_path):
    """A fourth node started with a --peers list naming itself, where the three
    members were not told of it: the members refuse it (and say so); its own
    log said nothing, its /readyz just answered 503. Now it says who refuses
    it and why."""
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S)
    n4 = None
    try:  # (from here: the three are ended also if what follows fails)
        port = free_ports(1)[0]
        peers = next(a for a in nodes["n1"].extra_args if a.startswith("n1=")) + f",n4=127.0.0.1:{port}"
        n4 = NodeProc(str(tmp_path / "n4"), node_id="n4", grpc_port=port,
                      extra_args=["--peers", peers, "--failover-timeout", str(FAILOVER_S)])
        wait_until(lambda: primary_of(nodes), 15, what="a primary")
        n4.start()
        wait_until(lambda: "refuses this node's replication calls" in n4.read_log()
                   and "not a member of the cluster" in n4.read_log(), 15, what="n4 saying it is refused")
        assert primary_of({i: n for i, n in nodes.items()}) is not None
    finally:
        if n4 is not None:
            n4.kill()
        for n in nodes.values():
            n.kill()


def test_replication_traffic_from_a_stranger_is_refused(cluster, node):
    """A node answers replication traffic only from the members it was started
    with: a vote request, a frame and a snapshot from a node of another cluster
    (on a reused address, say) are refused and change nothing, on a cluster
    member and on a node running alone (which has no members to hear from)."""
    import grpc
    from spooler.pb import replication_pb2 as rpb, replication_pb2_grpc as rgrpc

    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    member = nodes[next(i for i in nodes if i != p)]
    alone_epoch = node.get("/v1/cluster")[1]["epoch"]
    for target, before in ((member, epoch), (node, alone_epoch)):
        with grpc.insecure_channel(target.grpc_target) as ch:
            stub = rgrpc.ReplicationStub(ch)
            for call in (lambda: stub.Vote(rpb.VoteRequest(epoch=before + 5, candidate="stranger", last_epoch=before + 5,
                                                           last_lsn=10 ** 6), timeout=10),
                         lambda: list(stub.Stream(iter([rpb.AppendFrame(epoch=before + 5, primary="stranger")]),
                                                  timeout=10)),
                         lambda: stub.TimeoutNow(rpb.TimeoutNowRequest(epoch=before, primary="stranger"), timeout=10)):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
            ack = stub.InstallSnapshot(iter([rpb.SnapshotChunk(epoch=before + 5, primary="stranger", data=b"x",
                                                               last=True)]), timeout=10)
            assert not ack.ok
        assert target.get("/v1/cluster")[1]["epoch"] == before
    assert primary_of(nodes) == (p, epoch)
    assert node.get("/v1/cluster")[1]["role"] == "primary"


def _own_lsn(doc):
    return next(n for n in doc["nodes"] if n["id"] == doc["nodeId"])["lsn"]


def _one_cluster_id(nodes):
    """The id every live member's document names, once they all name the same one."""
    ds = [view(n) for n in nodes.values() if n.alive()]
    ids = {d.get("clusterId") for d in ds if d}
    return len(ids) == 1 and all(ds) and ids.pop()


def test_every_member_adopts_one_cluster_id_from_the_log_and_keeps_it_through_failover_and_restart(cluster):
    """The first primary offers an id in its EpochBegin; each member adopts it
    when it applies that record, and checkpoints it at once. The next primary
    repeats it (that a later, different offer changes nothing is
    tests/unit/test_core.py::test_the_first_epoch_begin_that_names_a_cluster_names_it_for_good),
    and a restarted member reads it back from its store."""
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    cid = wait_until(lambda: _one_cluster_id(nodes), 15, what="one cluster id on every member")
    assert len(cid) == 32, cid
    nodes[p].kill()
    q, _ = wait_until(lambda: primary_of(nodes, exclude=(p,)), 15, what="a new primary")
    c = client(nodes[q])
    until_ok(lambda: c.put_queue("q", leaseTimeoutSeconds=30))  # its EpochBegin committed before this
    assert _one_cluster_id(nodes) == cid
    nodes[p].start()
    wait_until(lambda: (view(nodes[p]) or {}).get("appliedLsn", -1) >= document(nodes[q])["appliedLsn"], 15,
               what="the old primary to catch up")
    assert document(nodes[p])["clusterId"] == cid and _one_cluster_id(nodes) == cid
    # spoolctl names it beside the epoch
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "spooler", "--server", nodes[p].http_url, "--key", nodes[p].admin_key,
                          "cluster", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f", cluster {cid}" in out.stdout.splitlines()[0], (out.stdout, out.stderr)


def _another_clusters_store(tmp_path, node_id):
    """Run another 3-node cluster with the same ids, a message in it, then stop
    it: -> (the data directory of its node ``node_id``, its cluster id, where
    that node's log ends)."""
    others = start_cluster(str(tmp_path / "other"), 3, FAILOVER_S)
    try:
        wait_until(lambda: primary_of(others), 15, what="the other cluster's primary")
        oc = client(others["n1"])
        until_ok(lambda: oc.put_queue("theirs", leaseTimeoutSeconds=30))
        send_until_ok(oc, "theirs", b"kept")
        top = document(others["n1"])["commitLsn"]
        wait_until(lambda: all_applied(others, top), 10, what="the other cluster's members to apply it")
        theirs = wait_until(lambda: _one_cluster_id(others), 15, what="the other cluster's id")
        return others[node_id].data_dir, theirs, _own_lsn(document(others[node_id]))
    finally:
        for n in others.values():
            n.kill()


def test_a_node_of_another_cluster_with_the_same_ids_is_refused_and_keeps_its_store(cluster, tmp_path):
    """Nodes knew each other by id alone: a node of another cluster with the same
    ids, at an address this cluster's --peers name (a cluster left running, a
    store put back in the wrong place), was taken for a member. Its frames fed
    one drill's replica records it could not square with its own primary's
    (reliability.md, seed 11996). Now every replication call carries the
    caller's cluster id, and a node that has one refuses a call naming another:
    both sides log it, the stranger's store is left as it was, and this cluster
    serves on with its epoch unchanged."""
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    ours = wait_until(lambda: _one_cluster_id(nodes), 15, what="one cluster id on every member")
    r = next(i for i in nodes if i != p)
    data_dir, theirs, held = _another_clusters_store(tmp_path, r)
    assert theirs != ours
    # one of our replicas' addresses now reaches the other cluster's node of that id
    nodes[r].kill()
    nodes[r].data_dir = data_dir
    nodes[r].start()
    assert document(nodes[r])["clusterId"] == theirs
    wait_until(lambda: "of another cluster" in nodes[r].read_log() and "another cluster" in nodes[p].read_log(), 15,
               what="each side to log the other cluster's calls")
    # this cluster serves on (the primary and the other replica are a majority), in its epoch
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("ours"))
    send_until_ok(c, "ours", b"x")
    assert primary_of(nodes, exclude=(r,)) == (p, epoch)
    # and the stranger took nothing of ours: its cluster's id and records, as it had them
    d = document(nodes[r])
    assert d["clusterId"] == theirs and _own_lsn(d) == held and d["primary"] != p, d


def test_a_replica_whose_committed_records_differ_from_its_primarys_stops_with_status_70(cluster, tmp_path):
    """A store of another cluster that names no cluster id (one from a build
    before ids) at a member's place: nothing tells the clusters apart, the
    primary streams to it, and its log differs from records the node holds as
    committed. Before, the node resynced and sat behind that primary for good,
    answering nothing (a drill's replica did, reliability.md seed 11996); now it
    stops with status 70 and says why, and the cluster serves on without it."""
    import apsw
    nodes, _ = cluster
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    r = next(i for i in nodes if i != p)
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("ours"))
    for i in range(3):  # our log runs past the stranger's, so the primary sends it records
        send_until_ok(c, "ours", b"x%d" % i)
    data_dir, _, _ = _another_clusters_store(tmp_path, r)
    con = apsw.Connection(os.path.join(data_dir, "spool.db"))
    con.execute("DELETE FROM meta WHERE k = 'cluster_id'")
    con.close()
    nodes[r].kill()
    nodes[r].data_dir = data_dir
    nodes[r].start()
    wait_until(lambda: nodes[r].proc.poll() is not None, 20, what="the stranger to stop")
    assert nodes[r].proc.returncode == 70, nodes[r].read_log()
    log_text = nodes[r].read_log()
    assert "conflicts with records this node holds as committed" in log_text
    # the stop names its cause, not a storage failure (Engine._fail's ``what``)
    assert "log conflict with committed records, the node stops serving" in log_text
    assert "storage failure" not in log_text
    send_until_ok(c, "ours", b"after")
    assert primary_of(nodes, exclude=(r,)) == (p, epoch)


def test_a_member_whose_store_names_no_cluster_id_never_names_another_when_it_leads(cluster):
    """A member whose store applied the EpochBegin that named the cluster but
    keeps no id (a build before 0.4.31 applied it and skipped the field; a
    snapshot from such a primary) cannot tell that its log ever named one. Its
    EpochBegin, once it leads, must not offer a new id: it would adopt that one
    while the others keep the first, and from their next stream on each side
    would refuse the other's calls (guarantees.md R9), a member of the cluster
    cut off for good. Only a cluster's first record offers a new id."""
    import apsw
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    cid = wait_until(lambda: _one_cluster_id(nodes), 15, what="one cluster id on every member")
    r, q = [i for i in sorted(nodes) if i != p]
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q", leaseTimeoutSeconds=30))
    send_until_ok(c, "q", b"before")
    top = document(nodes[p])["commitLsn"]
    wait_until(lambda: all_applied(nodes, top), 10, what="every member to apply it")
    # r's store as a build before cluster ids left it: the records applied, no id kept
    nodes[r].kill()
    con = apsw.Connection(os.path.join(nodes[r].data_dir, "spool.db"))
    con.execute("DELETE FROM meta WHERE k = 'cluster_id'")
    con.close()
    nodes[r].start()
    wait_until(lambda: (view(nodes[r]) or {}).get("appliedLsn", -1) >= top, 15, what=f"{r} to load its store")
    assert document(nodes[r])["clusterId"] is None
    # r leads: its epoch's first record commits and applies everywhere
    until_ok(lambda: c.promote(r), what="the switchover to the member without an id")
    wait_until(lambda: primary_of(nodes) == (r, document(nodes[r])["epoch"]), 15, what=f"{r} to lead")
    cr = client(nodes[r])
    send_until_ok(cr, "q", b"led by the member without an id")
    top = document(nodes[r])["commitLsn"]
    wait_until(lambda: all_applied(nodes, top), 10, what="every member to apply it")
    ids = {i: document(n)["clusterId"] for i, n in nodes.items()}
    assert ids[p] == cid and ids[q] == cid and ids[r] in (None, cid), (cid, ids)
    # and a member whose stream from r reopens still follows it
    nodes[q].kill()
    nodes[q].start()
    send_until_ok(cr, "q", b"after the restart")
    top = document(nodes[r])["commitLsn"]
    wait_until(lambda: all_applied(nodes, top), 15, what=f"{q} to follow {r} after its restart")
    assert "another cluster" not in nodes[q].read_log() + nodes[r].read_log() + nodes[p].read_log()


def test_a_replica_holds_forwarded_bodies_within_the_byte_budget(tmp_path):
    """A replica holds a forwarded send's body until the primary answers. It let
    go of the send's bytes once it had read the body, so with a primary that does
    not answer (SIGSTOP) it held every body sent to it. They count against
    sending_bytes_max now: past it a send is 503 `unavailable` (reason
    `overloaded`) at once, the others wait for the primary."""
    import threading

    nodes = start_cluster(str(tmp_path), 3, 5.0, env={"SPOOLER_TEST_SENDING_BYTES_MAX": "1000000"})
    p = None
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 30, what="a primary")
        r = next(i for i in nodes if i != p)
        until_ok(lambda: client(nodes[p]).put_queue("fwd"))
        wait_until(lambda: (view(nodes[r]) or {}).get("primary") == p, 15, what="the replica knowing its primary")
        os.kill(nodes[p].pid, signal.SIGSTOP)
        answers: list = []

        def send():
            try:
                client(nodes[r]).send("fwd", b"b" * 200_000)
                answers.append("201")
            except errors.SpoolerError as e:
                answers.append(f"{e.kind}:{getattr(e, 'reason', '')}")
        threads = [threading.Thread(target=send) for _ in range(8)]
        for t in threads:
            t.start()
        # five fit in 1,000,000 bytes and wait for the primary; the other three are refused at once
        wait_until(lambda: len(answers) >= 3, 4, what="the sends past the budget refused")  # (failover: 5 s)
        assert sorted(answers) == ["unavailable:overloaded"] * 3, answers
        os.kill(nodes[p].pid, signal.SIGCONT)
        for t in threads:
            t.join(30)
        # the five held were not refused for room (201, unless a loaded machine let
        # the failover come first: then whatever a forwarded send meets then)
        assert len(answers) == 8 and answers.count("unavailable:overloaded") == 3, answers
    finally:
        for n in nodes.values():
            if n.alive():
                os.kill(n.pid, signal.SIGCONT)
            n.kill()


def test_a_call_forwarded_by_a_replica_is_counted_once_as_a_clients_call(cluster):
    """A replica forwards a client's call to the primary: the replica counts it
    as the client made it (api "http" here) and counts its error; the primary
    counts it under api "forwarded" and not its error. Before, both counted it as
    a call and as an error, and the primary's as "grpc": a sum over the cluster
    counted each such call twice."""
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    r = next(i for i in nodes if i != p)
    c = client(nodes[r])
    until_ok(lambda: c.put_queue("fwd-q"), what="the queue")

    def figures(n):
        calls, errs = {}, {}
        for s in n.samples("spooler_calls_total", "spooler_errors_total"):
            if s.name == "spooler_calls_total":
                calls[(s.labels["api"], s.labels["call"], s.labels["outcome"])] = s.value
            else:
                errs[s.labels["kind"]] = errs.get(s.labels["kind"], 0) + s.value
        return calls, errs

    before_p, before_r = figures(nodes[p]), figures(nodes[r])
    send_until_ok(c, "fwd-q", b"through a replica")
    with pytest.raises(errors.QueueNotFound):
        c.send("no-such-fwd-q", b"x")
    with pytest.raises(errors.Unauthenticated):  # a key the replica asks the primary about, and is refused
        HttpClient(nodes[r].http_url, "not-a-key-" + uuid.uuid4().hex, timeout_s=10).list_queues()
    (calls_p, errs_p), (calls_r, errs_r) = figures(nodes[p]), figures(nodes[r])

    def grew(after, before):
        return {k: v - before.get(k, 0) for k, v in after.items()
                if v != before.get(k, 0) and k[1:2] != ("GET /metrics",)}  # (the scrapes themselves)
    new_p, new_r = grew(calls_p, before_p[0]), grew(calls_r, before_r[0])
    route = "POST /v1/queues/{queue}/messages"
    assert new_r.get(("http", route, "ok")) == 1 and new_r.get(("http", route, "queue_not_found")) == 1, new_r
    assert grew(errs_r, before_r[1]).get("queue_not_found") == 1
    assert grew(errs_r, before_r[1]).get("unauthenticated") == 1
    assert {api for (api, _, _) in new_p} == {"forwarded"}, new_p   # nothing counted as a client's call
    assert sum(v for (_, _, outcome), v in new_p.items() if outcome == "queue_not_found") == 1, new_p
    assert not {"queue_not_found", "unauthenticated"} & set(grew(errs_p, before_p[1])), errs_p


def test_a_member_low_on_disk_lets_a_member_with_room_win_the_election(tmp_path):
    """Elections did not look at disks: after its primary died, a replica whose disk
    was below its reserve could win, and then refused every send. It now campaigns
    a failover timeout later than a member with room (campaign_handicap_us). Here the
    replica low on disk (n2) has the shortest timeout and n3 a long one, so that
    without the handicap n2 campaigns first after the primary's SIGKILL nearly every
    time (its early campaign within 70 ms, n3's within 520 ms); with it, n3 wins."""
    per_node = {"n2": ["--disk-reserve-bytes", str(1 << 60), "--failover-timeout", "1"],
                "n3": ["--failover-timeout", "10"]}
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S, per_node_args=lambda i: per_node.get(i, []))
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 20, what="a primary")
        if p != "n1":
            until_ok(lambda: client(nodes[p]).promote("n1"), what="n1 to take over")
            wait_until(lambda: primary_of(nodes) and primary_of(nodes)[0] == "n1", 15, what="n1 as the primary")
        c = client(nodes["n1"])
        until_ok(lambda: c.put_queue("q"), what="the queue")
        send_until_ok(c, "q", b"before")
        wait_until(lambda: all_applied(nodes, view(nodes["n1"])["commitLsn"]), 15, what="every member applied")
        nodes["n1"].kill()
        p, _ = wait_until(lambda: primary_of(nodes), 20, what="a new primary")
        assert p == "n3", (p, nodes["n2"].read_log())
        send_until_ok(client(nodes["n3"]), "q", b"after")
    finally:
        for n in nodes.values():
            n.kill()


def _cluster_with_disks_told(tmp_path):
    """Three nodes, each reading its free space from a file while that file
    exists (SPOOLER_TEST_DISK_FREE_FILE stands in for a filling disk)."""
    free = {i: str(tmp_path / f"{i}-disk-free") for i in ("n1", "n2", "n3")}
    return start_cluster(str(tmp_path), 3, FAILOVER_S,
                         per_node_env=lambda i: {"SPOOLER_TEST_DISK_FREE_FILE": free[i]}), free


def _primary_with_a_message(nodes):
    """-> (the primary's id, an HTTP client of it, the id of a message sent to its queue "q")."""
    p, _ = wait_until(lambda: primary_of(nodes), 20, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("q"), what="the queue")
    return p, c, send_until_ok(c, "q", b"before")["id"]


def test_a_primary_whose_disk_runs_low_hands_over_to_a_member_with_room(tmp_path):
    """A primary whose disk fell below its reserve stayed primary and refused every
    send until an operator promoted another member. Once its disk has been low for
    a failover timeout it now hands over by itself (Replication.disk), as a
    promote would, to a member with room. A member low on disk too says so in
    its answers (AppendAck.disk_low; /v1/cluster's diskLow and
    spooler_member_disk_low on the primary) and is not asked, though it is the
    one a promote-like choice would take first (lowest id among equals).
    Nothing stored before is lost. (SPOOLER_TEST_DISK_FREE_FILE stands in for a
    filling disk.)"""
    nodes, free = _cluster_with_disks_told(tmp_path)
    try:
        p, c, before = _primary_with_a_message(nodes)
        low, roomy = sorted(i for i in nodes if i != p)

        def fill(i):
            with open(free[i], "w") as f:
                f.write("0")
            wait_until(lambda: nodes[i].metric("spooler_disk_free_bytes") == 0, 10, what=f"{i} to read its disk")
        def said(i):
            return {n["id"]: n.get("diskLow") for n in document(nodes[p])["nodes"]}.get(i)
        assert said(low) is False and said(p) is False
        fill(low)
        wait_until(lambda: said(low) is True, 10, what=f"{low}'s answers to say its disk is low")
        assert sorted((x.labels["member"], x.value) for x in nodes[p].samples("spooler_member_disk_low")) == \
            sorted([(low, 1.0), (roomy, 0.0)])
        fill(p)
        with pytest.raises(errors.Unavailable):
            c.send("q", b"refused")  # (a primary low on disk refuses sends, as before)
        new, _ = wait_until(lambda: primary_of(nodes, exclude=(p,)), 10 * FAILOVER_S,
                            what="a member with room as the primary")
        assert new == roomy, nodes[p].read_log()
        log_p = nodes[p].read_log()
        assert f"handing over to {low}" not in log_p and f"handing over to {roomy}" in log_p, log_p
        assert primary_of(nodes)[0] == roomy
        c2 = client(nodes[roomy])
        after = send_until_ok(c2, "q", b"after")["id"]
        got = [c2.receive("q", wait_s=5) for _ in range(2)]
        assert [d.id for d in got] == [before, after] and [d.body for d in got] == [b"before", b"after"]
    finally:
        for n in nodes.values():
            n.kill()


def test_a_primary_low_on_disk_whose_members_are_too_says_so_and_hands_over_once_one_has_room(tmp_path):
    """Every disk is below its reserve: the primary stays (sends refused), asks no
    member (each says its disk is low), and logs why, naming them. Once one
    member has room again and says so, the primary hands over to it within a
    few failover timeouts, not the ten a refusal would cost."""
    nodes, free = _cluster_with_disks_told(tmp_path)
    try:
        p, c, before = _primary_with_a_message(nodes)
        others = sorted(i for i in nodes if i != p)
        for i in others + [p]:
            with open(free[i], "w") as f:
                f.write("0")
        said = "this node's disk is below its reserve and no member can take over (" + \
            "; ".join(f"{o}: its disk is low too" for o in others)
        wait_until(lambda: said in nodes[p].read_log(), 10 * FAILOVER_S, what="the primary to say why it stays")
        assert primary_of(nodes)[0] == p and "handing over to" not in nodes[p].read_log()
        os.remove(free[others[1]])  # room again (its real disk)
        freed = time.monotonic()
        new, _ = wait_until(lambda: primary_of(nodes, exclude=(p,)), 10 * FAILOVER_S,
                            what="the member with room as the primary")
        assert new == others[1] and time.monotonic() - freed < 5 * FAILOVER_S
        log_p = nodes[p].read_log()
        assert f"handing over to {others[0]}" not in log_p and "did not take over" not in log_p, log_p
        c2 = client(nodes[new])
        got = until_ok(lambda: c2.receive("q", wait_s=5), what="the message on the new primary")
        assert got.id == before and got.body == b"before"
    finally:
        for n in nodes.values():
            n.kill()


def test_a_purge_is_refused_while_a_member_runs_a_build_that_cannot_apply_it(tmp_path):
    """A purge is a record older builds do not know (they stop on it). Every
    member says in its acknowledgements which log format it applies; while one
    that answered the primary says less than a purge needs (here n3 standing in
    for a 0.4.41 build: SPOOLER_TEST_LOG_FORMAT=0), a purge is 503 unavailable,
    naming it, and nothing is purged. Once it runs this build, a purge asked of
    a replica (forwarded) takes every message, on every member."""
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S,
                          per_node_env=lambda i: {"SPOOLER_TEST_LOG_FORMAT": "0"} if i == "n3" else {})
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 20, what="a primary")
        if p == "n3":
            until_ok(lambda: client(nodes[p]).promote("n1"), what="n1 to take over")
            p, _ = wait_until(lambda: primary_of(nodes, exclude=("n3",)), 20, what="n1 as the primary")
        c = client(nodes[p])
        until_ok(lambda: c.put_queue("q"), what="the queue")
        for body in (b"a", b"b"):
            send_until_ok(c, "q", body)
        with pytest.raises(errors.Unavailable) as e:
            c.purge("q")
        assert "n3" in str(e.value) and "0.4.42" in str(e.value), e.value
        assert c.get_queue("q")["stats"]["visible"] == 2
        nodes["n3"].kill()
        nodes["n3"].env = {k: v for k, v in (nodes["n3"].env or {}).items() if k != "SPOOLER_TEST_LOG_FORMAT"}
        nodes["n3"].start()
        replica = next(i for i in nodes if i != p)
        r = client(nodes[replica])
        assert until_ok(lambda: r.purge("q"), 20, what="a purge once n3 runs this build") == 2
        for i, n in nodes.items():  # (each member's own state: /metrics is never forwarded)
            wait_until(lambda: [(x.labels["event"], x.value) for x in n.samples("spooler_queue_events_total")
                                if x.labels["event"] == "purged"] == [("purged", 2.0)], 10,
                       what=f"the purge applied on {i}")
        assert c.get_queue("q")["stats"]["visible"] == 0 and nodes["n3"].alive()
    finally:
        for n in nodes.values():
            n.kill()


def test_a_member_whose_disk_is_below_its_reserve_refuses_to_take_over(tmp_path):
    """A switchover to a member with less free disk than its reserve was taken,
    and the new primary then refused every send (``disk_low``). Such a member
    now refuses TimeoutNow, as a stopping one does: the promote is answered
    unavailable, saying why, and the old primary serves on; a member with room
    takes over as before."""
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S,
                          per_node_args=lambda i: ["--disk-reserve-bytes", str(1 << 60)] if i == "n3" else [])
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        if p == "n3":  # (n3 campaigns later, but alone with its timer it may still win the first election)
            until_ok(lambda: client(nodes[p]).promote("n1"), what="n1 to take over")
            p, _ = wait_until(lambda: primary_of(nodes, exclude=("n3",)), 15, what="a primary with room")
        c = client(nodes[p])
        until_ok(lambda: c.put_queue("roomy"), what="the queue")
        with pytest.raises(errors.Unavailable) as e:
            c.promote("n3")
        assert "refused to take over" in str(e.value) and "bytes free" in str(e.value), e.value
        assert primary_of(nodes)[0] == p
        send_until_ok(c, "roomy", b"still served")
        other = next(i for i in nodes if i not in (p, "n3"))
        assert c.promote(other)["primary"] == other
    finally:
        for n in nodes.values():
            n.kill()


def test_the_primary_times_each_replicas_acknowledgements(tmp_path):
    """spooler_member_ack_seconds{member} on the primary: from sending a frame to a
    replica to its acknowledgement (after the replica's fsync for a frame with
    records), one histogram per replica, so a slow member's disk or link shows
    by name; a replica times nothing (it sends no frames)."""
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S)
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        c = client(nodes[p])
        until_ok(lambda: c.put_queue("q"), what="the queue")
        for i in range(5):
            send_until_ok(c, "q", b"m%d" % i)

        def acks(n):
            got = {}
            for s in n.samples("spooler_member_ack_seconds_count", "spooler_member_ack_seconds_sum"):
                got.setdefault(s.labels["member"], {})[s.name.rpartition("_")[2]] = s.value
            return got
        replicas = sorted(i for i in nodes if i != p)
        timed = wait_until(lambda: (lambda g: g if sorted(g) == replicas and all(
            v["count"] >= 5 and v["sum"] > 0 for v in g.values()) else None)(acks(nodes[p])), 10,
            what="acknowledgements timed for each replica")
        assert all(v["sum"] / v["count"] < 1.0 for v in timed.values()), timed  # (127.0.0.1: far under a second)
        assert all(acks(nodes[r]) == {} for r in replicas)
    finally:
        for n in nodes.values():
            n.kill()
