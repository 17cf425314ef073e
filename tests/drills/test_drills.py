"""Seeded process-failover drills against a real 3-node cluster (see drill.py).

The short drills (plain, power loss, partitions through the fault proxy, partitions
between the clients and the nodes, ...) run in the normal suite; the long ones are ``@pytest.mark.slow``
(``pytest -m slow tests/drills/test_drills.py``). Many seeds: ``python -m tests.drills.run``.
"""
import json
import subprocess
import threading

import pytest

from drills import builds
from drills.checker import format_table
from drills.drill import run_drill

pytestmark = pytest.mark.integration


def _run(seed, duration_s, tmp_path, power_loss=False, partitions=False, cascades=False, disk_loss=False,
         graceful=False, fsync_errors=False, write_errors=False, faults=(), client_partitions=False,
         slow_links=False, sdk_clients=False, disk_low=False, purges=False, upgrade_from=None):
    """faults: kinds the nemesis carries out first (the load runs on until they are over), so
    that what a test asserts of them does not hang on how many rounds fit in duration_s."""
    report = run_drill(seed, duration_s, nodes=3, workdir=str(tmp_path / f"seed-{seed}"), power_loss=power_loss,
                       partitions=partitions, cascades=cascades, disk_loss=disk_loss, graceful=graceful,
                       fsync_errors=fsync_errors, write_errors=write_errors, faults=faults,
                       client_partitions=client_partitions, slow_links=slow_links, sdk_clients=sdk_clients,
                       disk_low=disk_low, purges=purges, upgrade_from=upgrade_from)
    faults = ("upgrade",) * 3 * bool(upgrade_from) + tuple(faults)  # (an upgrade's rounds come first)
    assert report["faults"][:len(faults)] == list(faults), (report["faults"], report["notes"])
    table = format_table(report)
    print(f"seed {seed}: {report['wall_s']:.1f}s wall, nemeses {json.dumps(report['nemesis_counts'])}\n{table}")
    assert report["drain_complete"], report["notes"]
    assert not report["thread_errors"], report["thread_errors"]
    assert report["required_zeros_ok"], f"history kept in {report['history']}\n{table}"
    assert report["nodes_agree"] is True and report["integrity_ok"] is True
    # every confirmed message was delivered, or taken by a purge (only with purges=True)
    assert report["confirmed_sends"] > 0 and report["deliveries"] + report["purged"] >= report["confirmed_sends"]
    assert report["keyed_sends"] > 0  # the keyed producer ran: keyed_duplicates judged something
    return report


def test_short_failover_drill(tmp_path):
    r = _run(1, 14.0, tmp_path, faults=("kill_primary", "stop_primary"))
    assert r["nemesis_counts"].get("kill_primary", 0) >= 1, r["nemesis_counts"]
    assert r["nemesis_counts"].get("stop_primary", 0) >= 1, r["nemesis_counts"]


def test_short_power_loss_drill(tmp_path):
    """Every SIGKILL is a power cut: nodes lose all they had not fsync'd."""
    r = _run(7, 14.0, tmp_path, power_loss=True, faults=("kill_primary",))
    assert r["nemesis_counts"].get("power_loss_primary", 0) >= 1, r["nemesis_counts"]


def test_short_partition_drill(tmp_path):
    """Node-to-node traffic crosses the fault proxy; the primary is blackholed, then the (new)
    primary cannot reach the others while they reach it. The stayer stays on the cut-off
    primary: it was refused by it while it was cut off (and no lease or renewal was
    granted behind a newer epoch: a required zero), and it renewed leases."""
    r = _run(18, 14.0, tmp_path, partitions=True, faults=("blackhole_primary", "one_way_out"))
    assert r["stayer_calls"].get("renew ok", 0) >= 1, r["stayer_calls"]
    cut = r["stayer_cut_calls"]
    assert cut.get("receive fail unavailable", 0) + cut.get("renew fail unavailable", 0) >= 1, cut
    parts = {k: v for k, v in r["nemesis_counts"].items() if k.startswith("partition_")}
    assert parts.get("partition_blackhole_primary", 0) >= 1, r["nemesis_counts"]
    assert sum(parts.values()) >= 2, r["nemesis_counts"]
    assert len(r["rejoins"]) == sum(parts.values()), (r["rejoins"], r["notes"])
    links = r["proxy_links"]
    assert len(links) == 6 and all(x["mode"] == "ok" for x in links.values()), links
    # the primary's log shipping crossed the proxy (every node was primary or replica of one)
    assert sum(1 for x in links.values() if x["bytes_fwd"] > 0 and x["bytes_back"] > 0) >= 4, links


