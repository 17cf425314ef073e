"""The one error table of Spooler.

Every error a client can see is one of these classes. Each class carries its
contract ``kind``, its HTTP status, its gRPC status code and whether a client
may retry the call blindly. The node raises them, the HTTP edge and the gRPC
edge map them with :func:`http_body` / :func:`grpc_trailers`, and the SDK maps
both transports back with :func:`from_http` / :func:`from_grpc_trailers`, so
the three can never disagree.
"""
from __future__ import annotations

import json
from typing import Optional


class _Code:
    """gRPC status codes by name; grpc itself is imported only when a code is used
    (spoolctl's job commands never load grpc)."""

    def __getattr__(self, name):
        return name


_CODE = _Code()


def grpc_status_code(err: "SpoolerError"):
    import grpc
    return getattr(grpc.StatusCode, err.grpc_code)


# ``reason`` of an ``unavailable`` that the primary itself gave for its own load
# or room: another node would forward to the same primary and hear the same, so a
# client stays where it is and tries again after Retry-After (it moves on for
# any other ``unavailable``: no primary there, a node stopping, not reachable)
OVERLOADED, QUEUE_FULL, DISK_LOW, NODE_FULL = "overloaded", "queue_full", "disk_low", "node_full"
PRIMARY_REFUSALS = (OVERLOADED, QUEUE_FULL, DISK_LOW, NODE_FULL)
# an HTTP connection past the node's bound (node/api/http_conns.py): about the
# connection, not the primary; a new connection may well be served
TOO_MANY_CONNECTIONS = "too_many_connections"
# ``reason`` of a ``stale_lease``
STALE_REASONS = ("expired", "settled", "primary_changed")
# every reason a node gives (the node's metrics count errors by them: a bounded set)
REASONS = PRIMARY_REFUSALS + (TOO_MANY_CONNECTIONS,) + STALE_REASONS


def stay_on(err) -> bool:
    """Is ``err`` an answer the primary gave for its own load or room (see above)?"""
    return isinstance(err, Unavailable) and err.reason in PRIMARY_REFUSALS


MESSAGE_CHARS_MAX = 1000


class SpoolerError(Exception):
    kind = "internal"
    http_status = 500
    grpc_code = _CODE.INTERNAL
    #: a client may resend the same call without risking a duplicate effect
    retry_safe = False

    def __init__(self, message: str = "", *, reason: str = "", retry_after_s: float = 0.0):
        if len(message) > MESSAGE_CHARS_MAX:
            # a message may quote what the caller sent (a name, an id): past this it
            # would not fit gRPC's trailers (16 KiB), and the answer would lose its kind
            message = message[:MESSAGE_CHARS_MAX - 1] + "\u2026"
        super().__init__(message or self.kind)
        self.message = message or self.kind
        self.reason = reason
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "message": self.message}
        if self.reason:
            d["reason"] = self.reason
        if self.retry_after_s:
            d["retryAfterSeconds"] = self.retry_after_s
        return d

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}{', reason=' + self.reason if self.reason else ''})"


class InvalidArgument(SpoolerError):
    kind, http_status, grpc_code = "invalid_argument", 400, _CODE.INVALID_ARGUMENT


class Unauthenticated(SpoolerError):
    kind, http_status, grpc_code = "unauthenticated", 401, _CODE.UNAUTHENTICATED


class Forbidden(SpoolerError):
    kind, http_status, grpc_code = "forbidden", 403, _CODE.PERMISSION_DENIED


class QueueNotFound(SpoolerError):
    kind, http_status, grpc_code = "queue_not_found", 404, _CODE.NOT_FOUND


class NotFound(SpoolerError):
    """A route (or key id) that does not exist. Not a contract kind: an extension."""

    kind, http_status, grpc_code = "not_found", 404, _CODE.NOT_FOUND


class MethodNotAllowed(SpoolerError):
    kind, http_status, grpc_code = "method_not_allowed", 405, _CODE.UNIMPLEMENTED


class StaleLease(SpoolerError):
    """reason: ``expired``, ``settled`` or ``primary_changed``."""

    kind, http_status, grpc_code = "stale_lease", 409, _CODE.FAILED_PRECONDITION
    EXPIRED, SETTLED, PRIMARY_CHANGED = "expired", "settled", "primary_changed"


class MessageTooLarge(SpoolerError):
    kind, http_status, grpc_code = "message_too_large", 413, _CODE.INVALID_ARGUMENT


class OperationUnconfirmed(SpoolerError):
    """The write was accepted; whether it is durable is unknown. Never retried
    blindly: a send may be resent only with the same dedup key."""

    kind, http_status, grpc_code = "operation_unconfirmed", 500, _CODE.UNKNOWN


class Unavailable(SpoolerError):
    """Known not to have been accepted: safe to retry after ``retry_after_s``.

    ``answer_lost`` is True when the gRPC SDK sent a read and its answer never
    came back (no answer in time, the connection broke after the request left,
    the Session stream broke). For most reads that changes nothing. For a
    receive it means the node may have leased messages for it: the SDK does not
    repeat that receive, asks the node once to give back whatever it leased for
    it (a release by the receive's name) and raises this. A message so given
    back is visible again at once with its retry count unchanged; if the
    release fails, or lands after the lease ended (a lease shorter than the
    call's timeout), the lease expires and counts as a retry
    (docs/guarantees.md, S5). The HTTP client reports a receive whose
    answer was lost as ``operation_unconfirmed`` instead (a POST that left)."""

    kind, http_status, grpc_code = "unavailable", 503, _CODE.UNAVAILABLE
    retry_safe = True
    answer_lost = False  # (set on the instance: spooler._common.read_lost)

    def __init__(self, message: str = "", *, reason: str = "", retry_after_s: float = 1.0):
        super().__init__(message, reason=reason, retry_after_s=retry_after_s)


