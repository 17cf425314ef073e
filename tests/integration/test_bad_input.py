"""Bad input against a live node: schemathesis (driven by docs/openapi.yaml), hypothesis
raw requests, raw-socket garbage, and regression tests for the bad inputs found so far.

What must hold, whatever comes in:
* no 5xx except the documented ones (500 operation_unconfirmed, 503 unavailable with
  Retry-After); a 500 with kind ``internal`` is a bug;
* every error is JSON ``{"kind", "message"}`` with a contract kind (plus the extensions
  ``not_found`` and ``method_not_allowed``), and every response carries Spooler-Epoch;
* the node stays up (its pid alive, /healthz 200) and the messages stored before the
  fuzzing are all still there at the end (``test_zz_seeded_messages_survived`` runs last).

The known bugs have their own deterministic tests below (deep JSON nesting, integers
beyond float range, 405 without Allow); the generic fuzzers keep their JSON shallow and
their numbers within float range so that they keep looking for new failures.
"""
from __future__ import annotations

import json
import re
import math
import os
import socket
import string
import urllib.parse
import uuid
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract_client import KINDS, Api, Resp, check_invariants, one_response
from nodeproc import ADMIN_KEY, wait_until

pytestmark = pytest.mark.integration

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
N_SEED = 25
FUZZ_QUEUE = "fuzzq"

schema = schemathesis.openapi.from_path(str(SPEC))
# A 413 for an over-long body is a rejection too.
schema.config.checks.negative_data_rejection.expected_statuses = [
    *schema.config.checks.negative_data_rejection.expected_statuses, "413"]


@pytest.fixture(scope="module")
def seeded(shared_node):
    """N messages stored before any fuzzing, in a queue no fuzzer can name."""
    api = Api(shared_node.http_url, shared_node.admin_key)
    name = "seed-" + uuid.uuid4().hex
    assert api.put_queue(name, {}).status == 201
    ids = {}
    for i in range(N_SEED):
        body = f"seed-{i}-".encode() + os.urandom(16)
        r = api.send(name, body)
        assert r.status == 201, r
        ids[r.json()["id"]] = body
    assert api.put_queue(FUZZ_QUEUE, {"leaseTimeoutSeconds": 0.5}).status in (200, 201)
    for i in range(5):
        api.send(FUZZ_QUEUE, b"fuzz-%d" % i)
    return shared_node, api, name, ids


def assert_alive(node, api):
    assert node.alive(), f"node died; log:\n{node.read_log()}"
    os.kill(node.pid, 0)
    r = api.req("GET", "/healthz", key=None)
    assert r.status == 200, r


def assert_good_response(r: Resp, method: str = "GET"):
    if method.upper() == "HEAD":
        assert r.h("Spooler-Epoch", ) is not None and r.status < 500, r
        return
    check_invariants(r)  # Spooler-Epoch; JSON error with a known kind matching its status
    if r.status >= 500:
        kind = r.json()["kind"]
        assert kind in ("operation_unconfirmed", "unavailable"), f"undocumented 5xx: {r!r}"


# ------------------------------------------------------------------- schemathesis

@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_schemathesis(case, seeded):
    node, api, _, _ = seeded
    # a valid long poll on an existing queue would just sit there: keep waits short
    if case.query and "wait" in case.query:
        try:
            w = float(case.query["wait"])
            if 0.05 < w <= 20:
                case.query["wait"] = "0.05"
        except (TypeError, ValueError):
            pass
    r = case.call(base_url=node.http_url, headers={"Authorization": f"Bearer {node.admin_key}"}, timeout=30)
    if case.method.upper() != "HEAD":
        hdrs = [(k, v[0] if isinstance(v, list) else v) for k, v in r.headers.items()]
        assert_good_response(Resp(r.status_code, hdrs, r.content), case.method)
    case.validate_response(r, excluded_checks=[
        # a schema-valid request may still name a queue or lease that does not exist
        schemathesis.checks.positive_data_acceptance,
        # 405 without an Allow header: a known bug, see test_405_has_allow_header
        schemathesis.checks.unsupported_method,
    ])