def test_short_cascade_drill(tmp_path):
    """Overlapping faults: a replica killed and then the primary stopped (no quorum left
    until the replica is back), then a new primary killed right after its election."""
    r = _run(4, 14.0, tmp_path, cascades=True, faults=("kill_replica_stop_primary", "kill_primary_twice"))
    counts = r["nemesis_counts"]
    assert counts.get("cascade_kill_replica_stop_primary", 0) >= 1, counts
    assert counts.get("cascade_kill_primary_twice", 0) >= 1, counts
    assert counts.get("kill_primary", 0) >= 2 * counts["cascade_kill_primary_twice"], counts


def test_short_disk_loss_drill(tmp_path):
    """R1a under load: a replica's disk is lost and its replacement joins with --join,
    then the primary's (it is killed with its disk: the others elect one of
    themselves, and its replacement joins as a replica); nothing confirmed is lost,
    and both replacements join."""
    r = _run(7, 10.0, tmp_path, disk_loss=True, faults=("replace_replica", "replace_primary"))
    counts = r["nemesis_counts"]
    assert counts.get("disk_loss_replica", 0) >= 1 and counts.get("disk_loss_primary", 0) >= 1, counts
    assert counts.get("joined", 0) == counts["disk_loss_replica"] + counts["disk_loss_primary"], counts
    events = [json.loads(x) for x in open(r["history"])]
    gone = next(e for e in events if e.get("type") == "nemesis" and e["f"] == "disk_loss" and e["role"] == "primary")
    # the next primary is another node: an empty replacement that is joining stands for nothing
    later = sorted((e["epoch"], e["node"]) for e in events
                   if e.get("type") == "role" and e.get("role") == "primary" and e["epoch"] > gone["epoch"])
    assert later and later[0][1] != gone["node"], (gone, later[:3])


def test_short_graceful_stop_drill(tmp_path):
    """A rolling restart's steps under load: the primary is told to stop (it hands over
    first) and started again, twice; it exits 0 each time, and nothing is lost or seen
    twice against the rules."""
    r = _run(11, 10.0, tmp_path, graceful=True, faults=("term_primary", "term_primary"))
    assert r["nemesis_counts"].get("term_primary", 0) >= 2, r["nemesis_counts"]
    assert not r["unexpected_exits"], r["unexpected_exits"]
    terms = [w for w in r["failover_unavailability"]["windows"] if w["f"] == "term"]
    assert len(terms) >= 2 and all(w["unavailable_s"] is not None for w in terms), terms


def _storage_error_drill(seed, tmp_path, kind):
    """Two faults ``kind`` ("fsync_error" or "write_error") of a node's store, under
    load, the seed drawing the primary for one and a replica for the other: each
    must exit 70 in time (else an unexpected exit) and the cluster serve again."""
    r = _run(seed, 10.0, tmp_path, power_loss=True, faults=(kind, kind), **{kind + "s": True})
    counts = r["nemesis_counts"]
    assert counts.get(kind + "_primary", 0) >= 1 and counts.get(kind + "_replica", 0) >= 1, counts
    assert not r["unexpected_exits"], r["unexpected_exits"]  # each exited 70, in time
    ws = [w for w in r["failover_unavailability"]["windows"] if w["f"] == kind]
    assert len(ws) >= 2 and all(w["unavailable_s"] is not None for w in ws), ws
    return r


def test_short_fsync_error_drill(tmp_path):
    """S9 under load, on a cluster: the next fsync of a node fails, twice (seed 6
    draws the primary first, then a replica); the node stops with the store's exit
    status, confirming nothing that fsync held, and rejoins once started again on
    the same data. Nothing confirmed is lost; every other required zero holds."""
    _storage_error_drill(6, tmp_path, "fsync_error")


