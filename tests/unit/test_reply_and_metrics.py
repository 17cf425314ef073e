"""The engine's Reply (a proposal answered by a call, not a future) and the
lock-free metrics figures the write path updates."""
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