# --------------------------------------------------------------- hypothesis, raw HTTP

ODD_NUMBERS = [math.nan, math.inf, -math.inf, 1e308, -1e308, -0.0, 5e-324, 2 ** 53 + 1, 10 ** 30, -(10 ** 30),
               0, 1, -1, 0.1, 43200, 43200.0001, 1209600, 1209601, 1000, 1001, 86400, 20, 20.000001]
SETTING_KEYS = ["leaseTimeoutSeconds", "maxRetries", "retentionSeconds", "dedupWindowSeconds", "failureQueue"]

json_scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(ODD_NUMBERS),
                         st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=30))
json_values = st.recursive(json_scalars,
                           lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                  st.dictionaries(st.text(max_size=12) | st.sampled_from(SETTING_KEYS),
                                                                  kids, max_size=4)),
                           max_leaves=12)
settings_objects = st.dictionaries(st.sampled_from(SETTING_KEYS), json_values, max_size=5)


def _json_bytes(v) -> bytes:
    return json.dumps(v, allow_nan=True).encode()


bodies = st.one_of(
    st.just(b""),
    st.binary(max_size=300),
    st.sampled_from([b"\xff\xfe\xfd", b"\xc3\x28", b"\xed\xa0\x80", b"{\"a\": \"\xff\"}", b"\x00" * 10,
                     b"{", b"}", b"[", b"nul", b"NaN", b"-0", b"1e999", b"\"\\ud800\"", b"{\"node\": \"\\u0000\"}"]),
    json_values.map(_json_bytes),
    settings_objects.map(_json_bytes),
    st.fixed_dictionaries({}, optional={"queue": json_values, "scopes": json_values,
                                        "node": json_values}).map(_json_bytes),
)

segment_texts = st.one_of(
    st.sampled_from([FUZZ_QUEUE, "fuzzq.failed", "x" * 81, "x" * 256, "..", ".", "%00", "a b", "*", "n1",
                     "A" * 27, "A" * 400, "A" * 2000, "0123456789ab"]),
    st.text(alphabet=string.ascii_letters + string.digits + "._-", min_size=1, max_size=90),
    st.binary(min_size=1, max_size=40).map(lambda b: urllib.parse.quote(b, safe="")),
    st.text(min_size=1, max_size=40).map(lambda s: urllib.parse.quote(s, safe="")),
)

ROUTE_TEMPLATES = ["/v1/queues", "/v1/queues/{a}", "/v1/queues/{a}/messages", "/v1/queues/{a}/receive",
                   "/v1/queues/{a}/redrive", "/v1/leases/{a}/ack", "/v1/leases/{a}/nack", "/v1/leases/{a}/renew",
                   "/v1/keys", "/v1/keys/{a}", "/v1/cluster", "/v1/cluster/promote", "/healthz", "/readyz",
                   "/metrics", "/{a}", "/v1/{a}/{a}", "/v1/queues/{a}/{a}", "/v1/leases/{a}", "/", "/v1/"]


@st.composite
def paths(draw):
    tpl = draw(st.sampled_from(ROUTE_TEMPLATES))
    path = tpl.replace("{a}", draw(segment_texts)) if "{a}" in tpl else tpl
    if draw(st.booleans()):
        pairs = draw(st.lists(st.tuples(st.sampled_from(["wait", "x", "wait", ""]),
                                        st.one_of(st.sampled_from([str(n) for n in ODD_NUMBERS] + ["", "abc", "1_0",
                                                                                                   "0x1", " 1"]),
                                                  st.text(max_size=10))),
                              max_size=3))
        path += "?" + urllib.parse.urlencode(pairs)
    return path


