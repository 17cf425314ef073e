"""A node's start and stop: what it answers while it loads its store, and what a
stop does to a checkpoint under way."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nodeproc import ADMIN_KEY, NodeProc, free_ports
from node.api.service import Principal, Service
from node.engine import Engine
from spooler import Client, errors
from spooler.pb import api_pb2, api_pb2_grpc

ADMIN = Principal(admin=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# spooler-node with its store's load held up while the file argv[1] exists (at most
# 60 s; a large store takes a while to load): the window between the gRPC server's
# start and the node's readiness, held open until the test has seen what it needs
SLOW_NODE = """
import os, sys, time
from node import process
process.prepare()
from node.engine import Engine
load = Engine.load
def slow(self):
    end = time.monotonic() + 60
    while os.path.exists(sys.argv[1]) and time.monotonic() < end:
        time.sleep(0.02)
    load(self)
Engine.load = slow
from node.main import main
sys.exit(main(sys.argv[2:]))
"""


def test_while_a_node_loads_it_is_not_serving_and_calls_no_key_unknown(tmp_path):
    """Until the store is loaded, gRPC health says NOT_SERVING (grpcio's health
    service starts out SERVING), a scoped key the store holds is answered
    ``unavailable``, never 401 ``unknown key`` (clients take a 401 as final), and
    GetCluster is ``unavailable`` instead of a blank epoch 0."""
    data = str(tmp_path / "n")
    first = NodeProc(data, admin_key=ADMIN_KEY).start()
    try:
        with Client(first.grpc_target, ADMIN_KEY) as c:
            c.put_queue("q")
            scoped = c.create_key("q", ("send", "receive", "admin")).key
    finally:
        first.stop()
    gport, hport = free_ports(2)
    log = open(os.path.join(data, "slow.log"), "ab")
    gate = tmp_path / "loading"
    gate.touch()
    p = subprocess.Popen([sys.executable, "-c", SLOW_NODE, str(gate), "--id", "n1", "--data", data, "--http",
                          f"127.0.0.1:{hport}", "--grpc", f"127.0.0.1:{gport}", "--admin-key", ADMIN_KEY],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=log)
    try:
        # (retried connections every 0.1-0.2 s, not after gRPC's growing backoff:
        # the node starts listening while the test is already calling)
        ch = grpc.insecure_channel(f"127.0.0.1:{gport}", options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 200)])
        health, stub = health_pb2_grpc.HealthStub(ch), api_pb2_grpc.SpoolerStub(ch)
        seen = {"health": set(), "scoped": set(), "cluster": set()}
        refused = 0  # the scoped key's calls answered unavailable
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            if gate.exists() and refused >= 3 and "UNAVAILABLE" in seen["cluster"]:
                gate.unlink()  # the loading window was seen: let the load go on
            try:
                seen["health"].add(health_pb2.HealthCheckResponse.ServingStatus.Name(
                    health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status))
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise  # (UNAVAILABLE: not listening yet; a deadline: a slow machine)
                time.sleep(0.05)
                continue
            for name, md in (("scoped", scoped), ("cluster", ADMIN_KEY)):
                try:
                    if name == "scoped":
                        stub.GetQueue(api_pb2.QueueRequest(name="q"), metadata=[("authorization", f"Bearer {md}")],
                                      timeout=5)
                    else:
                        stub.GetCluster(api_pb2.Empty(), metadata=[("authorization", f"Bearer {md}")], timeout=5)
                    seen[name].add("OK")
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        continue  # no answer in 5 s (a slow machine): says nothing either way
                    seen[name].add(e.code().name)
                    if name == "scoped" and e.code() == grpc.StatusCode.UNAVAILABLE:
                        refused += 1
            if "OK" in seen["scoped"]:
                break
            time.sleep(0.05)
        ch.close()
        assert refused >= 3, seen  # the loading window was seen, more than once
        assert seen["health"] <= {"NOT_SERVING", "SERVING"} and "NOT_SERVING" in seen["health"], seen
        assert seen["scoped"] <= {"UNAVAILABLE", "OK"} and "UNAVAILABLE" in seen["scoped"], seen
        assert seen["cluster"] <= {"UNAVAILABLE", "OK"} and "UNAVAILABLE" in seen["cluster"], seen
        line = p.stdout.readline()  # the ready line: the scoped key works from here
        assert json.loads(line)["event"] == "ready"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        log.close()


def test_a_forwarded_call_with_a_key_this_replica_does_not_know_is_not_called_unknown(tmp_path):
    """A call forwarded to a node that is not (or not yet) serving as the primary
    (a restart, a step-down) cannot be judged there: unavailable, not 401."""
    e = Engine(str(tmp_path / "r"), node_id="n2", peers={"n1": "127.0.0.1:1", "n2": "127.0.0.1:2"})
    try:
        svc = Service(e, [ADMIN_KEY])
        with pytest.raises(errors.Unavailable):  # still loading: nobody's key can be judged
            svc.authenticate("Bearer spk_abc_def")
        e.load()
        with pytest.raises(errors.Unavailable):  # loaded, a replica: the primary judges, not us
            svc.authenticate("Bearer spk_abc_def", forwarded="n1")
        with pytest.raises(errors.Unauthenticated):  # no key of ours has such characters
            svc.authenticate("Bearer spk_abc_d\u00e9f", forwarded="n1")
        assert svc.authenticate(f"Bearer {ADMIN_KEY}", forwarded="n1").admin
    finally:
        e.store.close()


def test_a_replica_passes_a_key_it_has_not_applied_yet_to_the_primary(tmp_path):
    """A client's call to a replica with a key the primary created a moment ago,
    whose record has not reached the replica: the replica does not call it unknown
    but has the primary judge it, and the call succeeds; a key the primary does not
    know either gets the primary's 401. Once the replica knows no primary, nobody
    can judge a key it does not know: 503, not 401. The replica's own stream from
    the primary is held in the fault proxy (its calls to the primary pass), so the
    key's record deterministically has not arrived; without the pass-on every call
    with the new key there was a 401."""
    from spooler.http import HttpClient
    from nodeproc import wait_until
    from tests.drills.cluster import Cluster

    with Cluster(str(tmp_path / "c"), failover_timeout_s=3.0, partitions=True) as c:
        prim = c.primary()
        rep = next(n for n in c.ids if n != prim)
        admin = HttpClient(c.url(prim), c.admin_key, timeout_s=10)

        def put() -> bool:
            try:
                admin.put_queue("fresh")
                return True
            except errors.Unavailable:  # a new primary answers 503 until its epoch is open
                return False
        wait_until(put, 10, what="the primary to take the queue")
        c.wait_converged()
        c.proxy.set_link(prim, rep, "blackhole")  # nothing of the primary's reaches the replica
        key = admin.create_key("fresh", ("send", "receive"))["key"]
        via_replica = HttpClient(c.url(rep), key, timeout_s=10)
        assert via_replica.send("fresh", b"with a new key")["id"]
        with pytest.raises(errors.Unauthenticated):  # the primary's verdict on a key nobody has
            HttpClient(c.url(rep), "spk_nope_nope", timeout_s=10).send("fresh", b"x")
        # a failover timeout without the primary: the replica drops it (R4), and then
        # cannot have the new key judged
        wait_until(lambda: (v := c.info(rep)) and v.get("primary") is None, 15,
                   what="the replica to drop the primary it no longer hears")
        with pytest.raises(errors.Unavailable):
            via_replica.send("fresh", b"no primary known")
        c.proxy.heal()


def test_a_ready_primary_calls_an_unknown_key_unknown(tmp_path):
    """The control: where the key can be judged, an unknown one is a 401."""
    async def main():
        e = Engine(str(tmp_path / "p"))
        await e.start()
        try:
            svc = Service(e, [ADMIN_KEY])
            for fwd in ("", "n9"):
                with pytest.raises(errors.Unauthenticated):
                    svc.authenticate("Bearer spk_abc_def", forwarded=fwd)
        finally:
            await e.stop()

    asyncio.run(main())


async def _stop_with_the_writer_busy(d: str, busy: bool) -> dict:
    e = Engine(d, checkpoint_interval_s=0.2)
    await e.start()
    svc = Service(e, [ADMIN_KEY])
    await svc.put_queue(ADMIN, "q", {})
    await svc.send(ADMIN, [("q", b"m%d" % i, 0.0, "") for i in range(5)])
    if busy:
        # the writer thread busy with something else (a snapshot's slice, a large commit)
        asyncio.ensure_future(e.store_io(time.sleep, 1.0))
        await asyncio.sleep(0)
        deadline = time.monotonic() + 5
        while len(e.core.dirty) and time.monotonic() < deadline:  # the checkpoint took its changes
            await asyncio.sleep(0.01)
        assert not len(e.core.dirty), "no checkpoint began"
    await e.stop()  # what a node does last on SIGTERM
    again = Engine(d)
    await again.start()
    try:
        return again.core.stats("q", again.now_us()) if "q" in again.core.queues else None
    finally:
        await again.stop()


@pytest.mark.parametrize("busy", [False, True])
def test_a_checkpoint_under_way_when_the_node_stops_is_written(tmp_path, busy):
    """A checkpoint takes the core's changes, then waits for the writer thread. A
    stop that cancelled it there dropped the write, and the stop's own last
    checkpoint recorded the applied position without those changes: after a
    restart the queue and its five answered messages were gone."""
    got = asyncio.run(_stop_with_the_writer_busy(str(tmp_path / "n"), busy))
    assert got is not None and got["visible"] == 5, got


def test_a_background_task_that_dies_stops_the_node(tmp_path):
    """A background task that dies (here the lease timer, on a broken invariant)
    stops the node (S8): it is told to exit (on_fatal, exit code 71 in a process),
    stops serving and refuses writes, instead of running on without the task."""
    async def main():
        e = Engine(str(tmp_path / "n"))
        await e.start()
        stopped = []
        e.on_fatal = stopped.append
        try:
            svc = Service(e, [ADMIN_KEY])
            await svc.put_queue(ADMIN, "q", {})

            def broken(*args, **kw):
                raise RuntimeError("a broken invariant")
            e.core.due_expiries = broken  # the lease timer's next tick (20 ms) raises
            deadline = time.monotonic() + 5
            while not stopped and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert [str(x) for x in stopped] == ["a broken invariant"], "the node did not stop"
            assert e.failed is stopped[0] and not e.ready and not e.serving()
            with pytest.raises(errors.Unavailable):
                await svc.send(ADMIN, [("q", b"after", 0.0, "")])
        finally:
            await e.stop()

    asyncio.run(main())


# spooler-node whose lease timer raises once the file named by BREAK_FILE exists:
# a background task that dies on a broken invariant, in a real process
BROKEN_NODE = """
import os, sys
from node import process
io = process.prepare()
from node.core.spool import Core
due = Core.due_expiries
def broken(self, *args, **kw):
    if os.path.exists(os.environ["BREAK_FILE"]):
        raise RuntimeError("a broken invariant")
    return due(self, *args, **kw)
