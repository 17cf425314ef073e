"""A small synchronous HTTP/JSON client (standard library only).

spoolctl uses it; services may too. Errors come back as the classes of
:mod:`spooler.errors`, mapped from the same table the node uses.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass
from typing import Optional

from spooler import errors


def seconds(x: float) -> str:
    """Seconds as the contract writes them: digits and an optional fraction, never
    an exponent (``1e-07``) or a sign, to the microsecond the node keeps."""
    x = float(x)
    if x != x or x in (float("inf"), float("-inf")):
        raise errors.InvalidArgument(f"seconds must be a finite number, not {x}")
    if x < 0:
        raise errors.InvalidArgument(f"seconds must not be negative, not {x}")
    return f"{x:.6f}".rstrip("0").rstrip(".") or "0"


@dataclass
class Delivery:
    id: str
    body: bytes
    token: str
    retry_count: int
    expires_at: str
    queue: str = ""


class HttpClient:
    def __init__(self, url: str = "http://127.0.0.1:8080", key: str = "", timeout_s: float = 30.0):
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https"):
            raise errors.InvalidArgument(f"unsupported server URL scheme: {u.scheme}")
        try:
            u.port  # noqa: B018 - parses it: "host:notaport" is refused here, not mid-request
        except ValueError:
            raise errors.InvalidArgument(f"server URL {url!r}: the port is not a number") from None
        if not u.hostname:
            raise errors.InvalidArgument(f"server URL {url!r} names no host")
        self.scheme, self.netloc = u.scheme, u.netloc
        self.prefix = u.path.rstrip("/")
        self.key = key
        self.timeout_s = timeout_s
        self.last_epoch: Optional[int] = None

    # --- plumbing ---------------------------------------------------------
    def request(self, method: str, path: str, body: bytes = b"", headers: Optional[dict] = None,
                timeout_s: Optional[float] = None):
        """Returns (status, headers, body); raises SpoolerError for 4xx/5xx."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.netloc, timeout=timeout_s or self.timeout_s)
        h = {"Content-Length": str(len(body))}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        h.update(headers or {})
        try:
            try:
                conn.connect()
            except (OSError, http.client.HTTPException) as e:
                # refused, unresolvable, timed out: nothing was sent, so safe to retry
                raise errors.Unavailable(f"cannot connect to {self.netloc}: {e}") from e
            try:
                # http.client sends nothing until the request line and every header are
                # encoded, so a value it cannot encode fails here with nothing sent
                conn.putrequest(method, self.prefix + path)
                for k, v in h.items():
                    conn.putheader(k, v)
            except (UnicodeError, ValueError) as e:
                raise errors.InvalidArgument(f"request cannot be encoded: {e}") from e
            try:
                conn.endheaders(body)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as e:
                # The request left: a write may have reached the node.
                if method == "GET":
                    raise errors.Unavailable(f"no answer from {self.netloc}: {e}") from e
                raise errors.OperationUnconfirmed(f"connection to {self.netloc} failed after the request "
                                                  f"was sent: {e}") from e
        finally:
            conn.close()
        rh = {k.title(): v for k, v in resp.getheaders()}
        if rh.get("Spooler-Epoch", "").isdigit():
            self.last_epoch = int(rh["Spooler-Epoch"])
        if resp.status >= 400:
            raise errors.from_http(resp.status, data, rh, method)
        return resp.status, rh, data

    def _json(self, method, path, obj=None):
        body = json.dumps(obj).encode() if obj is not None else b""
        hdr = {"Content-Type": "application/json"} if obj is not None else {}
        status, _, data = self.request(method, path, body, hdr)
        return status, (json.loads(data) if data else None)

    @staticmethod
    def _q(name: str) -> str:
        # surrogateescape: a name from a command line that is not UTF-8 goes out as
        # its bytes, and the node refuses it as a malformed name
        return urllib.parse.quote(name.encode("utf-8", "surrogateescape"), safe="")

    @staticmethod
    def _name(name: str, what: str = "queue name") -> str:
        """A queue name (or key id) for a path: an empty one would make another
        path (the list of queues, or no route at all), so it is refused here."""
        if not name:
            raise errors.InvalidArgument(f"malformed {what}: it is empty")
        return HttpClient._q(name)

    @staticmethod
    def _token(token: str) -> str:
        if not token:
            raise errors.InvalidArgument("malformed lease token: it is empty")
        return HttpClient._q(token)

    # --- queues -----------------------------------------------------------
    def put_queue(self, name: str, **settings) -> dict:
        """settings: leaseTimeoutSeconds, maxRetries, retentionSeconds, dedupWindowSeconds, failureQueue."""
        status, doc = self._json("PUT", f"/v1/queues/{self._name(name)}", settings)
        doc["created"] = status == 201
        return doc

    def get_queue(self, name: str) -> dict:
        return self._json("GET", f"/v1/queues/{self._name(name)}")[1]

    def list_queues(self) -> list:
        return self._json("GET", "/v1/queues")[1]["queues"]

    def delete_queue(self, name: str) -> None:
        self.request("DELETE", f"/v1/queues/{self._name(name)}")

    def redrive(self, name: str) -> int:
        return self._json("POST", f"/v1/queues/{self._name(name)}/redrive")[1]["moved"]

    def purge(self, name: str) -> int:
        return self._json("POST", f"/v1/queues/{self._name(name)}/purge")[1]["purged"]

    # --- messages ---------------------------------------------------------
    def send(self, queue: str, body: bytes, delay_s: Optional[float] = None,
             dedup_key: Optional[str] = None) -> dict:
        h = {"Content-Type": "application/octet-stream"}
        if delay_s is not None:
            h["Spooler-Delay-Seconds"] = seconds(delay_s)
        if dedup_key is not None:  # "" too: the node answers invalid_argument, not a send without a key
            # as UTF-8, the bytes the node reads it as: the key a gRPC send of the
            # same string names (http.client would encode Latin-1, and refuse the rest)
            h["Spooler-Dedup-Key"] = dedup_key.encode("utf-8", "surrogateescape")
        _, _, data = self.request("POST", f"/v1/queues/{self._name(queue)}/messages", body, h)
        return json.loads(data)

    def receive(self, queue: str, wait_s: float = 0.0) -> Optional[Delivery]:
        path = f"/v1/queues/{self._name(queue)}/receive?wait={seconds(wait_s)}"
        status, h, data = self.request("POST", path, timeout_s=self.timeout_s + wait_s)
        if status == 204:
            return None
        return Delivery(id=h["Spooler-Message-Id"], body=data, token=h["Spooler-Lease-Token"],
                        retry_count=int(h["Spooler-Retry-Count"]),
                        expires_at=h["Spooler-Lease-Expires-At"], queue=queue)

    def ack(self, token: str) -> None:
        self.request("POST", f"/v1/leases/{self._token(token)}/ack")

    def nack(self, token: str, delay_s: Optional[float] = None) -> None:
        h = {"Spooler-Delay-Seconds": seconds(delay_s)} if delay_s is not None else {}
        self.request("POST", f"/v1/leases/{self._token(token)}/nack", headers=h)

    def renew(self, token: str) -> str:
        return self._json("POST", f"/v1/leases/{self._token(token)}/renew")[1]["expiresAt"]

    # --- keys and cluster -------------------------------------------------
    def create_key(self, queue: str = "*", scopes=("send", "receive")) -> dict:
        return self._json("POST", "/v1/keys", {"queue": queue, "scopes": list(scopes)})[1]

    def list_keys(self) -> list:
        return self._json("GET", "/v1/keys")[1]["keys"]

    def delete_key(self, key_id: str) -> None:
        self.request("DELETE", f"/v1/keys/{self._name(key_id, 'key id')}")

    def cluster(self) -> dict:
        return self._json("GET", "/v1/cluster")[1]

    def promote(self, node: str) -> dict:
        return self._json("POST", "/v1/cluster/promote", {"node": node})[1]
