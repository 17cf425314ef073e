"""Power loss: every write not fsync'd is gone. Confirmed sends and acks survive.

The node's engine runs in-process on the lossy VFS (tests/faults/lossy_vfs.py).
We confirm sends and acks, cut the power (an image of what the disk held),
and start a fresh engine on that image. The control run with
synchronous=NORMAL must lose confirmed sends: it shows the harness can see
the loss that synchronous=FULL prevents.
"""
import asyncio
import itertools
import os
import shutil

import apsw
import pytest

from faults.lossy_vfs import LossyVFS
from node.api.service import Principal, Service
from node.engine import Engine
from node.store.testvfs import BufferedVFS
from spooler import errors

ADMIN = Principal(admin=True)
_names = itertools.count()


async def _confirm_then_cut_power(tmp_path, synchronous, inline=True):
    vfs = LossyVFS(f"lossy{next(_names)}")
    eng = Engine(str(tmp_path / "live"), vfs=vfs.name, synchronous=synchronous, checkpoint_interval_s=0.05)
    if not inline:
        # every commit on the writer thread: an answer could then leave while its
        # fsync is still running, if anything answered before the fsync
        eng.inline_commit_records_max = 0
    await eng.start()
    svc = Service(eng, ["k"])
    await svc.put_queue(ADMIN, "q", {"leaseTimeoutSeconds": 60})
    sent = []
    for i in range(40):  # concurrent bursts: several group commits of several records
        if i % 4 == 0:  # and batches in the compact form: segments, checkpointed as one row each
            sent += [r[0] for r in await svc.send(ADMIN, [], ("q", [f"{i}-{j}".encode() for j in range(5)], 0.0))]
            continue
        res = await asyncio.gather(*[svc.send(ADMIN, [("q", f"{i}-{j}".encode(), 0.0, "")]) for j in range(5)])
        sent += [r[0][0] for r in res]
    acked = set()
    for d in await svc.receive(ADMIN, "q", 0, 50):
        await svc.ack(ADMIN, d.token)
        acked.add(d.id)
    # let checkpoints run too: they must not lose anything either (one has written every change so far)
    deadline = asyncio.get_running_loop().time() + 10
    while len(eng.core.dirty) or eng._checkpoint_write is None or not eng._checkpoint_write.done():
        assert asyncio.get_running_loop().time() < deadline, "no checkpoint ran"
        await asyncio.sleep(0.01)
    for i in range(10):
        sent += [x[0] for x in await svc.send(ADMIN, [("q", f"late-{i}".encode(), 0.0, "")])]
    sent += [x[0] for x in await svc.send(ADMIN, [], ("q", [b"late-batch-1", b"late-batch-2"], 0.0))]
    vfs.crash_image(str(tmp_path / "after"))  # the power goes out here
    abandon(eng)
    vfs.unregister()
    return sent, acked


async def _read_back(path):
    eng = Engine(path)
    await eng.start()
    svc = Service(eng, ["k"])
    seen = [d.id for d in await svc.receive(ADMIN, "q", 0, 1000)]
    integrity = eng.store.integrity_check()
    abandon(eng)
    return seen, integrity


def abandon(eng):
    """The process is gone: no graceful stop, no final checkpoint."""
    for t in eng._tasks:
        t.cancel()
    eng._io.shutdown(wait=True)


@pytest.mark.parametrize("inline", [True, False], ids=["small-commits-inline", "every-commit-on-the-writer"])
def test_power_loss_keeps_every_confirmed_write(tmp_path, inline):
    sent, acked = asyncio.run(_confirm_then_cut_power(tmp_path, "FULL", inline))
    seen, integrity = asyncio.run(_read_back(str(tmp_path / "after")))
    assert integrity == "ok"
    assert len(acked) == 50
    assert sorted(seen) == sorted(set(sent) - acked)  # nothing lost, no ack undone, no duplicate