header_values = st.one_of(
    st.sampled_from([str(n) for n in ODD_NUMBERS] + ["", " ", "abc", "1e400", "0x10", "½", "-0", "1,2"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=60),
)
auth_values = st.one_of(st.just(f"Bearer {ADMIN_KEY}"), st.just(f"Bearer {ADMIN_KEY}"), st.none(),
                        st.sampled_from(["Bearer", "Bearer ", "bearer " + ADMIN_KEY, "Basic abc", "Bearer " + "k" * 600,
                                         "Bearer spk_", "Bearer spk_0123456789ab_", "Bearer spk___",
                                         "Bearer \u00e9\u00e9"]),
                        header_values.map(lambda v: "Bearer " + v))


@st.composite
def requests_(draw):
    # (methods aiohttp's parser does not know get a plain-text 400 before the app: see GARBAGE)
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "POST", "PUT", "TRACE"]))
    headers = {}
    auth = draw(auth_values)
    if auth is not None:
        headers["Authorization"] = auth
    for name in ("Spooler-Delay-Seconds", "Spooler-Dedup-Key", "Content-Type"):
        if draw(st.booleans()):
            headers[name] = draw(header_values)
    return method, draw(paths()), headers, draw(bodies)


def raw_request(node, method, path, headers, body) -> Resp:
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", node.http_port, timeout=30)
    # http.client refuses to send a path with a space or control character (it could
    # split the request line): send those percent-encoded, as any client must
    path = re.sub(r"[\x00-\x20\x7f]", lambda m: "%%%02X" % ord(m.group()), path)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v.encode("utf-8"))
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return Resp(r.status, r.getheaders(), r.read())
    finally:
        conn.close()


@given(req=requests_())
@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_hypothesis_raw_requests(seeded, req):
    node, api, seed_queue, _ = seeded
    method, path, headers, body = req
    assert seed_queue not in path
    r = raw_request(node, method, path, headers, body)
    assert_good_response(r, method)


@given(settings_obj=settings_objects)
@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_hypothesis_queue_settings(seeded, settings_obj):
    """Random settings documents: 200/201 with every given setting applied, or 400."""
    node, api, _, _ = seeded
    name = "fz-" + uuid.uuid4().hex[:8]
    r = api.put_queue(name, json.dumps(settings_obj, allow_nan=True).encode(), check=False)
    assert_good_response(r, "PUT")
    assert r.status in (200, 201, 400), r
    if r.status == 201:
        got = r.json()["settings"]
        for k, v in settings_obj.items():
            assert got[k] == pytest.approx(v, abs=1e-6) if k != "failureQueue" else got[k] == v
        api.req("DELETE", f"/v1/queues/{name}")
    else:
        assert r.json()["kind"] == "invalid_argument"
        assert api.get_queue(name).status == 404


@given(token=st.one_of(st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=420),
                       st.binary(min_size=17, max_size=120).map(
                           lambda b: __import__("base64").urlsafe_b64encode(b).rstrip(b"=").decode())),
       action=st.sampled_from(["ack", "nack", "renew"]))
@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_hypothesis_lease_tokens(seeded, token, action):
    """Random and random-but-well-framed tokens: 400 invalid_argument or 409 stale_lease, never a success."""
    node, api, _, _ = seeded
    r = api.req("POST", f"/v1/leases/{token}/{action}", check=False)
    assert_good_response(r, "POST")
    assert r.status in (400, 403, 404, 409), r


# --------------------------------------------------------------- raw-socket garbage