def test_short_client_partition_drill(tmp_path):
    """The clients reach the nodes through a fault proxy: the primary's answers are held
    while its requests run (sends stored whose 201 never comes, acks applied whose 204
    never comes, leases granted whose answer is lost), then every connection to the
    primary is cut. The calls caught in them end unknown, their clients move on, and
    nothing is lost, delivered unexpectedly or acked and seen again."""
    r = _run(3, 8.0, tmp_path, client_partitions=True, faults=("client_hold_primary", "client_cut_primary"))
    counts = r["nemesis_counts"]
    assert counts.get("client_partition_hold_answers_primary", 0) >= 1, counts
    assert counts.get("client_partition_cut_primary", 0) >= 1, counts
    assert r["client_partitions"] >= 2, r["client_partitions"]
    # the faults caught calls: some ended unknown (so the checker judged maybe-landed
    # sends and unconfirmed settles), and the clients went on elsewhere
    assert r["client_partition_unknowns"] >= 1, (r["client_partition_calls"], r["client_partition_unknowns_by_call"])
    # a call held past its timeout ended unknown, and its client went on to another node
    events = [json.loads(x) for x in open(r["history"])]
    faulted = {e["node"] for e in events if e.get("type") == "nemesis" and e["f"] == "client_partition"}
    invokes = {(e["process"], e["op"]): e for e in events if e.get("type") == "invoke"}
    timed_out = [(e["process"], e["op"]) for e in events if e.get("type") == "unknown"
                 and "timed out" in e.get("message", "") and invokes[(e["process"], e["op"])]["node"] in faulted]
    assert timed_out, r["client_partition_unknowns_by_call"]
    for proc, op in timed_out:
        nxt = next((e for e in events if e.get("type") == "invoke" and e["process"] == proc and e["op"] > op), None)
        assert nxt is None or nxt["node"] != invokes[(proc, op)]["node"], (invokes[(proc, op)], nxt)
    links = r["client_proxy_links"]
    assert len(links) == 6 and all(x["mode"] == "ok" for x in links.values()), links
    # every client call crossed the proxy: HTTP to every node, gRPC batches to some
    assert sum(1 for k, x in links.items() if "/grpc" not in k and x["bytes_fwd"] and x["bytes_back"]) == 3, links
    assert any(x["bytes_fwd"] for k, x in links.items() if "/grpc" in k), links


def test_short_client_late_drill(tmp_path):
    """The primary's client links hold every byte, twice, and each time deliver what
    they held at the heal: requests whose clients timed out seconds before (and went
    on elsewhere) reach the primary and run there. Sends held so are stored after their
    client gave up on them, and the checker allows every call held so to take effect
    until the drill's bound after the heal; nothing is lost, delivered unexpectedly,
    acked and seen again, leased twice at once, or keyed twice."""
    r = _run(21, 4.0, tmp_path, client_partitions=True, faults=("client_late", "client_late"))
    assert r["nemesis_counts"].get("client_partition_hold_late_primary") == 2, r["nemesis_counts"]
    assert r["client_partition_late_calls"] >= 1, r["client_partition_calls"]
    events = [json.loads(x) for x in open(r["history"])]
    heals = [e for e in events if e.get("type") == "nemesis" and e["f"] == "client_heal"]
    assert len(heals) == 2 and all(e.get("late") for e in heals), heals
    # what the links held reached the node at the heal: the nemesis's own send into each
    # fault, which its client gave up on after 1 s, was stored all the same (a link
    # healed with a reset would have discarded it)
    invokes = {(e["process"], e["op"]): e for e in events if e.get("type") == "invoke"}
    probes = [e for e in invokes.values() if e["process"] == "late-probe"]
    ends = {(e["process"], e["op"]): e for e in events if e.get("type") in ("ok", "fail", "unknown")}
    assert len(probes) == 2 and all(ends[(p["process"], p["op"])]["type"] == "unknown" for p in probes), probes
    delivered = {e.get("body") for e in events if e.get("type") == "ok" and e.get("body") is not None
                 and invokes[(e["process"], e["op"])]["f"] == "receive"}
    assert all(p["body"] in delivered for p in probes), (probes, r["unknown_sends_appeared"])
    links = r["client_proxy_links"]
    assert all(x["mode"] == "ok" for x in links.values()), links


