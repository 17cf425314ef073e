"""HTTP/JSON API (aiohttp), exactly the routes of the contract plus key management.

Parsing and rendering only: every decision is in ``service.Service``, every
error is rendered from the one table in ``spooler.errors``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import zlib

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestPayloadError

from spooler import errors
from node import logs
from node.api.metrics import CANCELLED
from node.api.http_conns import CLIENT_TIMEOUT_S_DEFAULT, ConnectionGuard
from node.api.service import Service

log = logging.getLogger("spooler.http")

JSON = "application/json"


def _json(obj, status=200) -> web.Response:
    return web.Response(status=status, body=json.dumps(obj).encode() + b"\n", content_type=JSON)


def _error(e: errors.SpoolerError) -> web.Response:
    r = web.Response(status=e.http_status, body=errors.http_body(e), content_type=JSON)
    r.headers.update(errors.http_headers(e))
    return r


def _header(request: web.Request, name: str):
    """The one value of a header the contract reads, or None. Given twice it is
    ambiguous (which key, which delay?): 400, instead of silently taking one."""
    values = request.headers.getall(name, ())
    if len(values) > 1:
        raise errors.InvalidArgument(f"{name} given {len(values)} times; give it once")
    return values[0] if values else None


def _expect_handler(metrics):
    async def expect(request: web.Request):
        """``Expect: 100-continue`` is answered as aiohttp would (an interim 100,
        then the body is read; HTTP/1.0 ignores the header). Any other expectation
        cannot be met: a 400 of the error table (RFC 9110 allows any 4xx, and 417
        is not one of the contract's), and the connection closes, since a body may
        follow that was never read."""
        if request.version != (1, 1):
            return None
        guard = request.app.get(CONNECTIONS)
        if guard is not None and guard.refuses(request):
            return None  # its body is not wanted: the 503 (the middleware's) is its only answer
        expect = request.headers.get("Expect", "")
        if expect.lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0   # the body of the answer has not started
            return None
        e = errors.InvalidArgument(f"Expect: {expect[:80]!r} cannot be met; only 100-continue is")
        metrics.answered("http", _call_name(request), time.monotonic(), e)  # (answered before any middleware)
        r = _error(e)
        r.force_close()
        return r
    return expect


# The codings a body may come in. The node decodes them itself (aiohttp's own
# decoder is off: RUNNER_OPTIONS), because aiohttp accepts a gzip body that stops
# short, and would store the part that came as if it were the message.
_CODINGS = frozenset({"", "identity", "gzip", "deflate"})

# How the node's aiohttp runner is made (node/main.py): bodies arrive as sent,
# and _read decodes them. Any other server of this app must be made with them
# too, or a compressed body is decoded twice (aiohttp's TestServer takes them in
# start_server, not in its constructor).
RUNNER_OPTIONS = {"auto_decompress": False}


def raw_allowance(cap: int) -> int:
    """How many bytes more than ``cap`` a compressed body of at most ``cap`` decoded
    bytes may take as sent: deflate's stored blocks cost 5 bytes per 64 KiB, gzip
    adds 18 per member; this leaves room for that many times over."""
    return cap // 256 + 1024


# gzip members one body may hold (aiohttp's own decoder allows as many), and
# the input given to zlib at a time: zlib copies what follows a member's end
# (``unused_data``), so a slice bounds that copy, and the cap bounds how many
# there are. Without both, a body of empty 20-byte members costs time that grows
# with the square of its size (about 37 s for one body of 4 MiB, seen here).
GZIP_MEMBERS_MAX = 1024
_DECODE_SLICE = 16 * 1024


def decode_body(raw: bytes, coding: str, cap: int) -> bytes:
    """A body of Content-Encoding ``coding`` (gzip, deflate, identity or none),
    decoded whole: a stream that stops short of its end (for gzip, its checksum
    and length), or bytes after it that are not another gzip member, is
    invalid_argument; more than ``cap`` bytes once decoded is message_too_large
    (found without decoding past it, so a small bomb costs at most ``cap``)."""
    if coding in ("", "identity"):
        return raw
    if not raw:  # no encoder makes nothing of anything (gzip of b"" is 20 bytes): a body cut to nothing
        raise errors.InvalidArgument(f"body could not be read: an empty body is not {coding}")
    if coding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    else:  # deflate is one stream of zlib's format (RFC 1950); one raw deflate stream is also taken, as aiohttp takes it
        wbits = zlib.MAX_WBITS if raw[0] & 0xF == 8 else -zlib.MAX_WBITS
    view, out, total, at = memoryview(raw), [], 0, 0
    try:
        for _ in range(GZIP_MEMBERS_MAX):
            d = zlib.decompressobj(wbits)
            while not d.eof:
                if at == len(raw):
                    raise errors.InvalidArgument(f"body could not be read: its {coding} stream ends before its end")
                piece = view[at:at + _DECODE_SLICE]
                chunk = d.decompress(piece, cap + 1 - total)
                total += len(chunk)
                if total > cap or d.unconsumed_tail:  # (a tail left: the output reached cap + 1)
                    raise errors.MessageTooLarge(f"body of over {cap} bytes once decoded")
                out.append(chunk)
                at += len(piece) - len(d.unused_data)  # (unused_data: what follows the end, when it came)
            if at == len(raw):
                return b"".join(out)
            if coding != "gzip":  # (gzip may hold several members, one after the other)
                raise errors.InvalidArgument(f"body could not be read: bytes after the end of its {coding} stream")
        raise errors.InvalidArgument(f"body could not be read: more than {GZIP_MEMBERS_MAX} gzip members")
    except zlib.error as e:
        raise errors.InvalidArgument(f"body could not be read: not valid {coding} ({e})"[:300]) from None


async def _read(request: web.Request) -> bytes:
    """The body, decoded as its Content-Encoding says (gzip, deflate). A body that
    does not decode as declared, whole, is the client's error, not ours; so is a
    coding we do not decode (stored as it came, its bytes would not be the
    message meant)."""
    framing = request.headers.getall("Transfer-Encoding", ())
    if framing and (len(framing) > 1 or framing[0].strip().lower() != "chunked"):
        # aiohttp reads the chunks and ignores any coding listed before them
        # ("gzip, chunked"): the body would be stored still encoded
        request[CLOSE] = True
        raise errors.InvalidArgument(f"Transfer-Encoding {', '.join(framing)!r} is not supported: only chunked"[:300])
    codings = request.headers.getall("Content-Encoding", ())
    coding = codings[0].strip().lower() if codings else ""
    if len(codings) > 1 or coding not in _CODINGS:
        request[CLOSE] = True  # the body is not read: nothing after it can be parsed
        raise errors.InvalidArgument(f"Content-Encoding {', '.join(codings)!r} is not supported: give one of gzip, "
                                     "deflate or identity, or none"[:300])
    # a client that sends its body slowly, or stops inside it, holds a
    # connection and a handler: it has the client timeout, then 400
    within_s = request.app.get(CLIENT_TIMEOUT_S, CLIENT_TIMEOUT_S_DEFAULT)
    try:
        if request.content.is_eof():  # (the usual case: it came with the head)
            raw = await request.read()
        else:
            async with asyncio.timeout(within_s):
                raw = await request.read()
    except TimeoutError:
        request[CLOSE] = True
        raise errors.InvalidArgument(f"body not received within {within_s:g} s (--http-client-timeout)") from None
    except ConnectionError:  # the client hung up inside its body: nobody to answer, nothing of ours broke
        request[CLOSE] = True
        raise errors.InvalidArgument("body could not be read: the client closed the connection") from None
    except (http_exceptions.BadHttpMessage, RequestPayloadError) as e:
        # the rest of that body cannot be read either: answer, then close (aiohttp
        # would otherwise try to drain it after the answer and log the same error)
        request[CLOSE] = True
        why = (str(e).strip().splitlines() or ["?"])[-1].strip()  # aiohttp's text: "400, message:\n  <why>"
        raise errors.InvalidArgument(f"body could not be read: {why}"[:300]) from None
    try:
        return decode_body(raw, coding, request.app[BODY_CAP])
    except errors.InvalidArgument:
        request[CLOSE] = True  # as for any body that could not be read
        raise


async def _read_json(request: web.Request):
    data = await _read(request)
    if not data.strip():
        return {}
    try:
        return json.loads(data, object_pairs_hook=_no_repeats)
    except _Repeated as e:
        raise errors.InvalidArgument(f"field {e.args[0]!r} given {e.args[1]} times") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise errors.InvalidArgument("body is not valid JSON") from None


class _Repeated(Exception):
    pass


def _no_repeats(pairs: list) -> dict:
    """A JSON object whose field is given twice is ambiguous (which maxRetries?), as a
    header given twice is: refused, not the last one taken silently."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:  # (one pass: a body of many keys must not cost their square)
            if k in seen:
                raise _Repeated(k[:100], sum(1 for p in pairs if p[0] == k))
            seen.add(k)
    return out


def _fields(body, known: tuple) -> dict:
    """A JSON object of only the ``known`` fields (a misspelt one is an error, not ignored)."""
    if not isinstance(body, dict):
        raise errors.InvalidArgument("body must be a JSON object")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise errors.InvalidArgument(f"unknown field {unknown[0]!r}; known: {', '.join(known)}")
    return body


BODY_CAP = web.AppKey("spooler_body_cap", int)
CLIENT_TIMEOUT_S = web.AppKey("spooler_client_timeout_s", float)  # how long a request's body may take to arrive
CONNECTIONS = web.AppKey("spooler_connections", ConnectionGuard)  # set where the node's runner is made
CLOSE = "spooler_close"  # set on a request whose connection must close after the answer
JSON_BYTES_MAX = 64 * 1024  # the JSON body of a route other than send may always be this large
EPOCH_OF = web.AppKey("spooler_epoch_of", object)  # () -> the epoch answers name
METRICS = web.AppKey("spooler_metrics", object)     # the node's Metrics (its answers counted)


def json_protocol_errors() -> None:
    """Requests aiohttp cannot parse (a malformed request line, oversized headers)
    never reach a route: aiohttp answers them itself, in plain text. Make those
    answers speak the contract too: a JSON body of the error table's kinds (400
    ``invalid_argument``; anything else ``internal``). aiohttp has no hook for
    this, so its protocol handler's error method is wrapped, once per process."""
    from aiohttp import web_protocol

    cls = web_protocol.RequestHandler
    if getattr(cls.handle_error, "_spooler", False):
        return
    plain = cls.handle_error

    def handle_error(self, request, status=500, exc=None, message=None):
        resp = plain(self, request, status, exc, message)
        # the contract's statuses and kinds: 413 for a body too large, else 400
        why = _without_request_bytes(message or resp.reason)
        if resp.status == 413:
            e = errors.MessageTooLarge(f"request body too large: {why}"[:300])
        elif 400 <= resp.status < 500:
            e = errors.InvalidArgument(f"malformed HTTP request: {why}"[:300])
        else:
            e = errors.Internal("internal error")
        out = web.Response(status=e.http_status, body=errors.http_body(e), content_type=JSON)
        # this answer skips on_response_prepare: name the epoch here (the app that
        # owns this connection says how; aiohttp's Server keeps its handler)
        app = getattr(getattr(getattr(self, "_manager", None), "request_handler", None), "__self__", None)
        epoch_of = app.get(EPOCH_OF) if isinstance(app, web.Application) else None
        if epoch_of is not None:
            out.headers["Spooler-Epoch"] = str(epoch_of())
        metrics = app.get(METRICS) if isinstance(app, web.Application) else None
        if metrics is not None:  # counted as every answer is: no route was matched
            metrics.answered("http", "unmatched", time.monotonic(), e)
        out.force_close()
        return out

    handle_error._spooler = True
    cls.handle_error = handle_error
    logging.getLogger("aiohttp.server").addFilter(_log_without_request_bytes)


_QUOTED = re.compile(r"""b(['"]).*?(?<!\\)\1""", re.S)


def _without_request_bytes(text) -> str:
    """aiohttp's reason for refusing a request, without the bytes of the request
    it quotes (they may be an Authorization header's key): its first line, with
    any quoted bytes cut out."""
    first = _QUOTED.sub("<request bytes>", str(text)).strip().split("\n")[0]
    return first.rstrip(": ")


def _log_without_request_bytes(record: logging.LogRecord) -> bool:
    """aiohttp logs a request it cannot parse with its exception, whose text
    quotes the request's bytes: log the reason alone."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, http_exceptions.HttpProcessingError):
        # a client's doing, not the node's: a warning, and at most one a minute
        # (a loop of malformed requests, no key needed, wrote a line each)
        left_out = logs.allow(("http", "malformed"))
        if left_out < 0:
            return False
        record.msg = "refused a malformed HTTP request: %s" + (
            f" (and {left_out} more in the last minute, not logged)" if left_out else "")
        record.args = (_without_request_bytes(getattr(exc, "message", None) or exc),)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = None
        record.exc_text = None
    return True


def build_app(svc: Service, metrics) -> web.Application:
    lim = svc.limits
    json_protocol_errors()
    # Bodies beyond this never reach a handler (413). A message is checked
    # against body_bytes_max on its own (before it is read when it names its
    # length); the JSON of the other routes may be as large as JSON_BYTES_MAX
    # even under a small --max-body-bytes.
    # A compressed body may be a little larger than what it decodes to (an
    # incompressible message grows by its framing): raw_allowance.
    cap = max(lim.body_bytes_max, JSON_BYTES_MAX)
    app = web.Application(client_max_size=cap + raw_allowance(cap) + 1, middlewares=[_errors_mw(metrics)])
    app[BODY_CAP] = cap  # the bound once a body is decoded

    app[EPOCH_OF] = lambda: svc.engine.known_epoch
    app[METRICS] = metrics

    async def add_epoch(request, response):
        response.headers["Spooler-Epoch"] = str(svc.engine.known_epoch)

    app.on_response_prepare.append(add_epoch)

    async def principal(request):
        return await svc.verified(svc.authenticate(_header(request, "Authorization")))

    # ------------------------------------------------------------ queues
    async def put_queue(request):
        p = await principal(request)
        name = svc.check_name(request.match_info["queue"])
        settings = await _read_json(request)
        created, doc = await svc.put_queue(p, name, settings)
        return _json(doc, 201 if created else 200)

    async def get_queue(request):
        return _json(await svc.get_queue(await principal(request), request.match_info["queue"]))

    async def list_queues(request):
        return _json({"queues": await svc.list_queues(await principal(request))})

    async def delete_queue(request):
        await svc.delete_queue(await principal(request), request.match_info["queue"])
        return web.Response(status=204)

    async def redrive(request):
        moved = await svc.redrive(await principal(request), request.match_info["queue"])
        return _json({"moved": moved})

    async def purge(request):
        purged = await svc.purge(await principal(request), request.match_info["queue"])
        return _json({"purged": purged})

    # ---------------------------------------------------------- messages
    async def send(request):
        p = await principal(request)
        queue = request.match_info["queue"]
        n = request.content_length
        if n is not None and n > lim.body_bytes_max and (
                n > lim.body_bytes_max + raw_allowance(lim.body_bytes_max) or not request.headers.get("Content-Encoding")):
            raise errors.MessageTooLarge(f"message of {n} bytes; the limit is {lim.body_bytes_max}")
        delay = svc.parse_seconds_header(_header(request, "Spooler-Delay-Seconds"), "Spooler-Delay-Seconds",
                                         lim.delay_s_max)
        key = _header(request, "Spooler-Dedup-Key")
        if key is not None and (not key or len(key) > lim.dedup_key_chars_max):
            raise errors.InvalidArgument(f"Spooler-Dedup-Key: 1..{lim.dedup_key_chars_max} characters")
        reserved = 0
        if n is not None:
            try:
                svc.check_send_to(p, queue)  # a body it may not send is neither held nor read
                svc.check_sending_room(n)  # before the body is read: refused, it is never held
            except errors.SpoolerError:
                request[CLOSE] = True  # (its body stays unread)
                raise
            svc.sending_bytes += n  # held while it is read (then counted as the send's own)
            reserved = n
        try:
            body = await _read(request)
        finally:
            svc.sending_bytes -= reserved
        if len(body) > lim.body_bytes_max:  # chunked, or larger once decoded
            raise errors.MessageTooLarge(f"message of {len(body)} bytes; the limit is {lim.body_bytes_max}")
        [(mid, dup, err)] = await svc.send(p, [(queue, body, delay, key or "")])
        if err is not None:
            raise err
        return _json({"id": mid, "duplicate": dup}, 200 if dup else 201)

    async def receive(request):
        p = await principal(request)
        waits = request.query.getall("wait", ["0"])
        if len(waits) > 1:  # which one? (as for a header given twice)
            raise errors.InvalidArgument(f"wait given {len(waits)} times; give it once")
        raw = waits[0]
        wait = svc.parse_seconds_header(raw, "wait", lim.wait_s_max)
        got = await svc.receive(p, request.match_info["queue"], wait, 1)
        if got and (request.transport is None or request.transport.is_closing()):
            # the client went away while it waited: nobody will read this answer
            svc.give_back([d.token for d in got], p.auth)
            return web.Response(status=204)
        if not got:
            return web.Response(status=204)
        d = got[0]
        return web.Response(status=200, body=d.body, content_type="application/octet-stream", headers={
            "Spooler-Message-Id": d.id, "Spooler-Lease-Token": d.token,
            "Spooler-Retry-Count": str(d.retry_count), "Spooler-Lease-Expires-At": d.expires_at})

    # ------------------------------------------------------------ leases
    async def ack(request):
        await svc.ack(await principal(request), request.match_info["token"])
        return web.Response(status=204)

    async def nack(request):
        p = await principal(request)
        delay = svc.parse_seconds_header(_header(request, "Spooler-Delay-Seconds"), "Spooler-Delay-Seconds",
                                         lim.delay_s_max)
        await svc.nack(p, request.match_info["token"], delay)
        return web.Response(status=204)

    async def renew(request):
        return _json({"expiresAt": await svc.renew(await principal(request), request.match_info["token"])})

    # -------------------------------------------------------------- keys
    async def create_key(request):
        p = await principal(request)
        body = _fields(await _read_json(request), ("queue", "scopes"))
        queue = body.get("queue", "*")
        if queue == "":  # "*" is how a JSON caller asks for every queue
            raise errors.InvalidArgument('queue must be a queue name or "*"')
        return _json(await svc.create_key(p, queue, body.get("scopes")), 201)

    async def list_keys(request):
        return _json({"keys": await svc.list_keys(await principal(request))})

    async def delete_key(request):
        await svc.delete_key(await principal(request), request.match_info["id"])
        return web.Response(status=204)

    # ----------------------------------------------------------- cluster
    async def cluster(request):
        return _json(await svc.cluster(await principal(request)))

    async def promote(request):
        p = await principal(request)
        body = _fields(await _read_json(request), ("node",))
        return _json(await svc.promote(p, body.get("node")))

    # --------------------------------------------------------------- ops
    async def healthz(request):
        return _json({"status": "ok"})

    async def readyz(request):
        e = svc.engine
        if not e.clients_ready():
            raise errors.Unavailable("not ready", retry_after_s=1.0)
        return _json({"status": "ready", "role": e.role, "epoch": e.known_epoch, "primary": e.primary_id})

    async def metrics_route(request):
        return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    routes = [
        web.put("/v1/queues/{queue}", put_queue),
        web.get("/v1/queues/{queue}", get_queue),
        web.delete("/v1/queues/{queue}", delete_queue),
        web.get("/v1/queues", list_queues),
        web.post("/v1/queues/{queue}/redrive", redrive),
        web.post("/v1/queues/{queue}/purge", purge),
        web.post("/v1/queues/{queue}/messages", send),
        web.post("/v1/queues/{queue}/receive", receive),
        web.post("/v1/leases/{token}/ack", ack),
        web.post("/v1/leases/{token}/nack", nack),
        web.post("/v1/leases/{token}/renew", renew),
        web.post("/v1/keys", create_key),
        web.get("/v1/keys", list_keys),
        web.delete("/v1/keys/{id}", delete_key),
        web.get("/v1/cluster", cluster),
        web.post("/v1/cluster/promote", promote),
        # (every GET answers HEAD too: the same status and headers, no body)
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics_route),
    ]
    expect = _expect_handler(metrics)
    app.add_routes([web.RouteDef(r.method, r.path, r.handler, {**r.kwargs, "expect_handler": expect})
                    for r in routes])
    return app


async def _answer_then_close(request: web.Request, r: web.Response) -> None:
    """Send ``r`` now and close the connection behind it: the request's body
    cannot be read to its end, so nothing after it on this connection can be
    parsed. (aiohttp, told only that the connection should not be kept, would
    first try to drain that body for up to 10 s; and its own force-close flag,
    set alone, skips the drain and then leaves the socket open for good.)"""
    r.force_close()
    try:
        await r.prepare(request)
        await r.write_eof()
    except ConnectionError:
        pass   # the client is gone already
    request.protocol.force_close()   # the answer is written: close behind it


# routes whose 503 says "not ready", not that anything failed: counted as calls, not as errors
_PROBES = frozenset({"GET /healthz", "HEAD /healthz", "GET /readyz", "HEAD /readyz"})


# A contract route with its name, token or key id left empty matches no route; it is
# a malformed name (400 invalid_argument, API.md), not a route that does not exist
_EMPTY_PART = ((re.compile(r"^/v1/queues/(/(messages|receive|redrive|purge))?$"), "queue name"),
               (re.compile(r"^/v1/leases//(ack|nack|renew)$"), "lease token"),
               (re.compile(r"^/v1/keys/$"), "key id"))


def _no_route(method: str, path: str) -> errors.SpoolerError:
    for pattern, what in _EMPTY_PART:
        if pattern.match(path) and (what != "key id" or method == "DELETE"):  # (POST /v1/keys/: a stray slash)
            return errors.InvalidArgument(f"malformed {what}: it is empty")
    return errors.NotFound(f"no route {path}")


def _call_name(request: web.Request) -> str:
    """The route a request took, as spooler_calls names it: its method and template
    ("POST /v1/queues/{queue}/messages"), or "unmatched" (metrics.Calls)."""
    resource = request.match_info.route.resource
    if resource is None:
        return "unmatched"
    return f"{request.method} {resource.canonical}"


def _errors_mw(metrics):
    async def answer(request, handler) -> tuple:
        """(the handler's answer, None), or (the error table's for what it raised, that error)."""
        try:
            return await handler(request), None
        except errors.SpoolerError as e:
            return _error(e), e
        except web.HTTPRequestEntityTooLarge as e:
            e = errors.MessageTooLarge(f"body over the limit ({e.text})")
            return _error(e), e
        except web.HTTPMethodNotAllowed as e:
            refused = errors.MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
            r = _error(refused)
            r.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
            return r, refused
        except web.HTTPNotFound:
            e = _no_route(request.method, request.path)
            return _error(e), e
        except web.HTTPException as e:
            if e.status >= 400:
                e = errors.InvalidArgument(e.reason or str(e.status))
                return _error(e), e
            raise
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            e = errors.Internal("internal error")
            return _error(e), e

    @web.middleware
    async def mw(request, handler):
        began = time.monotonic()
        guard = request.app.get(CONNECTIONS)
        if guard is not None and guard.past_bound(request):
            # a connection past --http-max-connections: told why, then closed
            # (http_conns.py; a probe's route is still answered, then closed)
            request[CLOSE] = True
            if guard.answering(request):
                e = errors.Unavailable(f"this node serves at most {guard.most} HTTP connections; try again shortly",
                                       reason=errors.TOO_MANY_CONNECTIONS, retry_after_s=1)
                r = _error(e)
                metrics.answered("http", _call_name(request), began, e)
                await _answer_then_close(request, r)
                return r
        if "Upgrade" in request.headers:
            # The node never upgrades (h2c, websocket), but aiohttp's parser takes
            # whatever follows such a request on its connection as the upgraded
            # protocol's and drops it: a request pipelined behind it would wait
            # for an answer that never comes. Answered, then closed, its client
            # sees that at once and can send it again on a new connection.
            request[CLOSE] = True
        call = _call_name(request)
        running = metrics.calls.enter("http", call)
        try:
            r, e = await answer(request, handler)
        except asyncio.CancelledError:  # the client went away first (aiohttp cancels its handler)
            metrics.answered("http", call, began, CANCELLED)
            raise
        finally:
            metrics.calls.leave(running)
            if guard is not None:
                guard.request_answered(request)
        metrics.answered("http", call, began, e, probe=call in _PROBES)
        if request.get(CLOSE) and isinstance(r, web.Response) and not r.prepared:
            await _answer_then_close(request, r)  # whatever the answer (set where a body could not be read)
        return r

    return mw
