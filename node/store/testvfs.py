"""Test-only storage faults for whole-process drills (never used in production).

``SPOOLER_TEST_VFS=buffered``: an apsw VFS that keeps every write in process
memory until ``xSync`` and only then writes and fsyncs it. SIGKILL of such a
node loses exactly what a power cut would lose: everything not fsync'd.
``SPOOLER_TEST_FSYNC_FAIL_FILE=path``: while that file exists, ``xSync``
raises an I/O error (an fsync failure the node must not survive quietly).
``SPOOLER_TEST_WRITE_FAIL_FILE=path``: while that file exists, ``xWrite``
raises an I/O error (a write failure): the WAL's frames of a commit and the
database file's pages of SQLite's own checkpoint alike. The failed write is
not kept (not even in memory): the disk never took it, and a power cut after
it loses what it would have lost without it.
``SPOOLER_TEST_SYNC_DELAY=1``: each ``xSync`` first sleeps for as many seconds
as the file ``test-sync-delay`` beside the synced file says (none: no delay),
a disk that is slow for a while.
"""
from __future__ import annotations

import os
import threading
import time

import apsw

NAME = "spooler-buffered"
SYNC_DELAY_FILE = "test-sync-delay"


class BufferedVFS(apsw.VFS):
    def __init__(self, name: str = NAME):
        """``name``: another than the node's for a test of the VFS itself."""
        self.fail_file = os.environ.get("SPOOLER_TEST_FSYNC_FAIL_FILE", "")
        self.write_fail_file = os.environ.get("SPOOLER_TEST_WRITE_FAIL_FILE", "")
        self.sync_delay = os.environ.get("SPOOLER_TEST_SYNC_DELAY") == "1"
        self.lock = threading.RLock()
        self.files: dict = {}  # path -> _State, shared by every handle on that file
        self.name = name
        super().__init__(name, "")

    def xOpen(self, name, flags):
        return BufferedFile(self, name, flags)

    def xDelete(self, filename, syncdir):
        with self.lock:
            self.files.pop(filename, None)
        return super().xDelete(filename, syncdir)


class _State:
    def __init__(self, size: int):
        self.pending: dict = {}     # offset -> bytes, not yet on disk
        self.size = size            # the size every handle sees
        self.truncated_to = None
        self.handles = 0            # open handles on the path


class BufferedFile(apsw.VFSFile):
    def __init__(self, vfs: BufferedVFS, name, flags):
        self.vfs = vfs
        path = name.filename() if isinstance(name, apsw.URIFilename) else name
        super().__init__("", name, flags)
        with vfs.lock:
            st = vfs.files.get(path) if path else None
            if st is None:
                st = _State(super().xFileSize())
                if path:
                    vfs.files[path] = st
            st.handles += 1
        self.st = st
        self.path = path

    def xClose(self):
        # the last handle gone with nothing unsynced: forget the path, so that a
        # file put there later (os.replace of a snapshot) is seen as it is
        with self.vfs.lock:
            st = self.st
            st.handles -= 1
            if st.handles <= 0 and not st.pending and st.truncated_to is None \
                    and self.vfs.files.get(self.path) is st:
                del self.vfs.files[self.path]
        return super().xClose()

    # every handle reads and writes through the shared state of its path
    @property
    def pending(self):
        return self.st.pending

    @property
    def size(self):
        return self.st.size

    @size.setter
    def size(self, v):
        self.st.size = v

    @property
    def truncated_to(self):
        return self.st.truncated_to

    @truncated_to.setter
    def truncated_to(self, v):
        self.st.truncated_to = v

    def xRead(self, amount, offset):
        with self.vfs.lock:
            end = min(offset + amount, self.size)
            if end <= offset:
                return b""
            # the disk's bytes, but none past a truncation not yet synced: the file
            # reads as zeros from there until something is written again
            disk = super().xFileSize()
            if self.truncated_to is not None:
                disk = min(disk, self.truncated_to)
            base_len = min(end, disk) - offset
            buf = bytearray(super().xRead(base_len, offset) if base_len > 0 else b"")
            buf.extend(b"\0" * (end - offset - len(buf)))
            for off, data in self.pending.items():
                lo, hi = max(off, offset), min(off + len(data), end)
                if lo < hi:
                    buf[lo - offset:hi - offset] = data[lo - off:hi - off]
            return bytes(buf)

    def xWrite(self, data, offset):
        if self.vfs.write_fail_file and os.path.exists(self.vfs.write_fail_file):
            raise apsw.IOError("injected write failure")
        with self.vfs.lock:
            self.pending[offset] = bytes(data)
            self.size = max(self.size, offset + len(data))

    def xTruncate(self, newsize):
        with self.vfs.lock:
            self.size = newsize
            self.truncated_to = newsize
            for off in list(self.pending):
                if off >= newsize:
                    del self.pending[off]
                elif off + len(self.pending[off]) > newsize:  # one straddling the new end: cut
                    self.pending[off] = self.pending[off][:newsize - off]

    def xFileSize(self):
        return self.size

    def xSync(self, flags):
        if self.vfs.fail_file and os.path.exists(self.vfs.fail_file):
            raise apsw.IOError("injected fsync failure")
        if self.vfs.sync_delay and self.path:
            try:
                with open(os.path.join(os.path.dirname(self.path), SYNC_DELAY_FILE)) as f:
                    time.sleep(max(0.0, float(f.read() or 0)))
            except (OSError, ValueError):
                pass
        with self.vfs.lock:
            if self.truncated_to is not None:
                super().xTruncate(self.truncated_to)
                self.truncated_to = None
            for off, data in sorted(self.pending.items()):
                super().xWrite(data, off)
            self.pending.clear()
            super().xSync(flags)


_registered = None


def vfs_from_env():
    """The VFS name to open the store with, or None for the real one."""
    global _registered
    if os.environ.get("SPOOLER_TEST_VFS") != "buffered":
        return None
    if _registered is None:
        _registered = BufferedVFS()
    return NAME
