"""--cluster-key: members' calls to each other carry the cluster's key, and a
member refuses replication calls without it (DESIGN.md, "Trust between nodes").
Without a key any caller that reaches the gRPC port could force an election
with one TimeoutNow naming the current epoch and primary, or feed a replica
frames as its primary."""
from __future__ import annotations

import grpc
import pytest

from integration.test_cluster import client, primary_of, send_until_ok, until_ok
from nodeproc import start_cluster, wait_until
from spooler.pb import api_pb2, api_pb2_grpc, replication_pb2, replication_pb2_grpc

KEY = "the-cluster-key"


@pytest.fixture
def keyed(tmp_path):
    nodes = start_cluster(str(tmp_path), 3, 1.0, extra_args=["--cluster-key", KEY])
    try:
        yield nodes
    finally:
        for n in nodes.values():
            n.kill()


def test_a_keyed_cluster_replicates_and_refuses_replication_calls_without_its_key(keyed):
    nodes = keyed
    p, epoch = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = client(nodes[p])
    until_ok(lambda: c.put_queue("k"))
    send_until_ok(c, "k", b"x")
    replica = next(i for i in nodes if i != p)
    # the members' own calls carry the key: a replica's forwarded read, and its log
    assert client(nodes[replica]).get_queue("k")["stats"]["sentTotal"] == 1

    ch = grpc.insecure_channel(nodes[replica].grpc_target)
    try:
        stub = replication_pb2_grpc.ReplicationStub(ch)
        for md in ((), (("spooler-cluster-key", "not-the-key"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.TimeoutNow(replication_pb2.TimeoutNowRequest(epoch=epoch, primary=p), metadata=md, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
            with pytest.raises(grpc.RpcError) as e:
                stub.Vote(replication_pb2.VoteRequest(epoch=epoch + 1, candidate=replica, last_epoch=epoch,
                                                      last_lsn=10 ** 9, pre=False), metadata=md, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Stream(iter([replication_pb2.AppendFrame(epoch=epoch, primary=p)]), metadata=md, timeout=5))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    finally:
        ch.close()
    assert primary_of(nodes) == (p, epoch)  # nothing above reached the replication core
    wait_until(lambda: "refused a replication call" in nodes[replica].read_log(), 10,
               what="the refusal in the replica's log")


def test_a_member_without_the_key_among_keyed_ones_says_so(tmp_path):
    """A member started without the key still follows a keyed primary (it checks
    nothing), and the cluster is open through it: it says so in its log."""
    nodes = start_cluster(str(tmp_path), 3, 1.0,
                          per_node_args=lambda i: [] if i == "n3" else ["--cluster-key", KEY])
    try:
        p, _ = wait_until(lambda: primary_of(nodes, exclude=("n3",)), 15, what="a keyed primary")
        until_ok(lambda: client(nodes[p]).put_queue("u"))
        wait_until(lambda: "this node has none" in nodes["n3"].read_log(), 10, what="n3's warning")
    finally:
        for n in nodes.values():
            n.kill()


def test_a_claim_to_be_forwarded_without_the_key_is_a_clients_call(keyed):
    """A caller that says it is a member forwarding a call (spooler-forwarded) but
    lacks the key is served as the client it is: the replica forwards its call to
    the primary as any other, instead of taking it for one a member sent."""
    nodes = keyed
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    until_ok(lambda: client(nodes[p]).put_queue("f"))
    replica = next(i for i in nodes if i != p)
    ch = grpc.insecure_channel(nodes[replica].grpc_target)
    try:
        stub = api_pb2_grpc.SpoolerStub(ch)
        md = (("authorization", f"Bearer {nodes[replica].admin_key}"), ("spooler-forwarded", p))
        doc = stub.GetQueue(api_pb2.QueueRequest(name="f"), metadata=md, timeout=10)
        assert doc.name == "f"
    finally:
        ch.close()


def test_a_keyed_members_forwarded_call_is_taken_for_forwarded(tmp_path):
    """On a keyed cluster the primary takes a call for one a member forwarded only
    if it carries the key, so a member's Forwarder sends the key on every call.
    Seen here through the lost-contact rule, which holds only for a receive the
    primary knows a member forwarded (its lease names that member): a replica
    forwards a receive and is then cut off (its calls reach the primary, nothing
    comes back, the primary hears nothing from it) for longer than the lease; at
    expiry the primary gives the lease back uncounted. A forwarded call without
    the key is a client's call there: the lease expired into a retry instead."""
    from integration.test_release import _forwarding_setup, _lost_receive_in_background, _metric
    from tests.drills.cluster import Cluster

    with Cluster(str(tmp_path / "c"), partitions=True, extra_args=["--cluster-key", KEY]) as c:
        prim, rep, direct, forwarded = _forwarding_setup(c, "kcut", lease_s=2, forward_timeout_s=6)
        c.proxy.set_links({(rep, prim): "one_way_reverse", (prim, rep): "blackhole"})
        t = _lost_receive_in_background(forwarded, "kcut")
        log = c.procs[prim].read_log
        wait_until(lambda: "gave back 1 expired lease(s)" in log() or _metric(c, prim, "spooler_lease_expiries_total"),
                   15, what="the lease to be given back, or to expire")
        assert _metric(c, prim, "spooler_lease_expiries_total") == 0, \
            "the lease expired into a retry: the primary took the forwarded receive for a client's"
        d = wait_until(lambda: direct.receive("kcut"), 10, what="the message to be visible again")
        assert (d.body, d.retry_count) == (b"m", 0)
        t.join(10)
        c.proxy.heal()