Core.due_expiries = broken
from node.main import main
sys.exit(main(grpc_io=io))
"""


def test_a_node_stopped_by_a_dead_task_exits_71_which_the_systemd_unit_restarts(tmp_path):
    """A background task that dies is a bug, not the disk: the process exits 71,
    which ``RestartPreventExitStatus`` (70: a store that failed, or a committed-log
    conflict, fails again on the same store) leaves to ``Restart=on-failure``.
    Its critical line names an internal failure, not a storage failure."""
    from node.main import EXIT_INTERNAL_FAILURE, EXIT_STORE_FAILED
    trigger = tmp_path / "break"
    n = NodeProc(str(tmp_path / "n"), entry=["-c", BROKEN_NODE], env={"BREAK_FILE": str(trigger)}).start()
    try:
        with Client(n.grpc_target, ADMIN_KEY) as c:
            c.put_queue("q")
            c.send("q", b"before")
        trigger.touch()
        assert n.proc.wait(timeout=15) == EXIT_INTERNAL_FAILURE == 71, n.read_log()
        text = n.read_log()
        assert "internal failure, the node stops serving: RuntimeError('a broken invariant')" in text, text
        assert "storage failure" not in text, text
    finally:
        n.kill()
    unit = open(os.path.join(REPO, "deploy", "systemd", "spooler-node.service")).read()
    lines = unit.splitlines()
    prevent = next(x for x in lines if x.startswith("RestartPreventExitStatus=")).partition("=")[2].split()
    assert "Restart=on-failure" in lines and prevent == [str(EXIT_STORE_FAILED)], prevent


def test_a_store_whose_state_breaks_the_cores_invariants_does_not_start(tmp_path):
    """A store whose tables no longer hold together (here a message's row renamed
    to the id of a message still inside a batch's segment: the same message id
    twice) used to load and serve: a receive handed that id out twice, with the
    segment's body both times (the renamed message's own body never came out).
    The load now recounts the state (Core.check) and the
    node does not start: exit 70, which the systemd unit does not restart (the
    store would fail the same way again), its critical line naming what is broken."""
    import apsw

    from node.main import EXIT_STORE_FAILED
    n = NodeProc(str(tmp_path / "n")).start()
    try:
        with Client(n.grpc_target, ADMIN_KEY) as c:
            c.put_queue("q")
            solo = c.send("q", b"alone").id
        with grpc.insecure_channel(n.grpc_target) as ch:  # a batch in the compact form: one segment
            batch = list(api_pb2_grpc.SpoolerStub(ch).SendBatch(
                api_pb2.SendBatchRequest(queue="q", bodies=[b"in a segment"] * 10),
                metadata=[("authorization", f"Bearer {ADMIN_KEY}")], timeout=10).run_ids)
        assert len(batch) == 10
        assert n.stop() == 0, n.read_log()
        db = apsw.Connection(os.path.join(n.data_dir, "spool.db"))
        try:
            segments = list(db.execute("SELECT prefix, first, n FROM segments WHERE queue = 'q'"))
            assert len(segments) == 1, segments  # (the batch is held as one segment)
            db.execute("UPDATE messages SET id = ? WHERE id = ?", (batch[3], solo))
            assert db.changes() == 1
        finally:
            db.close()
        with pytest.raises(RuntimeError, match="did not become ready"):
            n.start()
        assert n.proc.returncode == EXIT_STORE_FAILED == 70, n.read_log()
        text = n.read_log()
        assert "CRITICAL" in text and "storage failure, the node stops serving: CorruptStore(" in text, text
        assert "the state loaded from the store breaks the core's invariants" in text, text
        assert f"message {batch[3]} of q is also untaken in a segment of q" in text, text
    finally:
        n.kill()
