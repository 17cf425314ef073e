"""A replica that fell behind the primary's compacted log catches up from a snapshot."""
import contextlib

import pytest

from integration.test_cluster import primary_of, send_until_ok, until_ok, view
from nodeproc import start_cluster, wait_until
from spooler.http import HttpClient


# the log's tail bounded by its count of records, or by its bytes (about 30 of
# these records) while the count allows far more than are sent
@pytest.mark.parametrize("keep", [["--log-keep-records", "10"],
                                  ["--log-keep-records", "100000", "--log-keep-bytes", "2000"]],
                         ids=["records", "bytes"])
def test_lagging_replica_catches_up_from_a_snapshot(tmp_path, keep):
    ids = ["n1", "n2", "n3"]
    with _a_replica_down_behind_the_kept_log(tmp_path, 200, keep) as (nodes, p, c, lagging, top):
        nodes[lagging].start()
        wait_until(lambda: (view(nodes[lagging]) or {}).get("appliedLsn", -1) >= top, 20,
                   what="the lagging replica to catch up")
        # it got there through a snapshot (the log line follows the swap by a moment)
        wait_until(lambda: "installed a snapshot" in nodes[lagging].read_log(), 5, what="the snapshot log line")
        # it holds the data: make it the primary and read everything back from it
        other = next(i for i in ids if i not in (p, lagging))
        nodes[p].kill()
        nodes[other].kill()
        nodes[p].start()  # a majority again: lagging + old primary
        q, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        c2 = HttpClient(nodes[q].http_url, nodes[q].admin_key)
        st = until_ok(lambda: c2.get_queue("q"))["stats"]
        assert st["sentTotal"] == 200


