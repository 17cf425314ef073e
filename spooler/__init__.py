"""Spooler client SDK and spoolctl.

    from spooler import Client          # sync gRPC client (auto-batching sends)
    from spooler.aio import AsyncClient # asyncio gRPC client
    from spooler.http import HttpClient # small HTTP/JSON client (what spoolctl uses)
"""
__version__ = "0.4.5"


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
