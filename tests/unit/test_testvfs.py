"""The test VFS's injected write failure (node/store/testvfs.py,
SPOOLER_TEST_WRITE_FAIL_FILE): while the file exists every write fails, the
WAL's and the database file's alike, and the buffered VFS keeps nothing of a
failed write, so a power cut after it loses what it would have lost anyway."""
import itertools
import os
import shutil

import apsw
import pytest

from node.store.sqlite import Store
from node.store.testvfs import BufferedVFS

_names = itertools.count()


@pytest.fixture
def vfs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOOLER_TEST_WRITE_FAIL_FILE", str(tmp_path / "fail-write"))  # as a node gets it
    v = BufferedVFS(f"buffered-test{next(_names)}")
    yield v
    v.unregister()


def _on_disk(db: str, dest: str) -> list:
    """The log's lsns in what the disk holds (a power cut now): the buffered VFS
    keeps every write that was not fsync'd in memory, so that is the files as
    they are on disk."""
    os.makedirs(dest)
    for suffix in ("", "-wal"):
        if os.path.exists(db + suffix):
            shutil.copyfile(db + suffix, os.path.join(dest, "spool.db" + suffix))
    c = apsw.Connection(os.path.join(dest, "spool.db"))
    try:
        assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return [lsn for (lsn,) in c.execute("SELECT lsn FROM log ORDER BY lsn")]
    finally:
        c.close()


def _row(lsn: int, size: int = 100) -> tuple:
    return (lsn, 1, 0, bytes([lsn % 256]) * size)


def test_a_commit_fails_while_the_file_exists_and_nothing_of_it_is_kept(vfs, tmp_path):
    fail = tmp_path / "fail-write"
    db = str(tmp_path / "n" / "spool.db")
    st = Store(db, vfs=vfs.name)
    try:
        st.append([_row(1)])
        assert all(not f.pending for f in vfs.files.values())  # (every write so far fsync'd)
        fail.write_text("")
        with pytest.raises(apsw.IOError):
            st.append([_row(2)])
        # the write failed: not held in memory to reach the disk with a later fsync
        assert all(not f.pending for f in vfs.files.values())
        assert _on_disk(db, str(tmp_path / "cut1")) == [1]
        fail.unlink()  # the disk healed: writes work again
        st.append([_row(2)])
        assert [r[0] for r in st.records_after(0)] == [1, 2]
        assert _on_disk(db, str(tmp_path / "cut2")) == [1, 2]
    finally:
        fail.unlink(missing_ok=True)
        st.close()


def test_sqlites_checkpoint_into_the_database_file_fails_too(vfs, tmp_path):
    """SQLite copies the WAL into the database file on a checkpoint: those writes
    fail as well, the file is left as it was and the WAL still holds everything."""
    fail = tmp_path / "fail-write"
    db = str(tmp_path / "n" / "spool.db")
    st = Store(db, vfs=vfs.name)
    try:
        for lsn in range(1, 51):
            st.append([_row(lsn, 4000)])
        with open(db, "rb") as f:
            before = f.read()
        fail.write_text("")
        with pytest.raises(apsw.IOError):
            st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        with open(db, "rb") as f:
            assert f.read() == before
        assert _on_disk(db, str(tmp_path / "cut1")) == list(range(1, 51))
        fail.unlink()
        assert st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall() == [(0, 0, 0)]
        with open(db, "rb") as f:
            assert f.read() != before
        assert _on_disk(db, str(tmp_path / "cut2")) == list(range(1, 51))
    finally:
        fail.unlink(missing_ok=True)
        st.close()


def test_a_truncation_cuts_a_write_across_it_and_the_file_reads_zeros_past_it(vfs, tmp_path):
    """As a file does: a truncation to n drops what a write held past n (one that
    straddles n keeps its part before it), and once the file grows again, the
    bytes between n and the new writes read as zeros, not as the disk's old
    bytes (the truncation is not on the disk until the next sync)."""
    from node.store.testvfs import BufferedFile
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"D" * 100)  # on the disk
    flags = [apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_MAIN_DB, 0]
    f = BufferedFile(vfs, path, flags)
    try:
        f.xWrite(b"W" * 20, 30)      # pending: bytes 30-49
        f.xTruncate(40)              # cuts that write at 40
        assert f.xFileSize() == 40
        assert f.xRead(40, 0) == b"D" * 30 + b"W" * 10
        f.xWrite(b"N" * 10, 60)      # grows again: 40-59 are a gap
        assert f.xFileSize() == 70
        assert f.xRead(70, 0) == b"D" * 30 + b"W" * 10 + b"\0" * 20 + b"N" * 10
        f.xSync(apsw.SQLITE_SYNC_NORMAL)  # and the disk then holds the same
        with open(path, "rb") as disk:
            assert disk.read() == b"D" * 30 + b"W" * 10 + b"\0" * 20 + b"N" * 10
    finally:
        f.xClose()
