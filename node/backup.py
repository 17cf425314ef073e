"""An online copy of a node's store, for backups (docs/operations.md, "Backups").

    python -m node.backup DATA_DIR DEST_FILE

Copies ``DATA_DIR/spool.db`` while the node runs, through SQLite's backup API in
one step: the copy is the store as of one committed transaction, as a crash at
that moment would have left it (the node's own group commits go on meanwhile:
in WAL mode a reader blocks no writer). The copy is fsync'd, checked with
``PRAGMA quick_check`` and only then given its name, so a file under DEST_FILE
is always a whole store. It restores as a node's ``spool.db`` (see the doc).
"""
from __future__ import annotations

import argparse
import os
import sys

STORE_FILE = "spool.db"


def backup(data_dir: str, dest: str) -> None:
    import apsw

    src_path = os.path.join(data_dir, STORE_FILE)
    if not os.path.isfile(src_path):
        raise FileNotFoundError(f"no store at {src_path}")
    if os.path.exists(dest):
        raise FileExistsError(f"{dest} exists: give a new name")
    tmp = f"{dest}.partial"
    if os.path.exists(tmp):
        os.remove(tmp)
    # read-write without create: the node's WAL index (-shm) is shared, not recreated
    src = apsw.Connection(src_path, flags=apsw.SQLITE_OPEN_READWRITE)
    try:
        src.set_busy_timeout(10_000)
        out = apsw.Connection(tmp)
        try:
            with out.backup("main", src, "main") as b:
                b.step(-1)  # every page in one step: one read transaction, one consistent state
            out.execute("PRAGMA journal_mode=DELETE")  # a single file, whatever the store's mode
            problems = [r[0] for r in out.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise RuntimeError(f"the copy does not check out: {problems[:5]}")
        finally:
            out.close()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _give_name(tmp, dest)
    finally:
        src.close()
        if os.path.exists(tmp):
            os.remove(tmp)  # no partial copy left behind, whatever failed
    d = os.open(os.path.dirname(os.path.abspath(dest)), os.O_RDONLY)
    try:
        os.fsync(d)
    finally:
        os.close(d)


def _give_name(tmp: str, dest: str) -> None:
    """``tmp`` under the name ``dest``, never replacing a file that took the name
    meanwhile: a hard link fails if it exists. Where the file system has no hard
    links, the name is first claimed empty (O_EXCL), then the copy moved onto it."""
    import errno
    try:
        os.link(tmp, dest)
        return
    except FileExistsError:
        raise FileExistsError(f"{dest} exists: give a new name") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
    try:
        os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise FileExistsError(f"{dest} exists: give a new name") from None
    os.replace(tmp, dest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m node.backup",
                                 description="Copy a node's store while it runs (docs/operations.md, Backups).")
    ap.add_argument("data_dir", help="the node's --data directory")
    ap.add_argument("dest", help="the file to write (must not exist)")
    a = ap.parse_args(argv)
    try:
        backup(a.data_dir, a.dest)
    except Exception as e:  # noqa: BLE001 - one line, no traceback
        print(f"backup: {e}", file=sys.stderr)
        return 1
    print(f"backup: {a.dest} written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
