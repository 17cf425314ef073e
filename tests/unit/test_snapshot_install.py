"""A replica that installs a primary's copy of the store keeps its own persistent
replication state: its epoch, its vote, the longest lease it answered (R2) and
whether it is still joining. They are written into the copy before the copy
replaces the store, so a crash at any point leaves the node with its own values."""
import os

import apsw
import pytest

from node.engine import Engine
from node.store.sqlite import Store

KEYS = ("repl_epoch", "voted_for", "lease_seen_us", "joining")


def _primary_copy(tmp_path, dest):
    prim = Store(str(tmp_path / "p" / "spool.db"))
    with prim.db:
        for k, v in zip(KEYS, (9, "n1", 123, 0)):
            prim.set_meta(k, v)
    out = apsw.Connection(dest)
    with out.backup("main", prim.db, "main") as b:
        b.step(-1)
    out.close()
    prim.close()


def _meta(path):
    s = Store(path)
    try:
        return tuple(s.get_meta(k) for k in KEYS)
    finally:
        s.close()


def test_the_copy_holds_our_values_before_it_replaces_our_store(tmp_path, monkeypatch):
    eng = Engine(str(tmp_path / "n"))
    with eng.store.db:
        for k, v in zip(KEYS, (7, "n2", 5_000_000, 1)):
            eng.store.set_meta(k, v)
    copy = str(tmp_path / "n" / "snapshot-incoming.db")
    _primary_copy(tmp_path, copy)

    def crash(*_):
        raise OSError("the process dies here")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        eng.install_snapshot_sync(copy)
    # the file that would replace the store holds them itself, with no -wal beside it
    # (os.replace moves only the main file)
    assert not os.path.exists(copy + "-wal")
    alone = str(tmp_path / "alone.db")
    with open(copy, "rb") as src, open(alone, "wb") as dst:
        dst.write(src.read())
    assert _meta(alone) == (7, "n2", 5_000_000, 1)


def test_a_value_we_never_had_is_not_taken_from_the_primary(tmp_path):
    eng = Engine(str(tmp_path / "n"))  # a store of an older build: no lease_seen_us, never joining
    with eng.store.db:
        eng.store.set_meta("repl_epoch", 7)
        eng.store.set_meta("voted_for", "n2")
    copy = str(tmp_path / "n" / "snapshot-incoming.db")
    _primary_copy(tmp_path, copy)
    eng.install_snapshot_sync(copy)
    assert tuple(eng.store.get_meta(k) for k in KEYS) == (7, "n2", 0, None)
    eng.store.close()
