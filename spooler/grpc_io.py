"""Which of grpcio's two I/O paths a process runs: settled before grpc is imported.

grpcio 1.85 (the version pyproject.toml admits) has two: its EventEngine (the
default) and its older I/O path, chosen with ``GRPC_EXPERIMENTS``, which grpc
reads once, when it is first imported. On this project's machines a bare
grpc.aio round trip between two processes took about 160 us on the older path
against 220-290 us on the EventEngine, and a client on the older path spent
about a quarter less CPU per sequential send (docs/benchmarks-history.md).

``SPOOLER_GRPC_IO`` names the choice, for the node and the SDK alike:

* ``legacy``: the older path (``GRPC_EXPERIMENTS`` is set to ``LEGACY``);
* ``default``: grpcio's own choice (nothing is set).

The node's process is its own, so it runs ``legacy`` unless told otherwise
(node/process.py). The SDK lives in its user's process, where the setting
reaches every gRPC channel and server, so it changes nothing unless the user
sets ``SPOOLER_GRPC_IO=legacy`` (``spooler/__init__.py`` reads it when the
package is imported, which must come before anything imports grpc).

A ``GRPC_EXPERIMENTS`` already set is left as it is. gRPC means to retire the
older path; a grpcio without it ignores the setting and runs its EventEngine.
This module imports nothing of grpc's.
"""
from __future__ import annotations

import os
import sys

LEGACY = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
CHOICES = ("legacy", "default")


def prepare(environ=None, modules=None, default: str = "legacy") -> str:
    """Settle the I/O path in ``environ`` (the process's) before grpc is imported.
    ``default`` applies when ``SPOOLER_GRPC_IO`` is unset. Returns what the process
    runs with: "legacy", "default", "operator" (GRPC_EXPERIMENTS was set already),
    "too late" (grpc was already imported, so the setting could no longer reach it)
    or "invalid" (a SPOOLER_GRPC_IO it does not know; ``refusal`` words it)."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    choice = environ.get("SPOOLER_GRPC_IO", default)
    if choice not in CHOICES:
        return "invalid"
    if "GRPC_EXPERIMENTS" in environ:  # (the SDK's import may have set it for this process)
        return "legacy" if choice == "legacy" and environ["GRPC_EXPERIMENTS"] == LEGACY else "operator"
    if choice == "default":
        return "default"
    if "grpc" in modules:
        return "too late"
    environ["GRPC_EXPERIMENTS"] = LEGACY
    return "legacy"


def refusal(environ=None) -> str:
    """Why SPOOLER_GRPC_IO is not taken."""
    choice = (os.environ if environ is None else environ).get("SPOOLER_GRPC_IO")
    return f"SPOOLER_GRPC_IO must be one of {', '.join(CHOICES)}, not {choice!r}"
