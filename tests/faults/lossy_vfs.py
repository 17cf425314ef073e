"""An apsw VFS that can lose every write not yet fsync'd: simulated power loss.

Writes go to the real file, but each one first records the bytes it
overwrites; ``xSync`` forgets that record (the data is now "on disk").
``crash_image(dest)`` writes, for every file opened through the VFS, what a
disk would hold after power loss at this instant: the current contents with
every unsynced write undone. The test then opens ``dest`` as a fresh node.
``fail_sync`` makes every xSync raise ``apsw.IOError`` (an fsync error) while it is
set; ``fail_syncs = n`` makes only the next n raise. ``syncs`` counts xSync calls.
"""
from __future__ import annotations

import os
import threading

import apsw


class LossyVFS(apsw.VFS):
    def __init__(self, name: str = "lossy"):
        self.name = name
        self.files: dict[str, "_FileState"] = {}  # per path, shared by every handle on it
        self.fail_sync = False
        self.fail_syncs = 0
        self.syncs = 0
        # while cleared, every xSync waits: a write that is in flight, not yet durable
        self.sync_gate = threading.Event()
        self.sync_gate.set()
        self.sync_waiting = threading.Event()  # set when an xSync waits at the closed gate
        # power loss is instantaneous: no write or sync may run while the image is taken
        self.lock = threading.Lock()
        super().__init__(name, "")

    def xOpen(self, name, flags):
        return LossyFile(self, name, flags)

    def crash_image(self, dest_dir: str) -> None:
        with self.lock:
            self._crash_image(dest_dir)

    def _crash_image(self, dest_dir: str) -> None:
        os.makedirs(dest_dir, exist_ok=True)
        for path, f in self.files.items():
            if path.endswith("-shm"):
                continue  # shared memory index: rebuilt from the WAL on open
            if not os.path.exists(path):
                continue
            with open(path, "rb") as fh:
                data = bytearray(fh.read())
            for offset, old, old_size in reversed(f.undo):
                if old_size is not None:  # an unsynced truncate or extension
                    if len(data) < old_size:
                        data.extend(b"\0" * (old_size - len(data)))
                if old:
                    data[offset:offset + len(old)] = old
                if old_size is not None:
                    del data[old_size:]
            del data[f.synced_size:]
            with open(os.path.join(dest_dir, os.path.basename(path)), "wb") as out:
                out.write(bytes(data))


class _FileState:
    def __init__(self, size: int):
        self.undo: list = []  # (offset, bytes overwritten, size before or None)
        self.synced_size = size


class LossyFile(apsw.VFSFile):
    def __init__(self, vfs: LossyVFS, name, flags):
        self.vfs = vfs
        self.path = name.filename() if isinstance(name, apsw.URIFilename) else name
        super().__init__("", name, flags)
        with vfs.lock:
            st = vfs.files.get(self.path) if self.path else None
            if st is None or not os.path.exists(self.path):
                st = _FileState(self.xFileSize())
                if self.path:
                    vfs.files[self.path] = st
        self.st = st

    def xWrite(self, data, offset):
        with self.vfs.lock:
            self._write(data, offset)

    def _write(self, data, offset):
        size = self.xFileSize()
        old = super().xRead(min(len(data), max(0, size - offset)), offset) if offset < size else b""
        self.st.undo.append((offset, bytes(old), size if offset + len(data) > size else None))
        super().xWrite(data, offset)

    def xTruncate(self, newsize):
        with self.vfs.lock:
            self._truncate(newsize)

    def _truncate(self, newsize):
        size = self.xFileSize()
        if newsize < size:
            self.st.undo.append((newsize, bytes(super().xRead(size - newsize, newsize)), size))
        super().xTruncate(newsize)

    def xSync(self, flags):
        if not self.vfs.sync_gate.is_set():
            self.vfs.sync_waiting.set()
        self.vfs.sync_gate.wait(30)
        self.vfs.syncs += 1
        if self.vfs.fail_syncs > 0:
            self.vfs.fail_syncs -= 1
            raise apsw.IOError("injected fsync failure")
        if self.vfs.fail_sync:
            raise apsw.IOError("injected fsync failure")
        with self.vfs.lock:
            super().xSync(flags)
            self.st.undo.clear()
            self.st.synced_size = self.xFileSize()
