"""The engine's Reply (a proposal answered by a call, not a future) and the
lock-free metrics figures the write path updates."""
import sys

from prometheus_client import CollectorRegistry, generate_latest

from node.api.metrics import Buckets, Count, _LoopCollector
from node.engine import Reply


def test_a_reply_calls_back_once_with_the_result_or_the_error():
    calls = []
    r = Reply(lambda reply, result, error: calls.append((reply, result, error)))
    assert not r.done()
    r.set_result([("id1", False)])
    r.set_exception(RuntimeError("late"))  # a second outcome is ignored, as a future's would be refused
    assert r.done() and calls == [(r, [("id1", False)], None)]

    calls.clear()
    e = RuntimeError("stepped down")
    r = Reply(lambda reply, result, error: calls.append((result, error)))
    r.set_exception(e)
    assert calls == [(None, e)]


def test_a_cancelled_reply_is_never_called_and_a_failing_callback_does_not_reach_the_engine():
    calls = []
    r = Reply(lambda *a: calls.append(a))
    assert r.cancel() and not r.cancel()  # the stream ended: nobody to answer
    r.set_result("x")
    assert r.done() and calls == []

    def boom(*a):
        raise ValueError("bug in an answer")

    r = Reply(boom)
    r.set_result("x")  # logged, not raised into apply_upto
    assert r.done()


def test_on_settled_runs_once_when_the_engine_settles_cancelled_or_not():
    """The proposer's bookkeeping (Service._sending) must end with the proposal, also
    when the caller went away before it was applied."""
    for cancel in (False, True):
        settled, calls = [], []
        r = Reply(lambda *a: calls.append(a))
        r.on_settled(lambda: settled.append(1))
        if cancel:
            r.cancel()
        assert not r.done() and settled == []  # a cancel settles nothing: the record may still commit
        r.set_exception(RuntimeError("refused"))
        r.set_result("late")
        assert r.done() and settled == [1]
        assert len(calls) == (0 if cancel else 1)


def test_counts_and_buckets_expose_prometheus_families():
    sends = Count("spooler_sends", "Messages stored")
    secs = Buckets("spooler_commit_seconds", "commit", (0.001, 0.01))
    sends.inc()
    sends.inc(99)
    for v in (0.0005, 0.001, 0.005, 2.0):
        secs.observe(v)
    reg = CollectorRegistry()
    reg.register(_LoopCollector(sends, secs))
    text = generate_latest(reg).decode()
    assert "spooler_sends_total 100.0" in text
    # cumulative, a value on a bound counted in that bound's bucket (le = less or equal)
    assert 'spooler_commit_seconds_bucket{le="0.001"} 2.0' in text
    assert 'spooler_commit_seconds_bucket{le="0.01"} 3.0' in text
    assert 'spooler_commit_seconds_bucket{le="+Inf"} 4.0' in text
    assert "spooler_commit_seconds_count 4.0" in text
    assert "spooler_commit_seconds_sum 2.0065" in text
    # and the _created samples prometheus-client's own Counter and Histogram expose
    assert "spooler_sends_created " in text and "spooler_commit_seconds_created " in text


def test_the_scrape_has_the_shape_prometheus_clients_own_figures_had():
    """The same figures through prometheus-client's Counter and Histogram: the same
    sample names, labels and values (a dashboard sees no difference)."""
    from prometheus_client import Counter, Histogram
    from prometheus_client.parser import text_string_to_metric_families

    bounds = (.0001, .00025, .0005, .001, 1)
    theirs = CollectorRegistry()
    c = Counter("spooler_acks", "acks", registry=theirs)
    h = Histogram("spooler_commit_seconds", "commit", buckets=bounds, registry=theirs)
    ours_c, ours_h = Count("spooler_acks", "acks"), Buckets("spooler_commit_seconds", "commit", bounds)
    for v in (0.00005, 0.0001, 0.0003, 0.002, 5.0):
        h.observe(v)
        ours_h.observe(v)
    c.inc(7)
    ours_c.inc(7)
    ours = CollectorRegistry()
    ours.register(_LoopCollector(ours_c, ours_h))

    def samples(reg):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for fam in text_string_to_metric_families(generate_latest(reg).decode())
                      for s in fam.samples if not s.name.endswith("_created"))

    def created(reg):
        return sorted(s.name for fam in text_string_to_metric_families(generate_latest(reg).decode())
                      for s in fam.samples if s.name.endswith("_created"))

    assert samples(ours) == samples(theirs)
    assert created(ours) == created(theirs)


def _service_with_core():
    import hashlib
    import types

    from node.api.service import Service
    from node.core.spool import Core

    engine = types.SimpleNamespace(core=Core(rand=lambda n: b"\0" * n), cluster=False, role="primary",
                                   primary_id="n1", ready=True, repl=types.SimpleNamespace(addresses={}))
    svc = Service.__new__(Service)  # only what authenticate reads
    svc.engine = engine
    svc._admin = [hashlib.sha256(b"adm").digest()]
    return svc, engine


def test_a_streams_key_memo_is_used_until_the_keys_change():
    from spooler.pb import log_pb2

    svc, engine = _service_with_core()
    memo: list = []
    p = svc.authenticate("Bearer adm", "", memo)
    assert svc.authenticate("Bearer adm", "", memo) is p  # remembered: not checked again
    engine.core._apply_key_put(log_pb2.KeyPut(id="k1", secret_sha256=b"x" * 32, queue="q", scopes=["send"]), 0)
    assert svc.authenticate("Bearer adm", "", memo) is not p  # a key changed: checked again


