"""The spooler-node process: what must be settled before anything imports grpc.

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

import sys

from spooler import grpc_io as _io

GRPC_IO_LEGACY = _io.LEGACY
GRPC_IO_CHOICES = _io.CHOICES


def prepare(environ=None, modules=None) -> str:
    """``spooler.grpc_io.prepare`` with the node's default, ``legacy``."""
    return _io.prepare(environ, modules, default="legacy")


def refusal(environ=None) -> str:
    """Why the node does not start with the SPOOLER_GRPC_IO it was given."""
    return "spooler-node: " + _io.refusal(environ)


def main(argv=None) -> int:
    io = prepare()
    from node.main import main as run
    return run(argv, grpc_io=io)


if __name__ == "__main__":
    sys.exit(main())