def test_short_sdk_client_drill(tmp_path):
    """A service on the asyncio SDK beside the HTTP clients, through the client proxy:
    its sends auto-batched on its Session stream, its receives, acks, nacks and
    renewals recorded as every other client's. The primary is killed, then its
    answers are held: the SDK moves to other nodes, and each of its calls ends as it
    says (a send ``unavailable`` is one never stored, a confirmed ack one whose
    message never comes back), which the checker holds it to."""
    r = _run(3, 6.0, tmp_path, client_partitions=True, sdk_clients=True,
             faults=("kill_primary", "client_hold_primary"))
    events = [json.loads(x) for x in open(r["history"])]
    invokes = {(e["process"], e["op"]): e for e in events if e.get("type") == "invoke"}
    ends = [(invokes[(e["process"], e["op"])], e) for e in events if e.get("type") in ("ok", "fail", "unknown")]
    sdk = [(i, e) for i, e in ends if i.get("sdk")]
    kinds = {(i["f"], e["type"]) for i, e in sdk}
    # the SDK's calls were made, answered and judged: sends confirmed, deliveries
    # received and acked, all through the proxy's gRPC links
    assert {("send", "ok"), ("receive", "ok"), ("ack", "ok")} <= kinds, kinds
    sdk_bodies = {i["body"] for i, e in sdk if i["f"] == "send" and e["type"] == "ok"}
    delivered = {e.get("body") for i, e in ends if i["f"] == "receive" and e["type"] == "ok"}
    assert sdk_bodies and sdk_bodies <= delivered | set(), len(sdk_bodies - delivered)
    assert any(x["bytes_fwd"] for k, x in r["client_proxy_links"].items() if "/grpc" in k)
    assert r["sdk_calls"].get("send ok", 0) == sum(1 for i, e in sdk if i["f"] == "send" and e["type"] == "ok")


def test_short_slow_link_drill(tmp_path):
    """Every byte between the primary and the others late by 0.85 s (seed 7's draw;
    the failover timeout is 1 s), then, under the primary elected meanwhile, between
    a replica and the others by 0.66 s: heartbeats, frames and their
    acknowledgements, forwarded calls and votes all arrive late, in order. The slow
    primary cannot hear a majority in time and a new one is elected over the slow
    links; nothing is lost, delivered unexpectedly, acked and seen again, or leased
    twice at once, and the cluster is whole again after each heal."""
    r = _run(7, 6.0, tmp_path, partitions=True, slow_links=True, faults=("slow_links", "slow_links"))
    assert r["nemesis_counts"].get("partition_slow_primary") == 1, r["nemesis_counts"]
    assert r["nemesis_counts"].get("partition_slow_replica") == 1, r["nemesis_counts"]
    events = [json.loads(x) for x in open(r["history"])]
    slow = [e for e in events if e.get("type") == "nemesis" and e.get("kind") == "slow" and e["f"] == "partition"]
    assert [e["delay_s"] for e in slow] == [0.853, 0.658], slow
    # the links were slow indeed: the primary they slowed lost its office, and the next
    # fault found a later epoch
    assert slow[1]["epoch"] > slow[0]["epoch"], slow
    assert len(r["rejoins"]) == 2, (r["rejoins"], r["notes"])
    links = r["proxy_links"]
    assert links and all(x["mode"] == "ok" for x in links.values()), links


def test_short_write_error_drill(tmp_path):
    """S9 under load for an I/O error of a write, not of an fsync: the next writes
    of a node's store fail, twice (seed 9 draws the primary first, then a
    replica); the node stops with the store's exit status, confirming nothing
    whose write failed, and rejoins once started again on the same data. Nothing
    confirmed is lost; every other required zero holds."""
    _storage_error_drill(9, tmp_path, "write_error")
    # the fault did happen: each of those nodes stopped on an I/O error of its store
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "seed-9" / "nodes").glob("n*/n*.log"))
    failures = [ln for ln in logs.splitlines() if "storage failure" in ln and "IOError" in ln]
    assert len(failures) >= 2, failures


