"""Power loss of whole node processes (SPOOLER_TEST_VFS=buffered: nothing reaches
the disk before fsync, so SIGKILL = power cut), single node and cluster."""
import time

from integration.test_cluster import all_applied, primary_of, send_until_ok, until_ok, view
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


def _a_storage_error_stops_a_node_and_it_rejoins(tmp_path, fault_env: str):
    """S9: while ``fault_env``'s file exists the node's store fails (test VFS); a send
    then gets no 201, the node exits 70, and started again on the same data it has
    every send it confirmed, once."""
    fail = tmp_path / "fail"
    n = NodeProc(str(tmp_path / "n"), env={**BUFFERED, fault_env: str(fail)})
    try:
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        c.put_queue("q")
        before = confirmed_sends(c, "q", 20)
        fail.write_text("")
        try:
            c.send("q", b"during")
            raise AssertionError("a send was confirmed although its write failed")
        except errors.SpoolerError:
            pass
        assert n.proc.wait(timeout=10) == EXIT_STORE_FAILED  # it stopped instead of serving on
        fail.unlink()
        n.start()
        c = HttpClient(n.http_url, n.admin_key)
        got = drain(c, "q")
        assert set(before) <= set(got) and len(got) == len(set(got)), got
    finally:
        n.kill()


def test_fsync_error_stops_a_node_and_it_rejoins(tmp_path):
    _a_storage_error_stops_a_node_and_it_rejoins(tmp_path, "SPOOLER_TEST_FSYNC_FAIL_FILE")


def test_write_error_stops_a_node_and_it_rejoins(tmp_path):
    _a_storage_error_stops_a_node_and_it_rejoins(tmp_path, "SPOOLER_TEST_WRITE_FAIL_FILE")


def _primary_with_sends(nodes, n: int) -> tuple:
    """The cluster's primary once elected, a client of it, and the ids of ``n``
    sends it confirmed to queue "q" (made)."""
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    c = HttpClient(nodes[p].http_url, nodes[p].admin_key)
    until_ok(lambda: c.put_queue("q"))
    return p, c, [send_until_ok(c, "q", f"a{i}".encode())["id"] for i in range(n)]


def test_a_write_error_stops_a_replica_with_nothing_else_to_write(tmp_path):
    """S9 on a replica: its store's writes fail once its checkpoints have written
    everything, so the failing write is a primary's frame's. It must exit 70, not
    go on taking frames into that store (it did: only a checkpoint's failure
    stopped it, and a quiet replica had none to make). The primary commits with
    the other replica meanwhile; restarted, the replica catches up, and every
    confirmed send is there once."""
    fails = {i: tmp_path / f"{i}.fail-write" for i in ("n1", "n2", "n3")}
    nodes = start_cluster(str(tmp_path), 3, 1.0, env=BUFFERED,
                          per_node_env=lambda i: {"SPOOLER_TEST_WRITE_FAIL_FILE": str(fails[i])})
    try:
        p, c, sent = _primary_with_sends(nodes, 20)
        r = next(i for i in nodes if i != p)
        top = view(nodes[p])["appliedLsn"]
        wait_until(lambda: all_applied(nodes, top), 15, what="every node applied every send")
        quiet = {"n": -1.0, "since": time.monotonic()}

        def checkpoints_done():  # none for 2.5 s: more than two of its checkpoint intervals
            n = nodes[r].metric("spooler_checkpoint_seconds_count")
            if n != quiet["n"]:
                quiet["n"], quiet["since"] = n, time.monotonic()
            return time.monotonic() - quiet["since"] >= 2.5
        wait_until(checkpoints_done, 20, interval_s=0.1, what="the replica's checkpoints to stop")
        fails[r].write_text("")
        sent.append(send_until_ok(c, "q", b"during")["id"])  # committed with the other replica
        assert nodes[r].proc.wait(timeout=10) == EXIT_STORE_FAILED
        fails[r].unlink()
        nodes[r].start()
        top = view(nodes[p])["appliedLsn"]
        wait_until(lambda: all_applied(nodes, top), 15, what="the replica caught up")
        got = drain(c, "q")
        assert set(sent) <= set(got) and len(got) == len(set(got)), got
    finally:
        for x in nodes.values():
            x.kill()


def test_cluster_power_loss_of_primary_and_replica(tmp_path):
    ids = ["n1", "n2", "n3"]
    nodes = start_cluster(str(tmp_path), 3, 1.0, env=BUFFERED)
    try:
        p, c, sent = _primary_with_sends(nodes, 100)
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
