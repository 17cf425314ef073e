"""The spooler-node process: what must be settled before anything imports grpc, and
``release_memory`` (the process's memory handed back to the operating system).

gRPC reads ``GRPC_EXPERIMENTS`` once, when it is imported, and every module of
the node imports it (spooler.errors maps status codes), so the choice is made
here, in the process's first lines: ``spooler-node`` starts at ``main`` below,
and ``python -m node.main`` calls ``prepare`` before its own imports.

The choice is grpcio's older I/O path instead of its EventEngine
(``SPOOLER_GRPC_IO=legacy``, the default here; ``SPOOLER_GRPC_IO=default``
keeps grpcio's own): ``spooler/grpc_io.py`` says what each is and what it
measured. A node's messages cross gRPC several times a send (in from the
client, out to each replica, each acknowledgement back, the answer), and
interleaved runs of the benchmark's workload gave the nodes 9-12% lower
sequential latency and 7-10% more throughput on 3 nodes with it.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional

with warnings.catch_warnings():
    # the SDK warns of a SPOOLER_GRPC_IO it cannot use when it is imported; the
    # node refuses such a value itself, in one line (refusal), with no warning first
    warnings.filterwarnings("ignore", message="SPOOLER_GRPC_IO", category=RuntimeWarning)
    from spooler import grpc_io as _io

GRPC_IO_LEGACY = _io.LEGACY
GRPC_IO_CHOICES = _io.CHOICES


def prepare(environ=None, modules=None) -> str:
    """``spooler.grpc_io.prepare`` with the node's default, ``legacy``."""
    return _io.prepare(environ, modules, default="legacy")


def refusal(environ=None) -> str:
    """Why the node does not start with the SPOOLER_GRPC_IO it was given."""
    return "spooler-node: " + _io.refusal(environ)


_LIBC = None


def release_memory() -> Optional[int]:
    """Hand the C library's free memory back to the operating system (glibc's
    ``malloc_trim``) and return how many bytes the process's resident size fell by,
    or None where there is no such call (another C library).

    A node keeps message bodies in memory only until its next checkpoint, but the
    C library keeps what they took (the parsed requests, the log records) for
    reuse, so after a burst of sends the node stayed as large as at its peak: 200,000
    messages sent in batches left it about 110 MiB larger, against 6-7 MiB once
    this is called after the checkpoint that let the bodies go (docs/benchmarks-history.md).
    ctypes lets go of the GIL while it runs, so it is called off the event loop."""
    global _LIBC
    import ctypes
    import ctypes.util

    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return None
    before = _resident_bytes()
    _LIBC.malloc_trim(0)
    return max(0, before - _resident_bytes())


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main(argv=None) -> int:
    io = prepare()
    from node.main import main as run
    return run(argv, grpc_io=io)


if __name__ == "__main__":
    sys.exit(main())