def test_short_disk_low_drill(tmp_path):
    """A primary's disk fills past its reserve under load, twice (one round with a
    replica's disk full too, which then refuses to take over): sends are refused
    meanwhile, and within the round the primary has handed over to a member with
    room (Replication.disk); nothing is lost, duplicated or acked and seen again."""
    r = _run(11, 6.0, tmp_path, disk_low=True, faults=("disk_low", "disk_low"))
    assert r["disk_low"]["rounds"] == 2 and r["disk_low"]["handed_over"] == 2, (r["disk_low"], r["notes"])
    assert r["nemesis_counts"].get("disk_low_primary") == 2, r["nemesis_counts"]
    events = [json.loads(x) for x in open(r["history"])]
    full, handed = set(), []
    for e in events:   # never to a member whose disk was full at the time
        if e.get("type") == "nemesis" and e["f"] in ("disk_low", "disk_room", "disk_low_handed_over"):
            if e["f"] == "disk_low_handed_over":
                assert e["node"] not in full, (e, full)
                handed.append(e["node"])
            (full.add if e["f"] == "disk_low" else full.discard)(e["node"])
    assert len(handed) == 2, handed
    refused = [e for e in events if e.get("type") == "fail" and "disk" in json.dumps(e)]
    assert refused, "no send was refused while the primary's disk was full"


def test_short_purge_drill(tmp_path):
    """A second queue, visible, delayed and leased messages in it, purged every second or
    few while the primary is killed: nothing a purge confirmed gone comes back, nothing
    else of it is lost, and the nodes end alike."""
    r = _run(23, 8.0, tmp_path, purges=True, faults=("kill_primary",))
    assert r["nemesis_counts"].get("kill_primary", 0) >= 1, r["nemesis_counts"]
    events = [json.loads(x) for x in open(r["history"])]
    purged = [e for e in events if e.get("f") == "purge" and e.get("type") == "ok"]
    assert r["purges"] >= 2 and len(purged) >= 1, r["purges"]
    assert r["purged"] > 0 and sum(e["purged"] for e in purged) > 0, r["purged"]


def test_short_rolling_upgrade_drill(tmp_path):
    """Every node starts on the previous release (built from this checkout's history)
    and is upgraded under load, one a round, replicas first and the primary last (told
    to stop, it hands over); then the primary, on this build, is killed. The purged
    queue runs throughout (a release without purge refuses it: the 503s and 404s are
    definite failures to the checker; test_mixed_builds.py checks them against 0.4.41).
    Skipped where the history is not there (a shallow clone)."""
    from spooler import __version__
    root = builds.repo_root()
    try:
        version, commit = builds.previous_release(root)
    except (LookupError, subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"no earlier release in this checkout's history: {e}")
    tree = builds.extract(commit, str(tmp_path / "older-build"), root)
    r = _run(29, 6.0, tmp_path, purges=True, faults=("kill_primary",), upgrade_from=tree)
    assert r["nemesis_counts"].get("upgrade_replica") == 2 and r["nemesis_counts"].get("upgrade_primary") == 1, \
        r["nemesis_counts"]
    assert r["versions"] == {n: [version, __version__] for n in ("n1", "n2", "n3")}, r["versions"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4, 5, 6])
def test_long_failover_drill(seed, tmp_path):
    _run(seed, 60.0, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 8, 20, 29, 37])
def test_long_partition_drill(seed, tmp_path):
    _run(seed, 60.0, tmp_path, partitions=True)