GARBAGE = [
    b"\x00\x01\x02\x03garbage\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /v1/queues/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/queues/fuzzq/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"PUT /v1/queues/fuzzq HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{",  # then hang up
    b"GET / HTTP/9.9\r\n\r\n",
    b"FOO /v1/queues HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(500)) + b"\r\n",
]


TRUNCATED = [GARBAGE[4]]


@pytest.mark.parametrize("payload,hang_up", [(g, h) for h in (False, True) for g in GARBAGE
                                              if h or g not in TRUNCATED],
                         ids=[f"{'hang-up' if h else 'answered'}-{i}" for h in (False, True)
                              for i, g in enumerate(GARBAGE) if h or g not in TRUNCATED])
def test_raw_socket_garbage(seeded, payload, hang_up):
    """Garbage then wait: the node must answer it (a JSON error of the table's kinds,
    with Spooler-Epoch). Garbage then hang up (our side closed for writing): it may
    drop the connection without a word, but if it answers, the same holds. A request
    whose body is still owed (the truncated PUT) is only sent with a hang-up: waiting
    for the rest of a body is the right thing for the node to do."""
    node, api, _, _ = seeded
    with socket.create_connection(("127.0.0.1", node.http_port), timeout=10) as s:
        s.sendall(payload)
        if hang_up:
            s.shutdown(socket.SHUT_WR)
        data = one_response(s)
    assert data or hang_up, "no answer to a malformed request"
    if data:
        status = int(data.split(b" ", 2)[1])
        assert 400 <= status < 500, data[:300]
        # even what aiohttp answers before any route runs speaks the error table
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"application/json" in head.lower(), data[:300]
        assert json.loads(body)["kind"] in KINDS, data[:300]
        assert re.search(rb"\r\nspooler-epoch: \d+\r\n", head.lower() + b"\r\n"), data[:300]  # every response
    assert_alive(node, api)


def _internal_errors(node) -> float:
    import urllib.request
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('spooler_errors_total{kind="internal",'):
                return float(line.split()[-1])  # (internal errors carry no reason: one series)
    return 0.0


def test_half_sent_body_then_hang_up_keeps_node_serving(seeded):
    """A client that hangs up inside its body is its own doing: the node keeps
    serving, and logs no traceback and counts no internal error for it."""
    node, api, _, _ = seeded
    internal, log_at = _internal_errors(node), len(node.read_log())
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", node.http_port), timeout=5)
        s.sendall(b"POST /v1/queues/fuzzq/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + ADMIN_KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\npartial")
        s.close()
    assert_alive(node, api)
    assert api.send(FUZZ_QUEUE, b"after").status == 201
    assert _internal_errors(node) == internal
    assert "Traceback" not in node.read_log()[log_at:]


# ------------------------------------------------- deterministic tests of the known bugs

def test_deeply_nested_json_is_400_not_500(seeded):
    """BUG: json.loads raises RecursionError (not ValueError) on deep nesting; the node
    answers 500 internal instead of 400 invalid_argument."""
    node, api, _, _ = seeded
    deep = b"[" * 100_000
    for method, path in (("PUT", "/v1/queues/deep-json"), ("POST", "/v1/keys"), ("POST", "/v1/cluster/promote")):
        r = api.req(method, path, deep, {"Content-Type": "application/json"}, check=False)
        assert r.status == 400, f"{method} {path}: {r!r}"
        assert r.json()["kind"] == "invalid_argument"
    assert_alive(node, api)


@pytest.mark.parametrize("setting", ["leaseTimeoutSeconds", "retentionSeconds", "dedupWindowSeconds"])
def test_integer_beyond_float_range_is_400_not_500(seeded, setting):
    """BUG: math.isfinite(10**400) raises OverflowError in Service._seconds -> 500 internal."""
    node, api, _, _ = seeded
    body = ('{"%s": 1%s}' % (setting, "0" * 400)).encode()
    r = api.put_queue("huge-int", body, check=False)
    assert r.status == 400, r
    assert r.json()["kind"] == "invalid_argument"


@pytest.mark.parametrize("line,words", [
    (b"Authorization: Bearer secret-" + b"k" * 9000, "8190"),       # over aiohttp's header limit
    (b"Authorization : Bearer secret-kkkk", "Invalid header token"),  # a space before the colon
    (b"Authorization: Bearer secret-kkkk\x01", "Invalid header value char"),
], ids=["oversized", "space-before-colon", "control-character"])
def test_a_malformed_authorization_header_is_never_quoted_back_or_logged(node, line, words):
    """aiohttp refuses these before any route runs; its words quoted the header
    line, which here holds the caller's key, back to the caller and into the
    node's log. A node of its own: such lines are logged once a minute, so on a
    node that refused another malformed request first, this one's line would not
    be written at all, and the log would hold no key whether it was cut out or not."""
    with socket.create_connection(("127.0.0.1", node.http_port), timeout=10) as s:
        s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n\r\n")
        data = one_response(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert int(head.split(b" ", 2)[1]) == 400, head
    err = json.loads(body)
    assert err["kind"] == "invalid_argument" and words in err["message"], err
    assert "secret" not in err["message"] and "kkkk" not in err["message"], err

    def logged():
        t = node.read_log()
        return t if "refused a malformed HTTP request" in t else ""
    log = wait_until(logged, 10, what="the node to log the refusal")
    assert words in log and "secret-k" not in log, log[-2000:]


def test_malformed_requests_in_a_loop_write_at_most_a_line_a_minute(seeded):
    """No key is needed to send a request aiohttp cannot parse: each wrote an
    ERROR line (6,000 lines in 5 s in a review). One a minute now, as a warning."""
    node, api, _, _ = seeded
    at = len(node.read_log())
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", node.http_port), timeout=10) as s:
            s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n")
            one_response(s)
    new = node.read_log()[at:]
    assert new.count("refused a malformed HTTP request") <= 1, new[-3000:]
    # ...and one is there: ours, or one within the minute before it (the node is shared)
    assert "refused a malformed HTTP request" in node.read_log()
    assert "ERROR aiohttp" not in new, new[-3000:]
    assert_alive(node, api)


def test_405_has_allow_header(seeded):
    """BUG (RFC 9110 §15.5.6): the JSON 405 drops aiohttp's Allow header."""
    node, api, _, _ = seeded
    r = api.req("PATCH", f"/v1/queues/{FUZZ_QUEUE}")
    assert r.status == 405 and r.json()["kind"] == "method_not_allowed"
    allow = {m.strip() for m in (r.h("Allow") or "").split(",") if m.strip()}
    assert {"GET", "PUT", "DELETE"} <= allow, f"Allow header: {r.h('Allow')!r}"


def _raw(node, request: bytes, close_within_s: float = 5.0):
    """One request on its own connection: (status, lower-case head, body, whether
    the node closed the connection within ``close_within_s`` of its answer).
    ``close_within_s=None``: the caller does not ask (None in its place), and no
    time is spent waiting for a close that a kept-alive connection never brings."""
    with socket.create_connection(("127.0.0.1", node.http_port), timeout=10) as s:
        s.sendall(request)
        data = one_response(s)
        closed = None
        if close_within_s is not None:
            s.settimeout(close_within_s)
            try:
                closed = s.recv(1) == b""
            except ConnectionResetError:
                closed = True
            except socket.timeout:
                closed = False
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head.lower(), body, closed


def _auth() -> bytes:
    return b"Authorization: Bearer " + ADMIN_KEY.encode() + b"\r\n"


def test_an_expectation_other_than_100_continue_is_a_json_400(seeded):
    """``Expect: 100-continue`` works (an interim 100, then the body, then 201);
    any other expectation is refused with the error table's 400 (not aiohttp's
    plain-text 417), with Spooler-Epoch, on a connection that then closes; the
    message it carried is not stored."""
    node, api, _, _ = seeded
    q = "expect-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    with socket.create_connection(("127.0.0.1", node.http_port), timeout=10) as s:
        s.sendall(b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n" + _auth()
                  + b"Content-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += s.recv(1)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        s.sendall(b"hello")
        data = one_response(s)
    assert data.startswith(b"HTTP/1.1 201"), data[:300]
    status, head, body, closed = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                      + _auth() + b"Content-Length: 5\r\nExpect: a-miracle\r\n\r\nworld")
    assert status == 400 and json.loads(body)["kind"] == "invalid_argument", (head, body)
    assert b"application/json" in head and re.search(rb"\r\nspooler-epoch: \d+", head), head
    assert closed, "the connection stayed open after a refused expectation"
    assert api.stats(q)["visible"] == 1
    assert_alive(node, api)


@pytest.mark.parametrize("coding", [b"", b"Content-Encoding: gzip\r\n"], ids=["plain", "gzip"])
def test_a_body_too_large_by_its_content_length_is_refused_before_it_is_read(seeded, coding):
    """limits.md: a send whose Content-Length is over the body limit is a 413 at
    once, judged by its head alone (a compressed one past what could decode to the
    limit): only the head is sent here, so a node that waited to read the body
    would not answer at all (the socket's timeout), and nothing is stored."""
    node, api, _, _ = seeded
    q = "cl-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    status, head, body, _ = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                 + _auth() + coding + b"Content-Length: %d\r\n\r\n" % (4 * 262144), close_within_s=None)
    assert status == 413 and json.loads(body)["kind"] == "message_too_large", (head, body)
    assert api.stats(q)["visible"] == 0
    assert_alive(node, api)


def test_a_body_that_does_not_decode_is_a_400_and_the_connection_closes(seeded):
    """A body declared gzip that is not: 400 invalid_argument, nothing stored, and
    the connection closes right behind the answer (its answer said so; the rest of
    such a body cannot be parsed, so nothing after it on that connection can be)."""
    node, api, _, _ = seeded
    q = "gz-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    internal, log_at = _internal_errors(node), len(node.read_log())
    status, head, body, closed = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                      + _auth() + b"Content-Encoding: gzip\r\nContent-Length: 9\r\n\r\nnotgzip!!")
    assert status == 400 and json.loads(body)["kind"] == "invalid_argument", (head, body)
    assert b"connection: close" in head, head
    assert closed, "the node said close and kept the connection open"
    assert api.stats(q)["visible"] == 0
    assert _internal_errors(node) == internal and "Traceback" not in node.read_log()[log_at:]
    assert_alive(node, api)


def test_a_gzip_body_that_stops_short_is_a_400_and_stores_nothing(seeded):
    """A gzip body cut short (a dropped tail, a proxy's truncation) used to be
    stored as the part that came: aiohttp's decoder never checks that the stream
    ended. Now the node decodes bodies itself: 400, nothing stored; and a body
    that decodes past the limit is a 413 without being decoded whole."""
    import gzip
    node, api, _, _ = seeded
    q = "gzcut-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    whole = gzip.compress(bytes(range(256)) * 40)
    for cut in (whole[:len(whole) // 2], whole[:-8]):
        r = api.req("POST", f"/v1/queues/{q}/messages", cut, {"Content-Encoding": "gzip"})
        assert r.status == 400 and r.json()["kind"] == "invalid_argument", r
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024))
    r = api.req("POST", f"/v1/queues/{q}/messages", bomb, {"Content-Encoding": "gzip"})
    assert r.status == 413 and r.json()["kind"] == "message_too_large", r
    assert api.stats(q)["sentTotal"] == 0
    r = api.req("POST", f"/v1/queues/{q}/messages", whole, {"Content-Encoding": "gzip"})
    assert r.status == 201, r
    assert api.stats(q)["visible"] == 1
    assert_alive(node, api)


@pytest.mark.parametrize("framing", [b"gzip, chunked", b"deflate, chunked", b"x-foo, chunked"])
def test_a_transfer_coding_before_chunked_is_a_400_and_stores_nothing(seeded, framing):
    """aiohttp reads the chunks and ignores a transfer coding listed before them:
    the body was stored still gzipped (201). Only chunked is a transfer coding
    the node takes: 400 invalid_argument, nothing stored, the connection closed."""
    import gzip
    node, api, _, _ = seeded
    q = "te-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    g = gzip.compress(b"the real message")
    status, head, body, closed = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                      + _auth() + b"Transfer-Encoding: " + framing + b"\r\n\r\n"
                                      + b"%x\r\n" % len(g) + g + b"\r\n0\r\n\r\n")
    assert status == 400 and json.loads(body)["kind"] == "invalid_argument", (head, body)
    assert closed
    assert api.stats(q)["sentTotal"] == 0
    status, head, body, _ = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                 + _auth() + b"Transfer-Encoding: Chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", close_within_s=None)
    assert status == 201, (head, body)
    r = api.receive(q)
    assert r.status == 200 and r.body == b"hello", r
    assert_alive(node, api)


