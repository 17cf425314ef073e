"""The spooler-node process: what must be settled before anything imports grpc.

gRPC reads ``GRPC_EXPERIMENTS`` once, when it is imported, and every module of
the node imports it (spooler.errors maps status codes), so the choice is made
here, in the process's first lines: ``spooler-node`` starts at ``main`` below,
and ``python -m node.main`` calls ``prepare`` before its own imports.

The choice is grpcio's older I/O path instead of its EventEngine
(``SPOOLER_GRPC_IO=legacy``, the default; ``SPOOLER_GRPC_IO=default`` keeps
grpcio's own). With grpcio 1.85 (the version pyproject.toml admits) a bare
grpc.aio bidi round trip between two processes took about 160 us on the
older path against 220-290 us on the EventEngine, and a node's messages
cross gRPC several times a send: in from the client, out to each replica,
each acknowledgement back, the answer. Interleaved runs of the benchmark's
workload (docs/benchmarks.md) gave the nodes 9-12% lower sequential latency
and 7-10% more throughput on 3 nodes with it. The client's side of a
connection is its own process's choice, and the SDK never makes it for its
user. gRPC means to retire the older path; a grpcio that no longer has it
ignores the setting and runs its EventEngine.

A ``GRPC_EXPERIMENTS`` that the operator set is left as it is.
"""
from __future__ import annotations

import os
import sys

GRPC_IO_LEGACY = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
GRPC_IO_CHOICES = ("legacy", "default")


def prepare(environ=None, modules=None) -> str:
    """Settle the gRPC I/O path in ``environ`` (the process's) before grpc is
    imported. Returns what the process runs with: "legacy", "default", "operator"
    (GRPC_EXPERIMENTS was set already) or "too late" (grpc was already imported);
    "invalid" for a SPOOLER_GRPC_IO it does not know, which ``refusal`` words and
    node.main refuses once the flags are parsed (so --help still answers)."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    choice = environ.get("SPOOLER_GRPC_IO", "legacy")
    if choice not in GRPC_IO_CHOICES:
        return "invalid"
    if "GRPC_EXPERIMENTS" in environ:
        return "operator"
    if choice == "default":
        return "default"
    if "grpc" in modules:
        return "too late"
    environ["GRPC_EXPERIMENTS"] = GRPC_IO_LEGACY
    return "legacy"


def refusal(environ=None) -> str:
    """Why the node does not start with the SPOOLER_GRPC_IO it was given."""
    choice = (os.environ if environ is None else environ).get("SPOOLER_GRPC_IO")
    return f"spooler-node: SPOOLER_GRPC_IO must be one of {', '.join(GRPC_IO_CHOICES)}, not {choice!r}"


def main(argv=None) -> int:
    io = prepare()
    from node.main import main as run
    return run(argv, grpc_io=io)


if __name__ == "__main__":
    sys.exit(main())
