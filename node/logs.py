"""Log lines that a caller can cause, at most one a minute for each kind.

A client (with a key or none) can make a node refuse a request, give back a
lease, send metadata that is not UTF-8, hang up before its answer is sent,
or run out of file descriptors as often as it likes; each used to be
one log line (or a traceback), so a loop of such requests filled the disk
with the log. Such lines go through ``throttled``: the first is logged, the
others within the minute are counted, and the next line says how many were
left out."""
from __future__ import annotations

import logging
import time

EVERY_S = 60.0
KINDS_MAX = 1000

_last: dict = {}  # kind -> [monotonic time of the last line logged, lines left out since]


def allow(kind) -> int:
    """-1: leave this line out (counted); else log it, and this many were left out
    before it."""
    now = time.monotonic()
    e = _last.get(kind)
    if e is not None and now - e[0] < EVERY_S:
        e[1] += 1
        return -1
    left_out = e[1] if e is not None else 0
    _last.pop(kind, None)  # (kept oldest first: past KINDS_MAX the oldest kind goes)
    if len(_last) >= KINDS_MAX:
        _last.pop(next(iter(_last)))
    _last[kind] = [now, 0]
    return left_out


def throttled(logger: logging.Logger, level: int, kind, msg: str, *args) -> None:
    n = allow(kind)
    if n < 0:
        return
    if n:
        msg += " (and %d more like it in the last minute, not logged)"
        args += (n,)
    logger.log(level, msg, *args)


class ThrottleFilter(logging.Filter):
    """For a library's own log lines (asyncio's, aiohttp's) that a client can
    cause: ``match(record)`` names the kind of line (None: not one of them)."""

    def __init__(self, match):
        super().__init__()
        self.match = match

    def filter(self, record: logging.LogRecord) -> bool:
        kind = self.match(record)
        if kind is None:
            return True
        n = allow(kind)
        if n < 0:
            return False
        record.exc_info = None  # one line: the traceback says nothing the line does not
        record.exc_text = None
        if n:
            record.msg = str(record.msg) + f" (and {n} more like it in the last minute, not logged)"
        return True


def _accept_failure(record: logging.LogRecord):
    # asyncio: "socket.accept() out of system resource" with a traceback, per attempt,
    # while the process has no file descriptor left
    return ("asyncio", "accept") if str(record.msg).startswith("socket.accept() out of system resource") else None


def _grpc_line(record: logging.LogRecord):
    # grpc's own lines with a traceback each that any caller can cause, with a key
    # or none: an Authorization (any metadata) value that is not UTF-8, and an
    # answer it could not send because the caller had gone (each handler that
    # writes its own answer meets that when the write fails)
    msg = str(record.msg)
    if msg.startswith("Invalid encoding on"):
        return ("grpc", "metadata encoding")
    if "raised in core by servicer method" in msg:
        return ("grpc", "answer not sent")
    return None


def install() -> None:
    """The filters on the libraries' loggers (once per process)."""
    for name, match in (("asyncio", _accept_failure), ("grpc._cython.cygrpc", _grpc_line)):
        lg = logging.getLogger(name)
        if not any(isinstance(f, ThrottleFilter) and f.match is match for f in lg.filters):
            lg.addFilter(ThrottleFilter(match))