def test_a_compressed_message_at_the_limit_is_stored_though_it_grew_when_compressed(seeded):
    """An incompressible message of exactly the limit is a little larger gzipped;
    the limit is on the message, so it is stored (it was a 413)."""
    import gzip
    node, api, _, _ = seeded
    q = "gzlim-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    msg = os.urandom(256 * 1024)
    g = gzip.compress(msg)
    assert len(g) > len(msg)
    r = api.req("POST", f"/v1/queues/{q}/messages", g, {"Content-Encoding": "gzip"})
    assert r.status == 201, r
    r = api.receive(q)
    assert r.status == 200 and r.body == msg, r.status
    r = api.req("POST", f"/v1/queues/{q}/messages", gzip.compress(msg + b"x"), {"Content-Encoding": "gzip"})
    assert r.status == 413 and r.json()["kind"] == "message_too_large", r
    r = api.req("POST", f"/v1/queues/{q}/messages", b"", {"Content-Encoding": "gzip"})
    assert r.status == 400 and r.json()["kind"] == "invalid_argument", r
    assert api.stats(q)["sentTotal"] == 1


def test_a_request_asking_for_an_upgrade_is_answered_and_its_connection_closes(seeded):
    """The node never upgrades (h2c here), and aiohttp drops whatever follows such
    a request on its connection: a send pipelined behind it was neither stored
    nor answered, and the connection stayed open, so its client waited for ever.
    The request is answered as HTTP/1.1, then the connection closes."""
    node, api, _, _ = seeded
    q = "upg-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    one = (b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n" + _auth()
           + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
           + b"Content-Length: 3\r\n\r\none")
    two = b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n" + _auth() + b"Content-Length: 3\r\n\r\ntwo"
    status, head, body, closed = _raw(node, one + two)
    assert status == 201, (head, body)
    assert b"connection: close" in head, head
    assert closed, "the connection stayed open behind a request that asked for an upgrade"
    assert api.stats(q)["sentTotal"] == 1  # the pipelined one was not taken (its client sees the close)
    r = api.receive(q)
    assert r.status == 200 and r.body == b"one", r
    assert_alive(node, api)


