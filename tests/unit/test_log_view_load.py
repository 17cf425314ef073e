"""The replication core's view of the log as a node loads its store
(LogView.from_store, Driver.load): its base is always a record the store
applied, never a row it has not.

Found by the simulation once it loaded its disks as the driver does: a node
whose store had applied nothing kept a deposed primary's first record (lsn 1,
never committed) as the base of its view after a restart, and a new primary's
different lsn 1 could then never replace it: the core truncated around it,
its view and its store no longer agreed, and the next frame stopped the node
with "differs from the one committed here". (The node's side, Driver.load on
such a store: tests/unit/test_repl_gates.py::test_a_restarted_node_replaces_a_first_record_that_never_committed.)"""
import pytest

from node.core import replication as R
from node.core.invariant import BrokenInvariant


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
    with pytest.raises(BrokenInvariant, match="past the applied lsn"):
        R.LogView.from_store([(5, 1, 105, 1)], (3, 1, 103))
