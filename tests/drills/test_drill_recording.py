"""How the drill records calls: every call it makes gets exactly one completion,
so the checker never reads a call the drill lost track of as merely unknown."""
import threading

from drills import drill as drill_mod
from drills.checker import check
from spooler.pb import api_pb2


class _FakeClient:
    def __init__(self, cluster, rng, name, spread=False):
        self.node = "n1"

    def client(self):
        return None

    def pick(self, anywhere=False):
        pass

    def moved(self):
        pass


def test_a_send_batch_answered_with_fewer_results_than_entries_fails_the_seed(tmp_path, monkeypatch):
    """A node answering a SendBatch with fewer results than it had entries is a
    node's defect: the drill records each entry's outcome as unknown and fails
    the seed (a client thread's error). It paired answers with entries with
    zip(), and the entries past the answer's end never completed, which the
    checker reads as sends of unknown outcome: nothing counted."""
    import spooler.client as client_mod

    class ShortAnswer:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def _call(self, method, req, write=False):
            assert method == "SendBatch"
            return api_pb2.SendBatchResponse(run_ids=["m-only-one"])

    monkeypatch.setattr(drill_mod, "_Client", _FakeClient)
    monkeypatch.setattr(client_mod, "Client", ShortAnswer)
    d = drill_mod.Drill(seed=7, duration_s=1.0, nodes=3, workdir=str(tmp_path))
    monkeypatch.setattr(d.cluster, "client_grpc_target", lambda node: "127.0.0.1:1")
    t = threading.Thread(target=d.batch_producer, daemon=True)
    t.start()
    t.join(10)
    still_sending = t.is_alive()
    d.stop_load.set()  # (ends it either way)
    t.join(10)
    assert not still_sending
    assert d.thread_errors and "answered 1 results" in d.thread_errors[0], d.thread_errors
    events = d.h.events
    invokes = [e for e in events if e.get("type") == "invoke"]
    completions = [e for e in events if e.get("type") in ("ok", "fail", "unknown")]
    assert len(invokes) >= 2 and len(completions) == len(invokes)
    assert {e["type"] for e in completions} == {"unknown"}
    assert check(events)["unknown_sends"] == len(invokes)