def _compacted(node, top):
    import apsw
    import os
    db = apsw.Connection(os.path.join(node.data_dir, "spool.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        (first,), = db.execute("SELECT coalesce(min(lsn), 0) FROM log")
        return first > 5
    finally:
        db.close()


def test_a_replacement_that_needs_a_snapshot_joins_after_it(tmp_path):
    """A replacement (--join, empty store) whose primary has compacted its log gets
    a snapshot, is still joining right after it, and joins once it follows the
    primary; its data is complete (it can be the primary)."""
    ids = ["n1", "n2", "n3"]
    with _a_replica_down_behind_the_kept_log(tmp_path, 100) as (nodes, p, c, b, top):
        nodes[b].data_dir = str(tmp_path / "replacement")  # the disk is lost
        nodes[b].extra_args.append("--join")
        nodes[b].start()

        def me():
            v = view(nodes[b]) or {"nodes": []}
            return next((n for n in v["nodes"] if n["id"] == b), {})
        wait_until(lambda: "installed a snapshot" in nodes[b].read_log(), 20, what="the snapshot")
        wait_until(lambda: me() and "joining" not in me(), 20, what="the replacement joining")
        wait_until(lambda: "joined the cluster" in nodes[b].read_log(), 5, what="the log line")
        text = nodes[b].read_log()
        assert text.index("installed a snapshot") < text.index("joined the cluster")  # still joining after it
        other = next(i for i in ids if i not in (p, b))
        nodes[p].kill()
        nodes[other].kill()
        nodes[other].start()  # a majority again: the replacement + the other
        q, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        st = until_ok(lambda: HttpClient(nodes[q].http_url, nodes[q].admin_key).get_queue("q"))["stats"]
        assert st["sentTotal"] == 100


def test_a_primary_keeps_the_member_it_needs_while_it_sends_that_member_a_snapshot(tmp_path):
    """One member of three is down, and the primary's only partner needs a snapshot
    that takes 3 s to arrive (a slow link: SPOOLER_TEST_SNAPSHOT_DELAY) against a 1 s
    failover timeout. Heartbeats go on to it meanwhile and it answers them, so the
    primary keeps its majority (and its epoch: no lease goes stale), the partner
    keeps its primary, and the copy is installed. Without them, the primary stepped
    down during every copy, and each new epoch refused the copy made in the last."""
    ids = ["n1", "n2", "n3"]
    nodes = start_cluster(str(tmp_path), 3, 1.0, extra_args=["--log-keep-records", "10"],
                          env={"SPOOLER_TEST_SNAPSHOT_DELAY": "3"})
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        c = HttpClient(nodes[p].http_url, nodes[p].admin_key)
        until_ok(lambda: c.put_queue("q"))
        lagging = next(i for i in ids if i != p)
        other = next(i for i in ids if i not in (p, lagging))
        nodes[lagging].kill()
        for i in range(60):
            send_until_ok(c, "q", f"m{i}".encode())
        wait_until(lambda: _compacted(nodes[p], 0), 15, what="the primary to compact its log")
        nodes[other].kill()  # from here the lagging member is the primary's only partner
        nodes[lagging].start()
        # the copy is under way (its primary had a majority when it began it): from
        # here on, the two agree on one epoch, which stays until the copy is in.
        # (The same primary: the lagging member's own log cannot win a vote; in the
        # same epoch if it answered before the primary, alone, stepped down, else in
        # the next.)
        wait_until(lambda: f"sending a snapshot to {lagging}" in nodes[p].read_log(), 15, what="the copy to begin")

        def agreed():
            v = view(nodes[lagging]) or {}
            return v.get("primary") == p and primary_of(nodes) == (p, v.get("epoch")) and v["epoch"]
        epoch = wait_until(agreed, 15, what="the two to agree on the primary and epoch")
        wait_until(lambda: "installed a snapshot" in nodes[lagging].read_log(), 20, what="the copy installed")
        assert primary_of(nodes) == (p, epoch)
        assert (view(nodes[lagging]) or {}).get("epoch") == epoch
        # and the two confirm writes together
        send_until_ok(c, "q", b"after")
        assert until_ok(lambda: c.get_queue("q"))["stats"]["sentTotal"] == 61
    finally:
        for n in nodes.values():
            n.kill()


def test_a_replica_that_is_down_is_not_sent_copy_after_copy_of_the_store(tmp_path):
    """A primary whose replica is down, and behind the kept log, made a whole copy
    of its store for it about ten times a second (each failed once made: the
    stream's retries asked for it again), for as long as the replica stayed
    down. A copy is made only for a replica that answers, with a backoff after
    a failed one; the replica, once back, still catches up from one."""
    import time

    with _a_replica_down_behind_the_kept_log(tmp_path, 60) as (nodes, p, c, down, top):
        def attempts():
            return nodes[p].read_log().count(f"sending a snapshot to {down}")

        # the window: three seconds once the log is compacted, in which the old
        # code made about thirty copies; failing as soon as there are a few
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            assert attempts() <= 2, f"{attempts()} copies of the store made for a replica that is down"
            time.sleep(0.1)
        assert attempts() <= 2
        nodes[down].start()
        wait_until(lambda: (view(nodes[down]) or {}).get("appliedLsn", -1) >= top, 30,
                   what="the replica, back, to catch up")
        wait_until(lambda: "installed a snapshot" in nodes[down].read_log(), 5, what="the snapshot log line")


def test_a_replica_whose_installs_fail_is_sent_copies_with_a_growing_pause(tmp_path):
    """The backoff after a failed copy (0.25 s, doubling up to 10 s): a replica that
    answers frames but fails every install (SPOOLER_TEST_SNAPSHOT_REFUSE) is sent
    a few copies in three seconds, not one per heartbeat (dozens), and still more
    later (the primary goes on trying)."""
    import time

    with _a_replica_down_behind_the_kept_log(tmp_path, 60) as (nodes, p, c, down, top):
        def attempts():
            return nodes[p].read_log().count(f"sending a snapshot to {down}")

        nodes[down].env = {"SPOOLER_TEST_SNAPSHOT_REFUSE": "1"}
        nodes[down].start()
        wait_until(lambda: "refused a snapshot" in nodes[down].read_log(), 30, what="the first copy refused")
        first = attempts()
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            # with no backoff: one per heartbeat (0.1 s here); with it, 0.25 + 0.5 + 1 + 2 s apart
            assert attempts() - first <= 4, f"{attempts() - first} more copies in 3 s for a replica that fails them"
            time.sleep(0.1)
        wait_until(lambda: attempts() - first >= 3, 30, what="the primary to try again after its pauses")


@contextlib.contextmanager
def _a_replica_down_behind_the_kept_log(tmp_path, sends: int, keep=("--log-keep-records", "10")):
    """A 3-node cluster keeping ``keep`` of log; a replica killed, then ``sends``
    sends, and the primary's log compacted past what that replica holds. ->
    (nodes, primary id, its client, the replica's id, the primary's applied lsn);
    every node is killed at the end."""
    nodes = start_cluster(str(tmp_path), 3, 1.0, extra_args=list(keep))
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        c = HttpClient(nodes[p].http_url, nodes[p].admin_key)
        until_ok(lambda: c.put_queue("q"))
        down = next(i for i in nodes if i != p)
        nodes[down].kill()
        for i in range(sends):
            send_until_ok(c, "q", f"m{i}".encode())
        top = view(nodes[p])["appliedLsn"]
        wait_until(lambda: _compacted(nodes[p], top), 15, what="the primary to compact its log")
        yield nodes, p, c, down, top
    finally:
        for n in nodes.values():
            n.kill()