def test_a_fault_script_names_only_faults_the_drill_can_make(tmp_path):
    with pytest.raises(ValueError, match="unknown fault kinds"):
        run_drill(1, 1.0, workdir=str(tmp_path), faults=("kill_everything",))
    with pytest.raises(ValueError, match="need cascades=True"):
        run_drill(1, 1.0, workdir=str(tmp_path), faults=("kill_primary_twice",))
    with pytest.raises(ValueError, match="needs power_loss=True"):
        run_drill(1, 1.0, workdir=str(tmp_path), fsync_errors=True, faults=("fsync_error",))
    with pytest.raises(ValueError, match="need client_partitions=True"):
        run_drill(1, 1.0, workdir=str(tmp_path), faults=("client_hold_primary",))
    with pytest.raises(ValueError, match="need fsync_errors=True"):
        run_drill(1, 1.0, workdir=str(tmp_path), power_loss=True, faults=("fsync_error",))
    with pytest.raises(ValueError, match="needs power_loss=True"):
        run_drill(1, 1.0, workdir=str(tmp_path), write_errors=True, faults=("write_error",))
    with pytest.raises(ValueError, match="need write_errors=True"):
        run_drill(1, 1.0, workdir=str(tmp_path), power_loss=True, faults=("write_error",))


def test_a_down_nodes_links_refuse_new_connections_until_it_runs_again(tmp_path):
    """Through the fault proxies, a call to a node whose process is gone fails to
    connect, as it would against the node's own port: ``unavailable`` (nothing was
    sent), not a connection accepted by the proxy and then reset (an unknown
    outcome). Once the node runs again its links listen again, on the same ports."""
    from drills.cluster import CLIENTS, GRPC, Cluster
    from nodeproc import wait_until
    from spooler import errors
    from spooler.http import HttpClient

    with Cluster(str(tmp_path / "c"), client_partitions=True, partitions=True) as c:
        c.primary()
        url = c.client_url("n2")
        HttpClient(url, c.admin_key, timeout_s=3.0).cluster()  # through the proxy
        c.kill("n2")
        links = [f"{CLIENTS}->n2", f"{CLIENTS}->n2{GRPC}"]
        wait_until(lambda: all(c.client_proxy.stats()[k]["refusing"] for k in links), 10.0,
                   what="n2's client links refusing")
        wait_until(lambda: all(c.proxy.stats()[f"{o}->n2"]["refusing"] for o in ("n1", "n3")), 10.0,
                   what="the links of n2's peers to it refusing")
        with pytest.raises(errors.Unavailable, match="cannot connect"):
            HttpClient(url, c.admin_key, timeout_s=3.0).cluster()
        assert not any(c.client_proxy.stats()[k]["upstream_failed"] for k in links)
        # calls all through the restart: while the new process starts (running, its
        # HTTP port not yet known to the proxy) they are refused too, never accepted
        # and then reset for want of the node's port
        stop, seen = threading.Event(), []

        def calls():
            while not stop.is_set():
                try:
                    HttpClient(url, c.admin_key, timeout_s=3.0).cluster()
                    seen.append("ok")
                except errors.SpoolerError as e:
                    seen.append(str(e))
                stop.wait(0.01)
        t = threading.Thread(target=calls, daemon=True)
        t.start()
        try:
            c.restart("n2")
            wait_until(lambda: not any(c.client_proxy.stats()[k]["refusing"] for k in links), 10.0,
                       what="n2's client links listening again")
            wait_until(lambda: "ok" in seen, 10.0, what="a call through n2's link answered")
        finally:
            stop.set()
            t.join(timeout=10)
        assert c.client_proxy.stats()[f"{CLIENTS}->n2"]["upstream_failed"] == 0, seen
        assert all(x == "ok" or "cannot connect" in x for x in seen), seen
        assert c.client_url("n2") == url
        HttpClient(url, c.admin_key, timeout_s=3.0).cluster()


def test_an_sdk_receive_whose_answer_was_lost_is_recorded_unknown():
    """The SDK answers a receive whose request left but whose answer never came
    ``unavailable`` (a read: safe to repeat), marked ``answer_lost``: it may have
    leased, and its leases may expire and count before its release lands. The drill
    records it unknown, so that the checker lets such a lease explain a raised retry
    count; a plain ``unavailable`` (nothing reached a node) stays a definite failure."""
    from drills.drill import classify
    from spooler import errors
    from spooler._common import read_lost

    assert classify(read_lost("no answer within the timeout"))[0] == "unknown"
    assert classify(errors.Unavailable("no connection to the node"))[0] == "fail"
