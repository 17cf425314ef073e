"""A raw HTTP client for the contract tests: never raises on a status, and checks the
invariants every response must hold (Spooler-Epoch; a JSON error body with a known kind).

Standard library only (http.client), so the tests see exactly what the node sent.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import urllib.parse
from datetime import datetime, timezone
from typing import Optional

#: the contract's error kinds (API.md) plus the node's extensions for routes and methods
CONTRACT_KINDS = {"invalid_argument", "unauthenticated", "forbidden", "queue_not_found", "stale_lease",
                  "message_too_large", "operation_unconfirmed", "unavailable"}
EXTENSION_KINDS = {"not_found", "method_not_allowed"}
KINDS = CONTRACT_KINDS | EXTENSION_KINDS

STATUS_OF_KIND = {"invalid_argument": 400, "unauthenticated": 401, "forbidden": 403, "queue_not_found": 404,
                  "not_found": 404, "method_not_allowed": 405, "stale_lease": 409, "message_too_large": 413,
                  "operation_unconfirmed": 500, "unavailable": 503}

RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|\+00:00)$")

_DEFAULT = object()


class Resp:
    def __init__(self, status: int, headers: list, body: bytes):
        self.status = status
        self.header_list = headers
        self.headers = {k.lower(): v for k, v in headers}
        self.body = body

    def h(self, name: str) -> Optional[str]:
        return self.headers.get(name.lower())

    def json(self):
        return json.loads(self.body)

    @property
    def epoch(self) -> int:
        return int(self.headers["spooler-epoch"])

    def __repr__(self):
        return f"<Resp {self.status} {self.headers} {self.body[:300]!r}>"


def check_invariants(r: Resp) -> None:
    """What every HTTP response of the node must satisfy."""
    ep = r.h("Spooler-Epoch")
    assert ep is not None and ep.isdigit(), f"missing/invalid Spooler-Epoch: {r!r}"
    if r.status >= 400:
        assert (r.h("Content-Type") or "").startswith("application/json"), r
        doc = json.loads(r.body)
        assert isinstance(doc, dict), r
        assert isinstance(doc.get("kind"), str) and isinstance(doc.get("message"), str) and doc["message"], r
        assert doc["kind"] in KINDS, f"unexpected error kind (internal = bug): {r!r}"
        assert STATUS_OF_KIND[doc["kind"]] == r.status, f"kind/status mismatch: {r!r}"
        if doc["kind"] == "unavailable":
            assert (r.h("Retry-After") or "").isdigit(), r


def parse_rfc3339(s: str) -> datetime:
    assert RFC3339_UTC.match(s), f"not RFC 3339 UTC: {s!r}"
    s = s.replace("Z", "+00:00")
    if "." in s:  # fromisoformat on 3.10 wants 3 or 6 fraction digits
        head, _, rest = s.partition(".")
        frac, _, tz = rest.partition("+")
        s = f"{head}.{(frac + '000000')[:6]}+{tz}"
    d = datetime.fromisoformat(s)
    assert d.utcoffset().total_seconds() == 0
    return d


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class Api:
    def __init__(self, url: str, key: Optional[str]):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.key = key

    def with_key(self, key: Optional[str]) -> "Api":
        a = Api(f"http://{self.host}:{self.port}", key)
        return a

    def req(self, method: str, path: str, body=b"", headers: Optional[dict] = None, key=_DEFAULT,
            timeout_s: float = 30.0, check: bool = True) -> Resp:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        h = {}
        k = self.key if key is _DEFAULT else key
        if k is not None:
            h["Authorization"] = f"Bearer {k}"
        if isinstance(body, (bytes, bytearray)):
            h["Content-Length"] = str(len(body))
        h.update(headers or {})
        try:
            conn.request(method, path, body=body, headers=h, encode_chunked=not isinstance(body, (bytes, bytearray)))
            r = conn.getresponse()
            resp = Resp(r.status, r.getheaders(), r.read())
        finally:
            conn.close()
        if check:
            check_invariants(resp)
        return resp

    # ---- conveniences (no assertions beyond the invariants)
    def put_queue(self, name: str, settings=None, **kw) -> Resp:
        body = b"" if settings is None else (settings if isinstance(settings, bytes) else json.dumps(settings).encode())
        return self.req("PUT", f"/v1/queues/{q(name)}", body, {"Content-Type": "application/json"}, **kw)

    def get_queue(self, name: str, **kw) -> Resp:
        return self.req("GET", f"/v1/queues/{q(name)}", **kw)

    def stats(self, name: str) -> dict:
        r = self.get_queue(name)
        assert r.status == 200, r
        return r.json()["stats"]

    def send(self, queue: str, body: bytes = b"x", delay=None, dedup=None, headers=None, **kw) -> Resp:
        h = {"Content-Type": "application/octet-stream"}
        if delay is not None:
            h["Spooler-Delay-Seconds"] = str(delay)
        if dedup is not None:
            h["Spooler-Dedup-Key"] = dedup
        h.update(headers or {})
        return self.req("POST", f"/v1/queues/{q(queue)}/messages", body, h, **kw)

    def receive(self, queue: str, wait=None, **kw) -> Resp:
        path = f"/v1/queues/{q(queue)}/receive" + ("" if wait is None else f"?wait={wait}")
        return self.req("POST", path, **kw)

    def ack(self, token: str, **kw) -> Resp:
        return self.req("POST", f"/v1/leases/{q(token)}/ack", **kw)

    def nack(self, token: str, delay=None, **kw) -> Resp:
        h = {} if delay is None else {"Spooler-Delay-Seconds": str(delay)}
        return self.req("POST", f"/v1/leases/{q(token)}/nack", headers=h, **kw)

    def renew(self, token: str, **kw) -> Resp:
        return self.req("POST", f"/v1/leases/{q(token)}/renew", **kw)

    def redrive(self, queue: str, **kw) -> Resp:
        return self.req("POST", f"/v1/queues/{q(queue)}/redrive", **kw)

    def purge(self, queue: str, **kw) -> Resp:
        return self.req("POST", f"/v1/queues/{q(queue)}/purge", **kw)

    def create_key(self, queue="*", scopes=("send",), **kw) -> Resp:
        return self.req("POST", "/v1/keys", json.dumps({"queue": queue, "scopes": list(scopes)}).encode(),
                        {"Content-Type": "application/json"}, **kw)


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def one_response(s) -> bytes:
    """Read from socket ``s`` until one whole HTTP response (head and Content-Length
    body), EOF, a reset or the socket's timeout: the bytes read."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                m = re.search(rb"\r\ncontent-length: *(\d+)", head.lower())
                if m is None or len(body) >= int(m.group(1)):
                    break
    except (ConnectionResetError, socket.timeout):
        pass
    return data
