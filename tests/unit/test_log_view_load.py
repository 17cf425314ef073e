"""The replication core's view of the log as a node loads its store
(LogView.from_store, Driver.load): its base is always a record the store
applied, never a row it has not.

Found by the simulation once it loaded its disks as the driver does: a node
whose store had applied nothing kept a deposed primary's first record (lsn 1,
never committed) as the base of its view after a restart, and a new primary's
different lsn 1 could then never replace it: the core truncated around it,
its view and its store no longer agreed, and the next frame stopped the node
with "differs from the one committed here"."""
import pytest

from node.core import replication as R
from node.engine import Engine, mono_us
from node.store.sqlite import chain
from spooler.pb import log_pb2

PEERS = {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2", "n3": "127.0.0.1:3"}


def test_a_store_that_applied_nothing_gives_a_view_based_on_its_applied_position():
    v = R.LogView.from_store([(1, 1, 101, 10), (2, 1, 102, 20)], (0, 0, 0))
    assert (v.base_lsn, v.last_lsn) == (0, 2)
    assert v.at(1) == (1, 101) and v.sizes == [10, 20]


def test_a_compacted_store_gives_a_view_based_on_its_first_row():
    # compaction deleted lsn 1-4 and kept the last applied record (lsn 7) and
    # what follows; the first row, applied, is the base
    rows = [(lsn, 2, 100 + lsn, lsn) for lsn in range(5, 10)]
    v = R.LogView.from_store(rows, (7, 2, 107))
    assert (v.base_lsn, v.base_epoch, v.base_crc, v.last_lsn) == (5, 2, 105, 9)
    assert v.at(4) is None and v.sizes == [6, 7, 8, 9]


def test_an_empty_log_gives_a_view_of_the_applied_position():
    v = R.LogView.from_store([], (12, 3, 512))
    assert (v.base_lsn, v.base_epoch, v.base_crc, v.last_lsn) == (12, 3, 512, 12)


def test_rows_that_do_not_follow_the_applied_position_are_refused():
    with pytest.raises(AssertionError, match="past the applied lsn"):
        R.LogView.from_store([(5, 1, 105, 1)], (3, 1, 103))


def _restarted_deposed_primary(tmp_path) -> Engine:
    """n3 after a restart: epoch 1 was its own, its store holds that epoch's first
    record (lsn 1), which no other member stored, and has applied nothing."""
    e = Engine(str(tmp_path), node_id="n3", peers=PEERS)
    with e.store.db:
        e.store.set_meta("repl_epoch", 1)
        e.store.set_meta("voted_for", "n3")
    data = log_pb2.Record(epoch=1, lsn=1, epoch_begin=log_pb2.EpochBegin(node_id="n3")).SerializeToString()
    e.store.append([(1, 1, chain(0, data), data)])
    return e


def test_a_restarted_node_replaces_a_first_record_that_never_committed(tmp_path):
    e = _restarted_deposed_primary(tmp_path)
    try:
        d = e.repl
        d.load()
        c = d.core
        assert c.log.base_lsn == 0 and c.log.last_lsn == 1 and c.commit_lsn == 0
        now = mono_us()
        c.start(now)
        # n1, primary of epoch 2, sends its own lsn 1 and 2
        out = c.receive(R.AppendReq(2, "n1", 0, 0, 0, [(1, 2, 201), (2, 2, 202)], 0, now, 0, 1_000_000), now)
        assert [type(x).__name__ for x in out if isinstance(x, (R.Truncate, R.Store))] == ["Truncate", "Store"]
        assert next(x for x in out if isinstance(x, R.Truncate)).after_lsn == 0
        store = next(x for x in out if isinstance(x, R.Store))
        assert [x[0] for x in store.req.entries] == [1, 2]
        assert c.log.at(1) == (2, 201) and c.log.at(2) == (2, 202) and c.log.last_lsn == 2
        acks = [x.msg for x in c.stored(store.req, now) if isinstance(x, R.Send)]
        assert acks and acks[-1].ok and acks[-1].match_lsn == 2
        # the next frame follows on from n1's lsn 2, with lsn 2 committed
        out = c.receive(R.AppendReq(2, "n1", 2, 2, 202, [(3, 2, 203)], 2, now + 1, 2, 1_000_000), now + 1)
        assert any(isinstance(x, R.Store) for x in out)
        assert c.log.at(3) == (2, 203)
    finally:
        e.store.close()
