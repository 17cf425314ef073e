"""The forwarder cuts a forwarded call short when this node takes another node for
the primary (the one it waits on was paused or cut off), except where the change is
the call's own doing: a promote's success makes its target the primary, and its
answer from the old primary is on the way (a CI run once saw a forwarded promote
cut short there, and its retry answered by the new primary)."""
import asyncio

import grpc
import pytest

from grpc_fakes import FakeRpcError
from node.api.forward import Forwarder
from spooler import errors
from spooler.pb import api_pb2

OLD, TARGET, OTHER = "old:1", "target:1", "other:1"


class _SlowPrimary:
    """A stub whose Promote answers after ``view`` has gone through ``changes``."""

    def __init__(self, view: list, changes: list):
        self.view, self.changes = view, changes

    def Promote(self, req, metadata=None, timeout=None):
        async def run():
            for now in self.changes:
                self.view[0] = now
                await asyncio.sleep(0.08)  # longer than the forwarder's 50 ms look at the view
            return api_pb2.ClusterInfo(node_id="old", role="replica", epoch=4, primary=req.node)
        return run()


def _forwarder(changes: list) -> Forwarder:
    view = [OLD]
    f = Forwarder(timeout_s=5, current_primary=lambda: view[0])
    f._stubs[OLD] = _SlowPrimary(view, changes)
    return f


def test_a_forwarded_promote_waits_for_the_old_primarys_answer():
    # the election (no primary known), then the target's first frame
    f = _forwarder([None, TARGET])
    d = asyncio.run(f.promote(OLD, "Bearer k", "target", TARGET))
    assert (d["nodeId"], d["primary"], d["epoch"]) == ("old", "target", 4)


def test_a_forwarded_promote_is_cut_short_when_a_third_node_takes_over():
    f = _forwarder([None, OTHER])
    with pytest.raises(errors.OperationUnconfirmed):
        asyncio.run(f.promote(OLD, "Bearer k", "target", TARGET))


def test_other_forwarded_calls_are_cut_short_by_any_change():
    async def main():
        f = _forwarder([None, TARGET])
        f._stubs[OLD].SendBatch = lambda req, metadata=None, timeout=None: f._stubs[OLD].Promote(
            api_pb2.PromoteRequest(node="target"))
        await f.call(OLD, "SendBatch", api_pb2.SendBatchRequest(queue="q", bodies=[b"x"]), "Bearer k", True)
    with pytest.raises(errors.OperationUnconfirmed):
        asyncio.run(main())


def test_a_forwarded_promote_whose_answer_never_comes_is_given_up_after_the_grace():
    # the old primary was paused after the handover began: the target took over,
    # but the answer never arrives; the caller hears unconfirmed, not a 15 s wait
    view = [OLD]

    class _Paused:
        def Promote(self, req, metadata=None, timeout=None):
            async def run():
                view[0] = TARGET
                await asyncio.sleep(30)
            return run()

    async def main():
        f = Forwarder(timeout_s=5, current_primary=lambda: view[0])
        f.handover_grace_s = 0.2
        f._stubs[OLD] = _Paused()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(errors.OperationUnconfirmed):
            await f.promote(OLD, "Bearer k", "target", TARGET)
        return loop.time() - t0
    assert asyncio.run(main()) < 2.0


class _Releaser:
    """A primary that answers ReleaseReceive, counting the calls."""

    def __init__(self):
        self.calls = 0

    def ReleaseReceive(self, req, metadata=None, timeout=None):
        self.calls += 1

        async def run():
            return api_pb2.ReleaseReceiveResponse(released=1)
        return run()


def test_a_release_waits_out_a_time_with_no_primary_known_and_goes_to_the_same_one():
    """A forwarding node cut off from the primary (it knows none for a while) keeps
    a lost answer's release and sends it once it hears from that primary again: a
    drill saw the release dropped at the cut, and the lease expire into a retry
    count nobody had caused. A third node taking over ends it (the leases are stale)."""
    async def main(views):
        view = [views[0]]
        f = Forwarder(timeout_s=5, current_primary=lambda: view[0])
        primary = f._stubs[OLD] = _Releaser()
        f.release_soon(OLD, "Bearer k", "q", "name", 10.0)
        for v in views[1:]:
            await asyncio.sleep(0.15)
            view[0] = v
        await asyncio.wait_for(asyncio.gather(*f._releases), 5)
        return primary.calls

    assert asyncio.run(main([None, None, OLD])) == 1
    assert asyncio.run(main([None, OTHER])) == 0