@pytest.mark.parametrize("line, status", [(b"GET /nope HTTP/1.1", 404), (b"DELETE /healthz HTTP/1.1", 405),
                                          (b"GET /v1/queues/no-such-queue-here HTTP/1.1", 404)],
                         ids=["no-route", "method", "spooler-error"])
def test_an_upgrade_request_answered_with_an_error_closes_its_connection_too(seeded, line, status):
    """Whatever answers it (aiohttp's routing or the error table), a request that
    asked for an upgrade is answered and its connection closes."""
    node, api, _, _ = seeded
    req = (line + b"\r\nHost: x\r\n" + _auth() + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
           + b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
    got, head, body, closed = _raw(node, req + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got == status and b"connection: close" in head, (head, body)
    assert closed, "the connection stayed open behind a request that asked for an upgrade"
    assert_alive(node, api)


@pytest.mark.parametrize("coding", [b"Content-Encoding: foo", b"Content-Encoding: gzip, gzip",
                                    b"Content-Encoding: gzip\r\nContent-Encoding: gzip"],
                         ids=["unknown", "two-in-one", "given-twice"])
def test_a_content_encoding_the_node_does_not_decode_is_a_400_and_stores_nothing(seeded, coding):
    """A coding the node does not decode would store bytes that are not the message
    meant (aiohttp decodes one gzip or deflate, and leaves anything else as it
    came): 400 invalid_argument, nothing stored, the connection closed; identity
    is no coding at all and is stored as sent."""
    node, api, _, _ = seeded
    q = "coding-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    status, head, body, closed = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                      + _auth() + coding + b"\r\nContent-Length: 4\r\n\r\nbody")
    assert status == 400 and json.loads(body)["kind"] == "invalid_argument", (head, body)
    assert closed, "the node kept a connection whose body it did not read"
    assert api.stats(q)["visible"] == 0
    status, head, body, _ = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                 + _auth() + b"Content-Encoding: identity\r\nContent-Length: 4\r\n\r\nbody", close_within_s=None)
    assert status == 201, (head, body)
    assert_alive(node, api)


@pytest.mark.parametrize("header", [b"Spooler-Dedup-Key: a\r\nSpooler-Dedup-Key: b",
                                    b"Spooler-Delay-Seconds: 0\r\nspooler-delay-seconds: 60",
                                    b"Authorization: Bearer nobody"],
                         ids=["dedup-key", "delay", "authorization"])
def test_a_header_given_twice_is_a_400_and_stores_nothing(seeded, header):
    """Which key, which delay, which caller? A contract header given twice is
    ambiguous: 400 invalid_argument, and no message is stored (aiohttp would
    have taken the first silently)."""
    node, api, _, _ = seeded
    q = "twice-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    status, head, body, _ = _raw(node, b"POST /v1/queues/" + q.encode() + b"/messages HTTP/1.1\r\nHost: x\r\n"
                                 + _auth() + header + b"\r\nContent-Length: 1\r\n\r\nm", close_within_s=None)
    err = json.loads(body)
    assert status == 400 and err["kind"] == "invalid_argument", (head, body)
    assert "given 2 times" in err["message"], err
    assert api.stats(q)["visible"] + api.stats(q)["delayed"] == 0
    assert_alive(node, api)


