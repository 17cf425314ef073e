"""Spooler client SDK and spoolctl.

    from spooler import Client          # sync gRPC client (auto-batching sends)
    from spooler.aio import AsyncClient # asyncio gRPC client
    from spooler.http import HttpClient # small HTTP/JSON client (what spoolctl uses)
"""
__version__ = "0.4.48"

# gRPC's I/O path, settled before anything imports grpc (spooler/grpc_io.py): the SDK
# changes nothing unless its user sets SPOOLER_GRPC_IO=legacy
import sys  # noqa: E402

from spooler import grpc_io as _grpc_io  # noqa: E402

GRPC_IO = _grpc_io.prepare(default="default")
# (not in a spooler-node process, whose node.process imports this package while it
# settles the node's own choice, and refuses an invalid one with one line)
if GRPC_IO in ("invalid", "too late") and "node.process" not in sys.modules:
    import warnings
    warnings.warn(_grpc_io.refusal() + "; grpcio's default I/O path stays" if GRPC_IO == "invalid" else
                  "SPOOLER_GRPC_IO=legacy came too late: grpc was imported before spooler, "
                  "so it runs its default I/O path", RuntimeWarning, stacklevel=2)


def __getattr__(name):  # lazy: importing spooler.errors must not pull in the whole SDK
    if name == "Client":
        from spooler.client import Client
        return Client
    if name == "AsyncClient":
        from spooler.aio import AsyncClient
        return AsyncClient
    if name == "HttpClient":
        from spooler.http import HttpClient
        return HttpClient
    raise AttributeError(name)