class _Changes:
    """Engine.role_changes for a test: a future resolved by ``move``."""

    def __init__(self, view: list):
        self.view, self.fut, self.looks = view, None, 0

    def __call__(self):
        if self.fut is None or self.fut.done():
            self.fut = asyncio.get_running_loop().create_future()
        return self.fut

    def current(self):
        self.looks += 1
        return self.view[0]

    def move(self, to):
        self.view[0] = to
        if self.fut is not None and not self.fut.done():
            self.fut.set_result(None)


def test_a_waiting_forwarded_call_wakes_only_for_its_answer_or_a_change_of_primary():
    """With the engine's change notices, a long poll forwarded for its 20 s costs no
    turns of the loop meanwhile (it used to look at the primary every 50 ms), and
    a change of primary still cuts it short at once."""
    view = [OLD]
    ch = _Changes(view)

    class _Holding:
        def Receive(self, req, metadata=None, timeout=None):
            return asyncio.sleep(30)

    async def main():
        f = Forwarder(timeout_s=5, current_primary=ch.current, primary_changes=ch)
        f._stubs[OLD] = _Holding()
        call = asyncio.ensure_future(f.call(OLD, "Receive", api_pb2.ReceiveRequest(queue="q"), "Bearer k", False))
        await asyncio.sleep(0.5)  # ten of the old polls' periods
        assert not call.done() and ch.looks == 1, ch.looks
        ch.move(OTHER)
        with pytest.raises(errors.Unavailable):
            await asyncio.wait_for(call, 1.0)
    asyncio.run(main())


def test_a_forwarded_promote_waits_out_its_handover_with_change_notices_too():
    view = [OLD]
    ch = _Changes(view)

    class _Handing:
        def Promote(self, req, metadata=None, timeout=None):
            async def run():
                for now in (None, TARGET):
                    ch.move(now)
                    await asyncio.sleep(0.08)
                return api_pb2.ClusterInfo(node_id="old", role="replica", epoch=4, primary=req.node)
            return run()

    async def main():
        f = Forwarder(timeout_s=5, current_primary=ch.current, primary_changes=ch)
        f._stubs[OLD] = _Handing()
        return await f.promote(OLD, "Bearer k", "target", TARGET)
    d = asyncio.run(main())
    assert (d["nodeId"], d["primary"], d["epoch"]) == ("old", "target", 4)


def test_a_forwarded_promote_waits_as_long_as_the_primarys_own_wait_can_take():
    """The primary hands over within a failover timeout and then waits up to two more
    (at least 5 s) for the new primary: a forwarded promote's deadline covers that,
    so a long --failover-timeout does not turn a switchover into "unconfirmed"."""
    seen = {}

    class _Recording:
        def Promote(self, req, metadata=None, timeout=None):
            seen["timeout"] = timeout

            async def run():
                return api_pb2.ClusterInfo(node_id="old", role="replica", epoch=4, primary=req.node)
            return run()

    f = Forwarder(timeout_s=10, current_primary=lambda: OLD)
    f._stubs[OLD] = _Recording()
    asyncio.run(f.promote(OLD, "Bearer k", "target", TARGET, failover_timeout_s=8.0))
    assert seen["timeout"] >= 8.0 + max(5.0, 2 * 8.0), seen


@pytest.mark.parametrize("failure, releases", [
    # the primary's own answer, "not now": said before it leased anything
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE, "not serving", ((errors.KIND_TRAILER, "unavailable"),)), False),
    # nothing reached the primary
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"), False),
    # the request left and its answer never came: the primary may hold leases for it
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed"), True),
    (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), True),
], ids=["refused-by-primary", "never-sent", "answer-lost", "timed-out"])
def test_a_forwarded_receive_is_released_only_when_it_may_have_leased(failure, releases):
    """A release is a call retried for up to a lease timeout and one of a bounded
    number of slots: only a receive that may hold leases is given one."""
    started = []

    class _Failing:
        def ReceiveBatch(self, req, metadata=None, timeout=None):
            async def run():
                raise failure
            return run()

    async def main():
        f = Forwarder(timeout_s=5, current_primary=lambda: OLD)
        f._stubs[OLD] = _Failing()
        f.release_soon = lambda *a: started.append(a)
        with pytest.raises(errors.SpoolerError):
            await f.receive(OLD, "Bearer k", "q", 0.0, 1)
    asyncio.run(main())
    assert bool(started) is releases, started
