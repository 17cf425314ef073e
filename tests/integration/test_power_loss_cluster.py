"""Power loss of whole node processes (SPOOLER_TEST_VFS=buffered: nothing reaches
the disk before fsync, so SIGKILL = power cut), single node and cluster."""
import time

from integration.test_cluster import primary_of, send_until_ok, until_ok, view
from node.main import EXIT_STORE_FAILED
from nodeproc import NodeProc, start_cluster, wait_until
from spooler import errors
from spooler.http import HttpClient

BUFFERED = {"SPOOLER_TEST_VFS": "buffered"}


def drain(c, queue, timeout_s=15):
    got, deadline = [], time.monotonic() + timeout_s
    while True:
        try:
            d = c.receive(queue)
        except errors.Unavailable:
            # a new primary still waiting out older primaries' leases (R2) says so
            # with 503 and Retry-After, which the SDK retries; so do we
            assert time.monotonic() < deadline, "receive still unavailable"
            time.sleep(0.02)
            continue
        if d is None:
            return got
        got.append(d.id)
        c.ack(d.token)


def confirmed_sends(c, queue, n):
    return [c.send(queue, f"m{i}".encode())["id"] for i in range(n)]


def test_single_node_power_loss_keeps_confirmed_writes(tmp_path):
    n = NodeProc(str(tmp_path / "n"), env=BUFFERED)
    try:
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        c.put_queue("q")
        sent = confirmed_sends(c, "q", 200)
        n.kill()  # power cut: the process's unsynced writes are gone
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        assert sorted(drain(c, "q")) == sorted(sent)
    finally:
        n.kill()


def test_control_synchronous_normal_loses_writes_on_power_loss(tmp_path):
    n = NodeProc(str(tmp_path / "n"), env={**BUFFERED, "SPOOLER_TEST_SYNCHRONOUS": "NORMAL"})
    try:
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        c.put_queue("q")
        sent = confirmed_sends(c, "q", 200)
        n.kill()
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        try:
            got = drain(c, "q")
        except errors.QueueNotFound:
            got = []
        assert set(sent) - set(got), "the harness must see the loss that skipping fsync causes"
    finally:
        n.kill()


def test_fsync_error_stops_a_node_and_it_rejoins(tmp_path):
    fail = tmp_path / "fail-fsync"
    n = NodeProc(str(tmp_path / "n"), env={**BUFFERED, "SPOOLER_TEST_FSYNC_FAIL_FILE": str(fail)})
    try:
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        c.put_queue("q")
        before = confirmed_sends(c, "q", 20)
        fail.write_text("")
        try:
            c.send("q", b"during")
            raise AssertionError("a send was confirmed although fsync failed")
        except errors.SpoolerError:
            pass
        assert n.proc.wait(timeout=10) == EXIT_STORE_FAILED  # it stopped instead of serving on
        fail.unlink()
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        got = drain(c, "q")
        assert set(before) <= set(got)
    finally:
        n.kill()


def test_cluster_power_loss_of_primary_and_replica(tmp_path):
    ids = ["n1", "n2", "n3"]
    nodes = start_cluster(str(tmp_path), 3, 1.0, env=BUFFERED)
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        c = HttpClient(nodes[p].http_url, nodes[p].admin_key)
        until_ok(lambda: c.put_queue("q"))
        sent = [send_until_ok(c, "q", f"a{i}".encode())["id"] for i in range(100)]
        replica = next(i for i in ids if i != p)
        nodes[replica].kill()  # power loss of a replica
        sent += [send_until_ok(c, "q", f"b{i}".encode())["id"] for i in range(50)]
        nodes[replica].start()
        nodes[p].kill()  # power loss of the primary
        q, _ = wait_until(lambda: primary_of(nodes, exclude=(p,)), 15, what="a new primary")
        c2 = HttpClient(nodes[q].http_url, nodes[q].admin_key)
        send_until_ok(c2, "q", b"after")
        nodes[p].start()
        top = view(nodes[q])["appliedLsn"]
        wait_until(lambda: all((view(x) or {}).get("appliedLsn", -1) >= top for x in nodes.values()), 15,
                   what="everyone caught up")
        got = wait_until(lambda: drain(c2, "q") or None, 10, what="the messages after the lease fence")
        assert set(sent) <= set(got)
    finally:
        for x in nodes.values():
            x.kill()