def test_a_streams_key_memo_does_not_keep_a_replaced_core_alive():
    import gc
    import weakref

    from node.core.spool import Core

    svc, engine = _service_with_core()
    memo: list = []
    p = svc.authenticate("Bearer adm", "", memo)
    old = weakref.ref(engine.core)
    engine.core = Core(rand=lambda n: b"\0" * n)  # what a snapshot install does
    gc.collect()
    assert old() is None, "an idle stream's memo kept the replaced core alive"
    assert svc.authenticate("Bearer adm", "", memo) is not p  # and the new core's keys are checked


def test_a_primary_that_steps_down_before_its_epoch_opens_logs_no_unread_failure(tmp_path):
    """A node elected primary proposes its epoch's first record itself, and nothing
    awaits it; stepping down before it commits fails it (expected). asyncio used to
    log that as "Future exception was never retrieved" (seen in drill logs): the
    outcome is read (engine.nobody_waits). The control: the record was proposed and
    did fail."""
    import asyncio
    import gc

    from node.engine import Engine
    e = Engine(str(tmp_path), node_id="n1", peers={"n1": "127.0.0.1:1", "n2": "127.0.0.1:2"})

    async def main():
        seen = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx.get("message", "")))
        e._wake = asyncio.Event()            # (made by start(); the commit loop is not running:
        e.on_role("primary", 2, "n1")       # the record waits for it)
        (rec, fut), = e._pending
        assert rec.WhichOneof("op") == "epoch_begin"
        e.on_role("replica", 3, "n2")        # stepped down before it committed
        assert fut.done()                    # failed (reading it here would hide what is tested)
        del fut, rec
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        return seen

    seen = asyncio.run(main())
    e.store.close()
    assert not [m for m in seen if "never retrieved" in m], seen


def test_a_costly_render_of_metrics_is_reused_for_ten_times_its_length_a_cheap_one_never(monkeypatch):
    """/metrics needs no key, and a node with 10,000 queues took a fifth of a second
    per render on its event loop: scrapers asking back to back held a primary's
    loop until it lost its majority. A costly render is answered again for ten
    times as long as it took; a cheap one is always fresh."""
    import types

    from node.api import metrics as m

    clock = [100.0]
    monkeypatch.setattr(m, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=lambda: 0.0))
    cost = [0.2]

    def render(registry):
        clock[0] += cost[0]
        return b"figures"

    monkeypatch.setattr(m, "generate_latest", render)
    fake = types.SimpleNamespace(on_apply=[], metrics=None)
    metrics = m.Metrics(fake)
    assert metrics.render() == b"figures" and metrics.renders == 1
    for _ in range(5):  # within 2 s of it: the same answer, no render
        clock[0] += 0.3
        assert metrics.render() == b"figures"
    assert metrics.renders == 1
    clock[0] += 0.6  # past ten times its length
    metrics.render()
    assert metrics.renders == 2
    cost[0] = 0.001  # a cheap render: never reused
    clock[0] += 5
    metrics.render()
    metrics.render()
    metrics.render()
    assert metrics.renders == 5


def test_lines_a_client_can_cause_are_logged_at_most_once_a_minute_with_a_count(monkeypatch, caplog):
    import logging
    import types

    from node import logs

    clock = [1000.0]
    monkeypatch.setattr(logs, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(logs, "_last", {})
    lg = logging.getLogger("throttle-test")
    with caplog.at_level(logging.INFO, logger="throttle-test"):
        for _ in range(500):
            logs.throttled(lg, logging.INFO, ("k",), "gave back %d", 1)
            clock[0] += 0.01  # 5 s in all
        logs.throttled(lg, logging.INFO, ("other",), "another kind %d", 2)
        clock[0] += 60
        logs.throttled(lg, logging.INFO, ("k",), "gave back %d", 1)
    lines = [r.getMessage() for r in caplog.records if r.name == "throttle-test"]
    assert lines == ["gave back 1", "another kind 2",
                     "gave back 1 (and 499 more like it in the last minute, not logged)"]


def test_grpc_lines_a_caller_can_cause_are_throttled_without_their_tracebacks(monkeypatch, caplog):
    """grpc's own ERROR lines, each with a traceback, for a metadata value that is not
    UTF-8 and for an answer it could not send: any caller can cause them, so they go
    through the same once-a-minute throttle. Its other lines are left alone."""
    import logging

    from node import logs

    monkeypatch.setattr(logs, "_last", {})
    lg = logging.getLogger("grpc._cython.cygrpc")
    monkeypatch.setattr(lg, "filters", [])
    logs.install()
    try:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    except UnicodeDecodeError:
        exc = sys.exc_info()
    with caplog.at_level(logging.ERROR, logger="grpc._cython.cygrpc"):
        for i in range(50):
            lg.error("Invalid encoding on %s", b"Bearer \xff", exc_info=exc)
            lg.error("ExecuteBatchError raised in core by servicer method [%s]", f"/m{i}", exc_info=exc)
        lg.error("Error adding port to server: %s", "x")
    got = [(r.getMessage(), r.exc_info) for r in caplog.records if r.name == "grpc._cython.cygrpc"]
    assert got == [("Invalid encoding on b'Bearer \\xff'", None),
                   ("ExecuteBatchError raised in core by servicer method [/m0]", None),
                   ("Error adding port to server: x", None)]