def test_control_synchronous_normal_loses_confirmed_writes(tmp_path):
    sent, acked = asyncio.run(_confirm_then_cut_power(tmp_path, "NORMAL"))
    try:
        seen, _ = asyncio.run(_read_back(str(tmp_path / "after")))
    except (errors.QueueNotFound, apsw.Error, KeyError):
        seen = []  # lost so much that the queue itself is gone
    assert set(sent) - acked - set(seen), "the harness did not see the loss synchronous=NORMAL causes"


def test_fsync_error_stops_the_node_and_confirms_nothing(tmp_path):
    async def main():
        vfs = LossyVFS(f"lossy{next(_names)}")
        eng = Engine(str(tmp_path / "n"), vfs=vfs.name)
        stopped = []
        eng.on_fatal = stopped.append
        await eng.start()
        svc = Service(eng, ["k"])
        await svc.put_queue(ADMIN, "q", {})
        ok = (await svc.send(ADMIN, [("q", b"before", 0.0, "")]))[0][0]
        await eng.store_io(lambda: None)  # the writer is idle: the next fsync is the send's
        vfs.fail_syncs = 1  # only that one fails: a retry would succeed, and must not happen
        syncs = vfs.syncs
        with pytest.raises(errors.OperationUnconfirmed):  # answered, and soon: a send left unanswered fails here
            await asyncio.wait_for(svc.send(ADMIN, [("q", b"during", 0.0, "")]), 10)
        assert stopped and not eng.ready
        assert vfs.syncs == syncs + 1, "the failed fsync was tried again"
        with pytest.raises(errors.Unavailable):  # never confirms anything after
            await svc.send(ADMIN, [("q", b"after", 0.0, "")])
        assert vfs.syncs == syncs + 1  # nothing more was written
        abandon(eng)
        vfs.crash_image(str(tmp_path / "img"))
        vfs.unregister()
        return ok

    ok = asyncio.run(main())
    seen, integrity = asyncio.run(_read_back(str(tmp_path / "img")))
    assert integrity == "ok"
    assert ok in seen  # it rejoins with what it had confirmed


def test_an_fsync_error_answers_the_writes_queued_behind_it_unavailable(tmp_path):
    """The batch whose fsync failed is answered ``operation_unconfirmed`` (it may be
    on disk); the writes queued behind it ``unavailable`` (never written), at once:
    none is left waiting for an answer that would never come."""
    async def main():
        vfs = LossyVFS(f"lossy{next(_names)}")
        eng = Engine(str(tmp_path / "n"), vfs=vfs.name, checkpoint_interval_s=3600)
        eng.inline_commit_records_max = 0  # the loop keeps running while the fsync is held
        stopped = []
        eng.on_fatal = stopped.append
        await eng.start()
        svc = Service(eng, ["k"])
        await svc.put_queue(ADMIN, "q", {})
        await eng.store_io(lambda: None)  # the writer is idle: the held fsync is the first send's
        vfs.sync_gate.clear()
        vfs.sync_waiting.clear()
        first = asyncio.ensure_future(svc.send(ADMIN, [("q", b"in flight", 0.0, "")]))
        assert await asyncio.to_thread(vfs.sync_waiting.wait, 10)  # its fsync has begun
        queued = [asyncio.ensure_future(svc.send(ADMIN, [("q", b"queued %d" % i, 0.0, "")])) for i in range(3)]
        deadline = asyncio.get_running_loop().time() + 5
        while len(eng._pending) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        assert len(eng._pending) == 3, "the sends did not queue behind the held fsync"
        syncs = vfs.syncs
        vfs.fail_syncs = 1
        vfs.sync_gate.set()
        done, _ = await asyncio.wait([first, *queued], timeout=5)
        assert len(done) == 4, "a write was left without an answer"
        assert type(first.exception()) is errors.OperationUnconfirmed
        assert [type(f.exception()) for f in queued] == [errors.Unavailable] * 3
        assert stopped and not eng.ready
        assert vfs.syncs == syncs + 1  # nothing of the queued writes was written
        abandon(eng)
        vfs.unregister()

    asyncio.run(main())