def test_wait_given_twice_is_a_400_and_leases_nothing(seeded):
    node, api, _, _ = seeded
    q = "wait2-" + uuid.uuid4().hex[:8]
    assert api.put_queue(q, {}).status == 201
    assert api.send(q, b"m").status == 201
    status, head, body, _ = _raw(node, b"POST /v1/queues/" + q.encode() + b"/receive?wait=0&wait=5 HTTP/1.1\r\n"
                                 b"Host: x\r\n" + _auth() + b"Content-Length: 0\r\n\r\n", close_within_s=None)
    assert status == 400 and json.loads(body)["kind"] == "invalid_argument", (head, body)
    assert api.stats(q)["leased"] == 0 and api.stats(q)["visible"] == 1
    assert_alive(node, api)


@pytest.mark.parametrize("method,path,body", [
    ("PUT", "/v1/queues/{q}", b'{"maxRetries": 1, "maxRetries": 9}'),
    ("POST", "/v1/keys", b'{"queue": "{q}", "scopes": ["send"], "queue": "*"}'),
    ("POST", "/v1/cluster/promote", b'{"node": "a", "node": "b"}'),
], ids=["queue-settings", "key", "promote"])
def test_a_json_field_given_twice_is_a_400_and_changes_nothing(seeded, method, path, body):
    """As for a header given twice: which value was meant? Refused, never the last
    one taken silently (Python's json would keep the last)."""
    node, api, _, _ = seeded
    q = "jtwice-" + uuid.uuid4().hex[:8]
    keys = api.req("GET", "/v1/keys").json()
    r = api.req(method, path.replace("{q}", q), body.replace(b"{q}", q.encode()),
                {"Content-Type": "application/json"}, check=False)
    assert r.status == 400 and r.json()["kind"] == "invalid_argument", r
    assert "given 2 times" in r.json()["message"], r.json()
    assert api.req("GET", f"/v1/queues/{q}", check=False).status == 404
    assert api.req("GET", "/v1/keys").json() == keys
    assert_alive(node, api)


def test_error_kinds_table_is_what_we_check():
    assert "internal" not in KINDS


# ------------------------------------------------------------------------ the end

def test_zz_seeded_messages_survived(seeded):
    node, api, seed_queue, ids = seeded
    assert_alive(node, api)
    got = {}
    for _ in range(N_SEED):
        r = api.receive(seed_queue)
        assert r.status == 200, r
        got[r.h("Spooler-Message-Id")] = r.body
    assert got == ids
    assert api.receive(seed_queue).status == 204
    st_ = api.stats(seed_queue)
    assert st_["sentTotal"] == N_SEED and st_["leased"] == N_SEED and st_["expiredTotal"] == 0
