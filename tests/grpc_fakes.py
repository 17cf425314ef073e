"""Stand-ins for grpc objects in unit tests."""
from __future__ import annotations

import grpc


class FakeRpcError(grpc.RpcError):
    """An RpcError with a code, details and trailing metadata, as grpc raises them."""

    def __init__(self, code, details, trailers=()):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def answered_by(attempt):
    """A stand-in for ``Client.send_async``: each call's future holds what
    ``attempt()`` returns, or the SpoolerError it raises."""
    from concurrent.futures import Future

    from spooler import errors

    def send_async(req):
        f = Future()
        try:
            f.set_result(attempt())
        except errors.SpoolerError as e:
            f.set_exception(e)
        return f
    return send_async