def _cut_power(eng, fail, dest) -> str:
    """The power goes out under ``eng``, abandoned on the buffered test VFS
    (node/store/testvfs.py), which keeps every write not fsync'd in memory: what
    the disk holds is its store's files as they are, copied to ``dest``. Then
    the disk heals and the store is closed (a connection left open would be
    closed by the garbage collector later, into the failing writes)."""
    dest.mkdir()
    for suffix in ("", "-wal"):
        src = os.path.join(eng.data_dir, "spool.db" + suffix)
        if os.path.exists(src):
            shutil.copyfile(src, dest / ("spool.db" + suffix))
    fail.unlink()
    eng.store.close()
    return str(dest)


@pytest.fixture
def write_fault(tmp_path, monkeypatch):
    """A buffered test VFS whose writes fail while ``fail`` exists -> (vfs, fail)."""
    fail = tmp_path / "fail-write"
    monkeypatch.setenv("SPOOLER_TEST_WRITE_FAIL_FILE", str(fail))
    vfs = BufferedVFS(f"buffered{next(_names)}")
    yield vfs, fail
    vfs.unregister()


async def _serving_five_sends(tmp_path, vfs):
    """An engine on ``vfs`` (no checkpoint of its own accord) that confirmed five
    sends -> (engine, service, the errors it was told to stop for, the sends' ids)."""
    eng = Engine(str(tmp_path / "n"), vfs=vfs.name, checkpoint_interval_s=3600)
    stopped = []
    eng.on_fatal = stopped.append
    await eng.start()
    svc = Service(eng, ["k"])
    await svc.put_queue(ADMIN, "q", {})
    ok = [(await svc.send(ADMIN, [("q", b"before %d" % i, 0.0, "")]))[0][0] for i in range(5)]
    return eng, svc, stopped, ok


def test_a_write_error_stops_the_node_and_confirms_nothing(tmp_path, write_fault):
    """S9 for a write (not an fsync) that fails: the send whose commit it was is
    answered ``operation_unconfirmed``, the node is told to stop, nothing after
    is confirmed; on the disk as it was, every send confirmed before is there
    once, and the one whose write failed is not."""
    vfs, fail = write_fault

    async def main():
        eng, svc, stopped, ok = await _serving_five_sends(tmp_path, vfs)
        await eng.store_io(lambda: None)  # the writer is idle: the next write is the send's
        fail.write_text("")
        with pytest.raises(errors.OperationUnconfirmed):
            await asyncio.wait_for(svc.send(ADMIN, [("q", b"during", 0.0, "")]), 10)
        assert stopped and not eng.ready
        with pytest.raises(errors.Unavailable):  # never confirms anything after
            await svc.send(ADMIN, [("q", b"after", 0.0, "")])
        abandon(eng)
        return ok, _cut_power(eng, fail, tmp_path / "img")

    ok, img = asyncio.run(main())
    seen, integrity = asyncio.run(_read_back(img))
    assert integrity == "ok"
    assert sorted(seen) == sorted(ok)  # each confirmed send once; "during" is not there


def test_a_write_error_of_a_checkpoint_stops_the_node(tmp_path, write_fault):
    """S9 for the node's own checkpoint (a background write on the store's writer
    thread, no client waiting on it): its write fails, and the node is told to
    stop; what it had confirmed is on the disk, once."""
    vfs, fail = write_fault

    async def main():
        eng, _, stopped, ok = await _serving_five_sends(tmp_path, vfs)
        assert len(eng.core.dirty)  # the checkpoint has these to write
        fail.write_text("")
        eng._checkpoint_soon.set()  # the checkpoint loop wakes and writes now
        deadline = asyncio.get_running_loop().time() + 10
        while not stopped:
            assert asyncio.get_running_loop().time() < deadline, "the failed checkpoint did not stop the node"
            await asyncio.sleep(0.01)
        assert type(eng.failed) is apsw.IOError and not eng.ready
        abandon(eng)
        return ok, _cut_power(eng, fail, tmp_path / "img")

    ok, img = asyncio.run(main())
    seen, integrity = asyncio.run(_read_back(img))
    assert integrity == "ok"
    assert sorted(seen) == sorted(ok)