class Internal(SpoolerError):
    kind, http_status, grpc_code = "internal", 500, _CODE.INTERNAL


ERRORS: dict[str, type[SpoolerError]] = {
    c.kind: c
    for c in (InvalidArgument, Unauthenticated, Forbidden, QueueNotFound, NotFound, MethodNotAllowed,
              StaleLease, MessageTooLarge, OperationUnconfirmed, Unavailable, Internal)
}

_BY_GRPC_CODE = {c.grpc_code: c for c in reversed(list(ERRORS.values()))}
_BY_HTTP_STATUS = {c.http_status: c for c in reversed(list(ERRORS.values()))}


def make(kind: str, message: str = "", reason: str = "", retry_after_s: float = 0.0) -> SpoolerError:
    cls = ERRORS.get(kind, Internal)
    if cls is Unavailable:
        return cls(message, reason=reason, retry_after_s=retry_after_s or 1.0)
    return cls(message, reason=reason, retry_after_s=retry_after_s)


# --- HTTP ---------------------------------------------------------------

def http_body(err: SpoolerError) -> bytes:
    return json.dumps(err.to_dict()).encode() + b"\n"


def http_headers(err: SpoolerError) -> dict:
    if isinstance(err, Unavailable):
        return {"Retry-After": str(max(1, int(round(err.retry_after_s))))}
    return {}


def from_http(status: int, body: bytes, headers: Optional[dict] = None, method: str = "") -> SpoolerError:
    """An error answer -> its SpoolerError. An answer that names no kind of ours (a proxy's
    own 502 or 504, a bare 500) says nothing of what happened behind it: for a read
    (``method`` GET or HEAD) that is ``unavailable``, safe to ask again; for a write,
    sent on by the proxy or not, ``operation_unconfirmed``, unless the status is 503
    (``unavailable``, as the contract's) or under 500 (the status's own kind)."""
    try:
        d = json.loads(body or b"{}")
        kind = d.get("kind", "")
    except (ValueError, AttributeError):
        d, kind = {}, ""
    if kind not in ERRORS:
        if status >= 500 and method.upper() in ("GET", "HEAD"):
            cls = Unavailable
        elif status >= 500 and status != 503:
            cls = OperationUnconfirmed
        else:
            cls = _BY_HTTP_STATUS.get(status, Internal)
        kind = cls.kind
    retry_after = 0.0
    if headers and headers.get("Retry-After"):
        try:
            retry_after = float(headers["Retry-After"])
        except ValueError:
            pass
    return make(kind, d.get("message", f"HTTP {status}"), d.get("reason", ""), retry_after)


# --- gRPC ---------------------------------------------------------------

KIND_TRAILER = "spooler-error-kind"
DETAILS_TRAILER = "grpc-status-details-bin"


def grpc_trailers(err: SpoolerError) -> tuple:
    """Trailing metadata carrying the error kind (google.rpc.Status-shaped)."""
    from spooler.pb import api_pb2

    detail = api_pb2.ErrorDetail(kind=err.kind, message=err.message, reason=err.reason,
                                 retry_after_seconds=err.retry_after_s)
    status = api_pb2.Status(code=grpc_status_code(err).value[0], message=err.message)
    status.details.add().Pack(detail)
    return ((KIND_TRAILER, err.kind), (DETAILS_TRAILER, status.SerializeToString()))


def from_grpc_trailers(code, details: str, trailers) -> SpoolerError:
    from google.protobuf.message import DecodeError

    from spooler.pb import api_pb2

    for key, value in trailers or ():
        if key == DETAILS_TRAILER:
            try:
                for anyd in api_pb2.Status.FromString(value).details:
                    d = api_pb2.ErrorDetail()
                    if anyd.Unpack(d):
                        return make(d.kind, d.message, d.reason, d.retry_after_seconds)
            except DecodeError:  # a detail that cannot be read (garbled): the code alone says
                break
    # No detail: a transport failure. UNAVAILABLE before the call reached a
    # node is retry-safe; DEADLINE_EXCEEDED after it left is outcome-unknown.
    name = getattr(code, "name", str(code))
    if name == "DEADLINE_EXCEEDED":
        return OperationUnconfirmed(details or "deadline exceeded: outcome unknown")
    if name == "UNKNOWN":  # e.g. a request the server could not decode
        return Internal(details or "unknown gRPC error")
    if name == "CANCELLED":  # not by us (ours never reaches here): the node ended it, e.g. on its way down
        return OperationUnconfirmed(details or "the node cancelled the call: outcome unknown")
    if name == "RESOURCE_EXHAUSTED":
        # gRPC's own limits. A message or its metadata too large: the request is
        # at fault. Anything else (the node's cap on concurrent calls, a memory
        # quota) refused the call before it ran: unavailable, safe to try again.
        low = (details or "").lower()
        if "larger than max" in low or "metadata" in low:
            return MessageTooLarge(f"over gRPC's size limits: {details}")
        return Unavailable(f"the node is out of room for this call ({details}); nothing was done",
                           retry_after_s=0.5)
    cls = _BY_GRPC_CODE.get(name, Internal)
    return cls(details or str(code))


def from_detail(d) -> SpoolerError:
    return make(d.kind, d.message, d.reason, d.retry_after_seconds)


def to_detail(err: SpoolerError):
    from spooler.pb import api_pb2

    return api_pb2.ErrorDetail(kind=err.kind, message=err.message, reason=err.reason,
                               retry_after_seconds=err.retry_after_s)