def test_a_send_is_invisible_until_it_is_durable(tmp_path):
    """Apply happens after fsync: while a send's fsync is pending, no consumer can
    receive it (so a consumer never sees a message that power loss could erase)."""
    async def main():
        vfs = LossyVFS(f"lossy{next(_names)}")
        eng = Engine(str(tmp_path / "n"), vfs=vfs.name, checkpoint_interval_s=3600)
        # commits on the writer thread, never inline: the loop must keep running
        # while the fsync hangs, so that the test can look at the state meanwhile
        eng.inline_commit_records_max = 0
        await eng.start()
        svc = Service(eng, ["k"])
        await svc.put_queue(ADMIN, "q", {})
        # the writer is idle: the fsync held below is the send's own (not an
        # earlier write's, behind which the send would wait whatever the order)
        await eng.store_io(lambda: None)
        vfs.sync_gate.clear()  # the next fsync hangs
        vfs.sync_waiting.clear()
        pending = asyncio.ensure_future(svc.send(ADMIN, [("q", b"in-flight", 0.0, "")]))
        assert await asyncio.to_thread(vfs.sync_waiting.wait, 10)  # the send's fsync has begun
        assert not pending.done()  # no 201 before fsync
        assert await svc.receive(ADMIN, "q", 0) == []  # and nothing to receive
        assert eng.core.stats("q", eng.now_us())["sentTotal"] == 0
        vfs.sync_gate.set()
        [(mid, dup, err)] = await pending
        assert err is None
        [d] = await svc.receive(ADMIN, "q", 0)
        assert d.id == mid and d.body == b"in-flight"
        abandon(eng)
        vfs.unregister()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["nack", "ack"])
def test_a_settle_in_flight_fences_its_lease(tmp_path, kind):
    """While a nack's or an ack's record waits for its fsync, it is not answered and
    its lease is fenced: a second nack or ack of the same token is not answered
    either until that fsync is done, then refused as settled, so the message is
    counted once and no second record is written (S2)."""
    async def main():
        vfs = LossyVFS(f"lossy{next(_names)}")
        eng = Engine(str(tmp_path / "n"), vfs=vfs.name, checkpoint_interval_s=3600)
        eng.inline_commit_records_max = 0  # the loop keeps running while the fsync is held
        await eng.start()
        svc = Service(eng, ["k"])
        await svc.put_queue(ADMIN, "q", {"maxRetries": 10})
        await svc.send(ADMIN, [("q", b"m", 0.0, "")])
        [d] = await svc.receive(ADMIN, "q", 0)
        await eng.store_io(lambda: None)  # the writer is idle: the held fsync is the nack's
        vfs.sync_gate.clear()
        vfs.sync_waiting.clear()
        first = asyncio.ensure_future(getattr(svc, kind)(ADMIN, d.token))
        assert await asyncio.to_thread(vfs.sync_waiting.wait, 10)  # the settle's fsync has begun
        assert not first.done(), "answered before its fsync"
        seconds = [asyncio.ensure_future(again(ADMIN, d.token)) for again in (svc.nack, svc.ack)]
        for _ in range(20):
            await asyncio.sleep(0.005)
        early = [t.done() for t in seconds]
        vfs.sync_gate.set()
        await asyncio.wait_for(first, 10)
        assert early == [False, False], "a second settle was answered while the first one's fsync was held"
        for t in seconds:
            with pytest.raises(errors.StaleLease) as e:
                await asyncio.wait_for(t, 10)
            assert e.value.reason == "settled"
        st = eng.core.stats("q", eng.now_us())
        if kind == "nack":
            [d2] = await svc.receive(ADMIN, "q", 0)
            assert (d2.id, d2.retry_count) == (d.id, 1)
            assert st["ackedTotal"] == 0 and st["nackedTotal"] == 1
        else:
            assert await svc.receive(ADMIN, "q", 0) == []  # acked: it never comes back
            assert st["ackedTotal"] == 1 and st["nackedTotal"] == 0
        abandon(eng)
        vfs.unregister()

    asyncio.run(main())
