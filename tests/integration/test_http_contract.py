"""The HTTP contract of shared/spec/API.md, row by row, against a real spooler-node.

Every response also passes ``contract_client.check_invariants``: a ``Spooler-Epoch``
header, and for errors a JSON body with a known ``kind``, a ``message`` and the status of
that kind. Most tests share one node (``shared_node``) and use their own queues; the
restart and key tests get a fresh node.
"""
from __future__ import annotations

import json
import re
import threading
import time
import uuid
from datetime import timedelta

import pytest

from contract_client import Api, KINDS, now_utc, parse_rfc3339, q
from nodeproc import reaches, wait_until

pytestmark = pytest.mark.integration

KIB = 1024
LIMIT = 256 * KIB
DEFAULT_SETTINGS = {"leaseTimeoutSeconds": 30, "maxRetries": 5, "retentionSeconds": 345600,
                    "dedupWindowSeconds": 0}
STATS_KEYS = {"visible", "leased", "delayed", "sentTotal", "ackedTotal", "failedTotal", "expiredTotal"}


@pytest.fixture(scope="module")
def api(shared_node) -> Api:
    return Api(shared_node.http_url, shared_node.admin_key)


def new_name(prefix="q") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def queue(api):
    """A fresh queue with default settings on the shared node."""
    name = new_name()
    r = api.put_queue(name, {})
    assert r.status == 201, r
    return name


def make_queue(api, **settings) -> str:
    name = new_name()
    r = api.put_queue(name, settings)
    assert r.status == 201, r
    return name


def received(api, queue, wait=None):
    r = api.receive(queue, wait=wait)
    assert r.status == 200, r
    return r


def poll_receive(api, queue, timeout_s=10.0):
    """Receive until a message comes (long polls of at most 1 s, under a deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = api.receive(queue, wait=1)
        if r.status == 200:
            return r
        assert r.status == 204, r
    raise AssertionError(f"no message on {queue} within {timeout_s}s")


# --------------------------------------------------------------------------- queues

def test_put_creates_201_with_defaults_then_updates_200(api):
    name = new_name()
    r = api.put_queue(name, {})
    assert r.status == 201
    assert r.h("Content-Type").startswith("application/json")
    doc = r.json()
    assert doc["name"] == name
    assert doc["settings"] == {**DEFAULT_SETTINGS, "failureQueue": f"{name}.failed"}
    # whole seconds are JSON integers (a client may decode them into an integer type)
    assert all(type(doc["settings"][k]) is int for k in DEFAULT_SETTINGS), doc["settings"]
    assert STATS_KEYS <= set(doc["stats"])
    assert all(doc["stats"][k] == 0 for k in STATS_KEYS)

    r = api.put_queue(name, {"maxRetries": 3, "leaseTimeoutSeconds": 1.5})
    assert r.status == 200
    s = r.json()["settings"]
    assert s["maxRetries"] == 3 and s["leaseTimeoutSeconds"] == 1.5
    assert s["retentionSeconds"] == 345600 and type(s["retentionSeconds"]) is int and s["failureQueue"] == f"{name}.failed"

    r = api.get_queue(name)
    assert r.status == 200
    assert r.json()["settings"] == s and r.json()["name"] == name


def test_put_with_empty_body_creates_with_defaults(api):
    name = new_name()
    r = api.req("PUT", f"/v1/queues/{name}")
    assert r.status == 201
    assert r.json()["settings"]["maxRetries"] == 5


def test_put_all_settings_round_trip(api):
    name = new_name()
    settings = {"leaseTimeoutSeconds": 12.5, "maxRetries": 0, "retentionSeconds": 3600,
                "dedupWindowSeconds": 60, "failureQueue": f"{name}-dlq"}
    r = api.put_queue(name, settings)
    assert r.status == 201
    assert r.json()["settings"] == {"leaseTimeoutSeconds": 12.5, "maxRetries": 0, "retentionSeconds": 3600.0,
                                    "dedupWindowSeconds": 60.0, "failureQueue": f"{name}-dlq"}


@pytest.mark.parametrize("settings", [
    {"leaseTimeoutSeconds": 43200}, {"leaseTimeoutSeconds": 0.001}, {"maxRetries": 0}, {"maxRetries": 1000},
    {"retentionSeconds": 1209600}, {"dedupWindowSeconds": 0}, {"dedupWindowSeconds": 86400},
    {"failureQueue": "x" * 80},
])
def test_settings_at_the_bounds_accepted(api, settings):
    r = api.put_queue(new_name(), settings)
    assert r.status == 201, r
    (k, v), = settings.items()
    assert r.json()["settings"][k] == v


def test_list_queues(api):
    a, b = make_queue(api), make_queue(api, maxRetries=2)
    r = api.req("GET", "/v1/queues")
    assert r.status == 200
    docs = {d["name"]: d for d in r.json()["queues"]}
    assert {a, b} <= set(docs)
    assert docs[b]["settings"]["maxRetries"] == 2
    assert STATS_KEYS <= set(docs[a]["stats"])


def test_delete_queue_204_then_queue_not_found(api, queue):
    assert api.send(queue, b"m").status == 201
    r = api.req("DELETE", f"/v1/queues/{queue}")
    assert r.status == 204 and r.body == b""
    for r in (api.get_queue(queue), api.req("DELETE", f"/v1/queues/{queue}"), api.send(queue, b"x"),
              api.receive(queue), api.redrive(queue), api.purge(queue)):
        assert r.status == 404, r
        assert r.json()["kind"] == "queue_not_found"
    assert queue not in {d["name"] for d in api.req("GET", "/v1/queues").json()["queues"]}


def test_unknown_queue_404_on_every_queue_route(api):
    name = new_name("missing")
    for r in (api.get_queue(name), api.send(name), api.receive(name), api.redrive(name), api.purge(name),
              api.req("DELETE", f"/v1/queues/{name}")):
        assert r.status == 404 and r.json()["kind"] == "queue_not_found", r


@pytest.mark.parametrize("name", ["x" * 81, "has space", "star*", "é", "a:b", "semi;colon", "q$", "tab\t",
                                  "newline\n", "x.failed\n"])
def test_bad_queue_name_400(api, name):
    r = api.put_queue(name, {})
    assert r.status == 400, r
    assert r.json()["kind"] == "invalid_argument"


@pytest.mark.parametrize("name", ["x" * 81, "x" * 100, "x" * 76 + ".faile", "x" * 81 + ".failed"])
def test_overlong_name_is_400_on_every_route(api, name):
    """Past 80 characters a name is malformed on every route, not just PUT; the one
    exception is a failure queue derived from a legal name (next test)."""
    for r in (api.put_queue(name, {}), api.get_queue(name), api.req("DELETE", f"/v1/queues/{name}"),
              api.req("POST", f"/v1/queues/{name}/receive"), api.req("POST", f"/v1/queues/{name}/redrive"),
              api.req("POST", f"/v1/queues/{name}/messages", body=b"m")):
        assert r.status == 400 and r.json()["kind"] == "invalid_argument", r


def test_failure_queue_of_an_80_char_name_is_reachable(api):
    name = uuid.uuid4().hex * 2 + "x" * 16  # 80 characters
    assert api.put_queue(name, {"maxRetries": 0}).status == 201
    fq = f"{name}.failed"  # 87 characters, derived: readable though PUT could not name it
    assert api.get_queue(fq).status == 404  # well formed; created on demand only
    assert api.req("POST", f"/v1/queues/{name}/messages", body=b"m").status == 201
    tok = api.req("POST", f"/v1/queues/{name}/receive").h("Spooler-Lease-Token")
    assert api.req("POST", f"/v1/leases/{tok}/nack").status == 204  # past maxRetries 0: to the failure queue
    r = api.get_queue(fq)
    assert r.status == 200 and r.json()["stats"]["visible"] == 1, r


def test_name_of_80_chars_and_all_allowed_characters(api):
    for name in ["A" * 80, "a.b_c-D.9", "-", "_", "x.failed"]:
        r = api.put_queue(name, {})
        assert r.status in (200, 201), r
        assert r.json()["name"] == name


@pytest.mark.parametrize("settings", [
    {"leaseTimeoutSeconds": 0}, {"leaseTimeoutSeconds": -1}, {"leaseTimeoutSeconds": 43200.5},
    {"leaseTimeoutSeconds": "30"}, {"leaseTimeoutSeconds": None}, {"leaseTimeoutSeconds": True},
    {"maxRetries": -1}, {"maxRetries": 1001}, {"maxRetries": 1.5}, {"maxRetries": "3"}, {"maxRetries": False},
    {"retentionSeconds": 0}, {"retentionSeconds": 1209601}, {"retentionSeconds": [1]},
    {"dedupWindowSeconds": -0.5}, {"dedupWindowSeconds": 86401},
    {"failureQueue": "bad name"}, {"failureQueue": ""}, {"failureQueue": 7}, {"failureQueue": "y" * 81},
    {"failureQueue": "x\n"},
    {"unknownSetting": 1}, {"lease_timeout_seconds": 3},
])
def test_bad_settings_400_and_nothing_created(api, settings):
    name = new_name()
    r = api.put_queue(name, settings)
    assert r.status == 400, r
    assert r.json()["kind"] == "invalid_argument"
    assert api.get_queue(name).status == 404


@pytest.mark.parametrize("raw", [b"{", b"[1]", b'"x"', b"null", b"3", b"{'a': 1}", b"\xff\xfe"])
def test_non_object_or_invalid_json_settings_400(api, raw):
    name = new_name()
    r = api.put_queue(name, raw)
    assert r.status == 400, r
    assert r.json()["kind"] == "invalid_argument"


def test_bad_setting_on_update_leaves_queue_unchanged(api):
    name = make_queue(api, maxRetries=2)
    r = api.put_queue(name, {"maxRetries": 2000})
    assert r.status == 400 and r.json()["kind"] == "invalid_argument"
    assert api.get_queue(name).json()["settings"]["maxRetries"] == 2


def test_queue_cannot_be_its_own_failure_queue(api):
    name = new_name()
    r = api.put_queue(name, {"failureQueue": name})
    assert r.status == 400 and r.json()["kind"] == "invalid_argument"


# ------------------------------------------------------------------------- messages

def test_send_201_with_id_and_stats(api, queue):
    r = api.send(queue, b"hello")
    assert r.status == 201
    doc = r.json()
    assert doc["duplicate"] is False
    assert isinstance(doc["id"], str) and doc["id"]
    r2 = api.send(queue, b"hello")
    assert r2.status == 201 and r2.json()["id"] != doc["id"]
    st = api.stats(queue)
    assert st["sentTotal"] == 2 and st["visible"] == 2 and st["leased"] == 0 and st["delayed"] == 0


def test_dedup_duplicate_200_first_id_no_second_message(api):
    name = make_queue(api, dedupWindowSeconds=60)
    r1 = api.send(name, b"first", dedup="k-1")
    assert r1.status == 201 and r1.json()["duplicate"] is False
    r2 = api.send(name, b"second", dedup="k-1")
    assert r2.status == 200
    assert r2.json() == {"id": r1.json()["id"], "duplicate": True}
    st = api.stats(name)
    assert st["sentTotal"] == 1 and st["visible"] == 1
    r3 = api.send(name, b"third", dedup="k-2")
    assert r3.status == 201 and r3.json()["id"] != r1.json()["id"]
    got = received(api, name)
    assert got.h("Spooler-Message-Id") == r1.json()["id"] and got.body == b"first"


def test_dedup_key_ignored_without_window(api, queue):
    a = api.send(queue, b"a", dedup="same")
    b = api.send(queue, b"b", dedup="same")
    assert a.status == 201 and b.status == 201 and a.json()["id"] != b.json()["id"]
    assert api.stats(queue)["sentTotal"] == 2


@pytest.mark.parametrize("key", ["", "k" * 129])
def test_bad_dedup_key_400(api, queue, key):
    r = api.send(queue, b"x", dedup=key)
    assert r.status == 400 and r.json()["kind"] == "invalid_argument"
    assert api.stats(queue)["sentTotal"] == 0


def test_delay_header_hides_message_until_due(api, queue):
    t0 = time.monotonic()
    # (3 s: the two checks below must come before it is due, also on a slow machine)
    r = api.send(queue, b"later", delay=3.0)
    assert r.status == 201
    mid = r.json()["id"]
    r = api.receive(queue)
    assert r.status == 204 and r.body == b""
    st = api.stats(queue)
    assert st["delayed"] == 1 and st["visible"] == 0
    got = poll_receive(api, queue, timeout_s=15)
    assert time.monotonic() - t0 >= 2.9
    assert got.h("Spooler-Message-Id") == mid and got.body == b"later"
    assert got.h("Spooler-Retry-Count") == "0"


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "1209601", "1e400", "0x10", "1_0", "+5", "1e1", "5s", "1.2.3",
                                   ""])
def test_bad_delay_header_400(api, queue, value):
    r = api.send(queue, b"x", headers={"Spooler-Delay-Seconds": value})
    assert r.status == 400, r
    assert r.json()["kind"] == "invalid_argument"
    assert api.stats(queue)["sentTotal"] == 0


def test_message_too_large_413_and_exact_limit_accepted(api, queue):
    r = api.send(queue, b"z" * (LIMIT + 1))
    assert r.status == 413 and r.json()["kind"] == "message_too_large"
    exact = bytes(range(256)) * (LIMIT // 256)
    assert len(exact) == LIMIT
    r = api.send(queue, exact)
    assert r.status == 201
    got = received(api, queue)
    assert got.body == exact
    assert api.stats(queue)["sentTotal"] == 1


def test_message_too_large_chunked_413(api, queue):
    def chunks():
        for _ in range(5):
            yield b"c" * (64 * KIB)  # 320 KiB, no Content-Length
    r = api.send(queue, chunks())
    assert r.status == 413 and r.json()["kind"] == "message_too_large"
    assert api.stats(queue)["sentTotal"] == 0


def test_empty_and_binary_bodies_round_trip(api, queue):
    bodies = [b"", b"\x00\xff\xfe\x80 binary \r\n", "ünïcødé".encode()]
    for b in bodies:
        assert api.send(queue, b).status == 201
    for b in bodies:
        got = received(api, queue)
        assert got.body == b
        assert got.h("Content-Type") == "application/octet-stream"


# -------------------------------------------------------------------------- receive

def test_receive_200_headers(api, queue):
    mid = api.send(queue, b"payload").json()["id"]
    before = now_utc()
    r = api.receive(queue)
    assert r.status == 200
    assert r.body == b"payload"
    assert r.h("Spooler-Message-Id") == mid
    assert re.fullmatch(r"[A-Za-z0-9_-]+", r.h("Spooler-Lease-Token"))
    assert r.h("Spooler-Retry-Count") == "0"
    exp = parse_rfc3339(r.h("Spooler-Lease-Expires-At"))
    assert before + timedelta(seconds=25) <= exp <= now_utc() + timedelta(seconds=35)
    # leased: not handed out again
    assert api.receive(queue).status == 204
    st = api.stats(queue)
    assert st["leased"] == 1 and st["visible"] == 0


def test_receive_oldest_first(api, queue):
    ids = [api.send(queue, f"m{i}".encode()).json()["id"] for i in range(3)]
    got = [received(api, queue).h("Spooler-Message-Id") for _ in range(3)]
    assert got == ids


def test_receive_empty_204(api, queue):
    r = api.receive(queue)
    assert r.status == 204 and r.body == b""
    r = api.receive(queue, wait=0)
    assert r.status == 204


def test_long_poll_waits_then_204(api, queue):
    t0 = time.monotonic()
    r = api.receive(queue, wait=0.6)
    assert r.status == 204
    assert 0.5 <= time.monotonic() - t0 < 5


def test_long_poll_returns_early_on_send(api, shared_node, queue):
    out = {}

    def consumer():
        t = time.monotonic()
        out["resp"] = api.receive(queue, wait=15)
        out["elapsed"] = time.monotonic() - t

    before = shared_node.metric("spooler_receives_waiting")
    th = threading.Thread(target=consumer)
    th.start()
    try:
        # the send only once the node holds the receive waiting (else the receive
        # could find the message at once, and no long poll would be woken)
        wait_until(lambda: shared_node.metric("spooler_receives_waiting") > before, 10, what="the receive to wait")
        mid = api.send(queue, b"wake").json()["id"]
    finally:
        th.join(20)
    assert not th.is_alive()
    r = out["resp"]
    assert r.status == 200 and r.h("Spooler-Message-Id") == mid
    assert out["elapsed"] < 5, f"long poll did not return early: {out['elapsed']:.2f}s of 15"


@pytest.mark.parametrize("wait", ["20.5", "21", "-1", "abc", "nan", "inf", "1_0", "1e1", "%D9%A5", "%EF%BC%95", "5%0A"])
def test_bad_wait_400(api, queue, wait):
    r = api.receive(queue, wait=wait)
    assert r.status == 400 and r.json()["kind"] == "invalid_argument"


def test_wait_20_accepted(api, queue):
    api.send(queue, b"x")
    assert api.receive(queue, wait=20).status == 200


# --------------------------------------------------------------------------- leases

def test_ack_204_then_stale_settled(api, queue):
    api.send(queue, b"x")
    tok = received(api, queue).h("Spooler-Lease-Token")
    r = api.ack(tok)
    assert r.status == 204 and r.body == b""
    for r in (api.ack(tok), api.nack(tok), api.renew(tok)):
        assert r.status == 409, r
        assert r.json()["kind"] == "stale_lease" and r.json()["reason"] == "settled"
    st = api.stats(queue)
    assert st["ackedTotal"] == 1 and st["visible"] == 0 and st["leased"] == 0
    assert api.receive(queue).status == 204


def test_a_lease_on_a_deleted_queue_is_queue_not_found_and_stale_once_the_name_is_reused(api, queue):
    """Deleting a queue ends its leases with it: settling one says the queue is gone
    (404, as SQS's NonExistentQueue), not that the lease ran out. A queue created
    again under the name is another queue, holding none of the old messages: there
    the old lease is stale."""
    api.send(queue, b"x")
    tok = received(api, queue).h("Spooler-Lease-Token")
    assert api.req("DELETE", f"/v1/queues/{queue}").status == 204
    for r in (api.ack(tok), api.nack(tok), api.renew(tok)):
        assert r.status == 404, r
        assert r.json()["kind"] == "queue_not_found"
    assert api.put_queue(queue, {}).status == 201
    for r in (api.ack(tok), api.nack(tok), api.renew(tok)):
        assert r.status == 409, r
        assert r.json()["kind"] == "stale_lease" and r.json()["reason"] == "settled"
    st = api.stats(queue)
    assert st["visible"] == 0 and st["leased"] == 0 and st["ackedTotal"] == 0


def test_nack_redelivers_with_retry_plus_one(api, queue):
    mid = api.send(queue, b"again").json()["id"]
    r = received(api, queue)
    assert api.nack(r.h("Spooler-Lease-Token")).status == 204
    r = received(api, queue)
    assert r.h("Spooler-Message-Id") == mid and r.h("Spooler-Retry-Count") == "1" and r.body == b"again"
    assert api.nack(r.h("Spooler-Lease-Token")).status == 204
    r = received(api, queue)
    assert r.h("Spooler-Retry-Count") == "2"
    old = r.h("Spooler-Lease-Token")
    assert api.ack(old).status == 204


def test_nack_with_delay(api, queue):
    mid = api.send(queue, b"x").json()["id"]
    tok = received(api, queue).h("Spooler-Lease-Token")
    t0 = time.monotonic()
    r = api.nack(tok, delay=3.0)  # (as above: due after the checks below)
    assert r.status == 204
    assert api.receive(queue).status == 204
    st = api.stats(queue)
    assert st["delayed"] == 1 and st["leased"] == 0
    got = poll_receive(api, queue, timeout_s=15)
    assert time.monotonic() - t0 >= 2.9
    assert got.h("Spooler-Message-Id") == mid and got.h("Spooler-Retry-Count") == "1"


def test_nack_bad_delay_400(api, queue):
    api.send(queue, b"x")
    tok = received(api, queue).h("Spooler-Lease-Token")
    r = api.nack(tok, delay="-5")
    assert r.status == 400 and r.json()["kind"] == "invalid_argument"
    # the lease is still live: the failed nack did not settle it
    assert api.ack(tok).status == 204


def test_renew_moves_expiry_forward_with_current_timeout(api):
    name = make_queue(api, leaseTimeoutSeconds=30)
    api.send(name, b"x")
    r = received(api, name)
    tok = r.h("Spooler-Lease-Token")
    exp0 = parse_rfc3339(r.h("Spooler-Lease-Expires-At"))

    r = api.renew(tok)
    assert r.status == 200 and r.h("Content-Type").startswith("application/json")
    exp1 = parse_rfc3339(r.json()["expiresAt"])
    assert exp1 > exp0
    assert abs((exp1 - now_utc()).total_seconds() - 30) < 5

    assert api.put_queue(name, {"leaseTimeoutSeconds": 600}).status == 200
    exp2 = parse_rfc3339(api.renew(tok).json()["expiresAt"])
    assert abs((exp2 - now_utc()).total_seconds() - 600) < 5

    assert api.put_queue(name, {"leaseTimeoutSeconds": 5}).status == 200
    exp3 = parse_rfc3339(api.renew(tok).json()["expiresAt"])
    assert abs((exp3 - now_utc()).total_seconds() - 5) < 3
    assert api.ack(tok).status == 204


def test_renew_keeps_a_short_lease_alive(api):
    name = make_queue(api, leaseTimeoutSeconds=2.0)
    api.send(name, b"x")
    tok = received(api, name).h("Spooler-Lease-Token")
    deadline = time.monotonic() + 4.5  # well past the 2 s lease; renewed every ~0.15 s
    while time.monotonic() < deadline:
        r = api.renew(tok)
        assert r.status == 200, r
        assert api.receive(name, wait=0.15).status == 204
    assert api.ack(tok).status == 204
    assert api.stats(name)["leaseExpiredTotal"] == 0


def test_lease_expiry_redelivers_with_retry_plus_one(api):
    name = make_queue(api, leaseTimeoutSeconds=0.3)
    mid = api.send(name, b"x").json()["id"]
    t0 = time.monotonic()
    r = received(api, name)
    old = r.h("Spooler-Lease-Token")
    got = poll_receive(api, name, timeout_s=10)
    assert time.monotonic() - t0 >= 0.25
    assert got.h("Spooler-Message-Id") == mid and got.h("Spooler-Retry-Count") == "1"
    r = api.ack(old)
    assert r.status == 409 and r.json()["kind"] == "stale_lease" and r.json()["reason"] == "expired"
    assert api.stats(name)["leaseExpiredTotal"] >= 1


def test_max_retries_to_failure_queue_and_redrive(api):
    name = make_queue(api, maxRetries=1)
    mid = api.send(name, b"poison").json()["id"]
    r = received(api, name)
    assert r.h("Spooler-Retry-Count") == "0"
    assert api.nack(r.h("Spooler-Lease-Token")).status == 204
    r = received(api, name)
    assert r.h("Spooler-Retry-Count") == "1"
    assert api.nack(r.h("Spooler-Lease-Token")).status == 204  # would be retry 2 > maxRetries
    assert api.receive(name).status == 204
    st = api.stats(name)
    assert st["failedTotal"] == 1 and st["visible"] == 0 and st["leased"] == 0
    fq = api.get_queue(f"{name}.failed")
    assert fq.status == 200 and fq.json()["stats"]["visible"] == 1
    assert fq.json()["settings"]["maxRetries"] == 5  # created on demand with defaults

    r = api.redrive(name)
    assert r.status == 200 and r.json() == {"moved": 1}
    assert api.stats(f"{name}.failed")["visible"] == 0
    r = received(api, name)
    assert r.h("Spooler-Message-Id") == mid and r.h("Spooler-Retry-Count") == "0" and r.body == b"poison"
    assert api.redrive(name).json() == {"moved": 0}


def test_purge_drops_every_message_and_ends_their_leases(api):
    """POST /v1/queues/{queue}/purge (an extension, as SQS's PurgeQueue): 200
    {"purged": n}, every message gone, visible, delayed and leased alike; a
    lease on a purged message is 409 stale_lease, reason settled; the queue,
    its settings and its totals stay (purgedTotal), and it takes sends again.
    A key without admin on the queue is 403."""
    name = make_queue(api, maxRetries=2)
    for body in (b"a", b"b", b"c"):
        assert api.send(name, body).status == 201
    assert api.send(name, b"later", delay=60).status == 201
    token = received(api, name).h("Spooler-Lease-Token")
    sender = api.create_key(queue=name, scopes=("send", "receive")).json()["key"]
    r = api.with_key(sender).purge(name)
    assert r.status == 403 and r.json()["kind"] == "forbidden", r
    r = api.purge(name)
    assert r.status == 200 and r.json() == {"purged": 4}, r
    st = api.stats(name)
    assert (st["visible"], st["delayed"], st["leased"], st["sentTotal"], st["purgedTotal"]) == (0, 0, 0, 4, 4)
    r = api.ack(token)
    assert r.status == 409 and r.json()["kind"] == "stale_lease" and r.json()["reason"] == "settled", r
    assert api.get_queue(name).json()["settings"]["maxRetries"] == 2
    assert api.receive(name).status == 204
    assert api.send(name, b"after").status == 201
    assert received(api, name).body == b"after"
    assert api.purge(name).json() == {"purged": 1}  # ("after", leased)


def test_lease_expiry_past_max_retries_goes_to_failure_queue(api):
    name = make_queue(api, maxRetries=0, leaseTimeoutSeconds=0.3)
    mid = api.send(name, b"x").json()["id"]
    assert received(api, name).h("Spooler-Message-Id") == mid
    wait_until(lambda: api.stats(name)["failedTotal"] == 1, 10, what="expiry into the failure queue")
    got = received(api, f"{name}.failed")
    assert got.h("Spooler-Message-Id") == mid and got.h("Spooler-Retry-Count") == "0"


def test_lowering_max_retries_is_obeyed_at_the_next_receive(api):
    """maxRetries bounds deliveries by its current value: a message nacked 3 times
    under maxRetries 5 is not delivered again once maxRetries is 1; it moves to the
    failure queue, its retry count there 0."""
    name = make_queue(api, maxRetries=5)
    mid = api.send(name, b"x").json()["id"]
    for _ in range(3):
        assert api.nack(received(api, name).h("Spooler-Lease-Token")).status == 204
    assert api.put_queue(name, {"maxRetries": 1}).status == 200
    assert api.receive(name).status == 204
    wait_until(lambda: api.stats(name)["failedTotal"] == 1, 10, what="the move to the failure queue")
    st = api.stats(name)
    assert (st["visible"], st["leased"]) == (0, 0)
    got = received(api, f"{name}.failed")
    assert got.h("Spooler-Message-Id") == mid and got.h("Spooler-Retry-Count") == "0"


def test_custom_failure_queue(api):
    dlq = new_name("dlq")
    name = make_queue(api, maxRetries=0, failureQueue=dlq)
    assert api.get_queue(dlq).status == 404  # created on demand only
    mid = api.send(name, b"x").json()["id"]
    assert api.nack(received(api, name).h("Spooler-Lease-Token")).status == 204
    assert api.stats(name)["failedTotal"] == 1
    d = api.get_queue(dlq)
    assert d.status == 200 and d.json()["stats"]["visible"] == 1
    assert api.get_queue(f"{name}.failed").status == 404
    assert api.redrive(name).json() == {"moved": 1}
    assert received(api, name).h("Spooler-Message-Id") == mid


def test_retention_drops_message_and_counts(api):
    name = make_queue(api, retentionSeconds=0.5)
    api.send(name, b"old")
    wait_until(lambda: api.stats(name)["expiredTotal"] == 1, 10, what="retention drop")
    st = api.stats(name)
    assert st["visible"] == 0 and st["delayed"] == 0 and st["sentTotal"] == 1
    assert api.receive(name).status == 204


def test_delay_does_not_eat_retention(api):
    # delay 1.5 s > retention 1 s: were retention counted from the send, the message
    # would expire before it ever became visible.
    name = make_queue(api, retentionSeconds=1.0)
    mid = api.send(name, b"x", delay=1.5).json()["id"]
    got = poll_receive(api, name, timeout_s=8)
    assert got.h("Spooler-Message-Id") == mid
    assert api.stats(name)["expiredTotal"] == 0


# ------------------------------------------------------------- primary change (restart)

def test_restart_is_a_primary_change(node):
    api = Api(node.http_url, node.admin_key)
    assert api.put_queue("rq", {}).status == 201
    m1 = api.send("rq", b"one").json()["id"]
    m2 = api.send("rq", b"two").json()["id"]
    r = received(api, "rq")
    assert r.h("Spooler-Message-Id") == m1
    assert api.nack(r.h("Spooler-Lease-Token")).status == 204
    # lease both (m1 now carries retry 1), then change the primary under those leases
    held = {}
    for _ in range(2):
        r = received(api, "rq")
        held[r.h("Spooler-Message-Id")] = r
    assert held[m1].h("Spooler-Retry-Count") == "1" and held[m2].h("Spooler-Retry-Count") == "0"
    epoch0 = held[m1].epoch

    node.restart()
    api = Api(node.http_url, node.admin_key)
    h = api.req("GET", "/healthz", key=None)
    assert h.status == 200 and h.epoch > epoch0

    for mid, r in held.items():
        s = api.ack(r.h("Spooler-Lease-Token"))
        assert s.status == 409, s
        assert s.json()["kind"] == "stale_lease" and s.json()["reason"] == "primary_changed"
        assert s.epoch > epoch0
    again = {}
    for _ in range(2):
        r = api.receive("rq")  # visible at once: no wait
        assert r.status == 200, r
        again[r.h("Spooler-Message-Id")] = r
    assert set(again) == {m1, m2}
    assert again[m1].h("Spooler-Retry-Count") == "1"  # unchanged by the primary change
    assert again[m2].h("Spooler-Retry-Count") == "0"
    assert again[m1].body == b"one" and again[m2].body == b"two"
    cl = api.req("GET", "/v1/cluster").json()
    assert cl["epoch"] == h.epoch
    assert api.ack(again[m1].h("Spooler-Lease-Token")).status == 204


def test_acked_message_stays_acked_after_restart(node):
    api = Api(node.http_url, node.admin_key)
    api.put_queue("dq", {})
    api.send("dq", b"a")
    assert api.ack(received(api, "dq").h("Spooler-Lease-Token")).status == 204
    node.restart()
    api = Api(node.http_url, node.admin_key)
    assert api.receive("dq").status == 204
    assert api.stats("dq")["ackedTotal"] == 1


def test_a_dedup_key_outlives_a_restart(node):
    """The dedup entry is part of the stored state: after a graceful stop (whose
    final checkpoint covers the first send, so its log record is not replayed) a
    resend with the same key still answers the first id (S6)."""
    api = Api(node.http_url, node.admin_key)
    api.put_queue("dd", {"dedupWindowSeconds": 600})
    first = api.send("dd", b"one", dedup="order-17").json()["id"]
    node.stop()
    node.start()
    api = Api(node.http_url, node.admin_key)
    r = api.send("dd", b"one again", dedup="order-17")
    assert r.status == 200 and r.json() == {"id": first, "duplicate": True}, r
    assert api.stats("dd")["visible"] == 1


# ----------------------------------------------------------------------------- auth

AUTH_ROUTES = [
    ("GET", "/v1/queues"), ("PUT", "/v1/queues/authq"), ("GET", "/v1/queues/authq"),
    ("DELETE", "/v1/queues/authq"), ("POST", "/v1/queues/authq/redrive"),
    ("POST", "/v1/queues/authq/messages"), ("POST", "/v1/queues/authq/receive"),
    ("POST", "/v1/leases/" + "A" * 40 + "/ack"), ("POST", "/v1/leases/" + "A" * 40 + "/nack"),
    ("POST", "/v1/leases/" + "A" * 40 + "/renew"), ("POST", "/v1/keys"), ("GET", "/v1/keys"),
    ("DELETE", "/v1/keys/0123456789ab"), ("GET", "/v1/cluster"), ("POST", "/v1/cluster/promote"),
]


@pytest.mark.parametrize("method,path", AUTH_ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer nope-not-a-key", "Basic dGVzdDp0ZXN0", "Bearer",
                                  "Bearer spk_0123456789ab_secret"])
def test_401_without_or_with_unknown_key(api, method, path, auth):
    headers = {} if auth is None else {"Authorization": auth}
    r = api.req(method, path, b"{}", headers, key=None)
    assert r.status == 401, r
    assert r.json()["kind"] == "unauthenticated"


def test_ops_routes_need_no_key(api):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert api.req("GET", path, key=None).status == 200


def test_scoped_keys(node):
    admin = Api(node.http_url, node.admin_key)
    qa, qb = "qa", "qb"
    assert admin.put_queue(qa, {}).status == 201 and admin.put_queue(qb, {}).status == 201

    r = admin.create_key(qa, ["send"])
    assert r.status == 201
    doc = r.json()
    assert set(doc) >= {"id", "key", "queue", "scopes"}
    assert re.fullmatch(r"[a-f0-9]{12}", doc["id"]) and doc["queue"] == qa and doc["scopes"] == ["send"]
    sender = admin.with_key(doc["key"])

    assert sender.send(qa, b"from sender").status == 201
    for r in (sender.receive(qa), sender.send(qb, b"x"), sender.receive(qb), sender.put_queue(qa, {}),
              sender.req("DELETE", f"/v1/queues/{qa}"), sender.redrive(qa), sender.req("GET", "/v1/keys"),
              sender.create_key("*", ["admin"]), sender.get_queue(qb),
              sender.req("POST", "/v1/cluster/promote", b'{"node": "n1"}')):
        assert r.status == 403, r
        assert r.json()["kind"] == "forbidden"
    assert sender.get_queue(qa).status == 200
    assert [d["name"] for d in sender.req("GET", "/v1/queues").json()["queues"]] == [qa]

    rdoc = admin.create_key(qa, ["receive"]).json()
    receiver = admin.with_key(rdoc["key"])
    got = receiver.receive(qa)
    assert got.status == 200 and got.body == b"from sender"
    assert receiver.ack(got.h("Spooler-Lease-Token")).status == 204
    assert receiver.receive(qb).status == 403
    # a lease on queue B cannot be settled with a key of queue A
    admin.send(qb, b"b")
    tb = received(admin, qb).h("Spooler-Lease-Token")
    for r in (receiver.ack(tb), receiver.nack(tb), receiver.renew(tb), sender.ack(tb)):
        assert r.status == 403 and r.json()["kind"] == "forbidden", r
    assert admin.ack(tb).status == 204

    keys = admin.req("GET", "/v1/keys").json()["keys"]
    assert {k["id"] for k in keys} == {doc["id"], rdoc["id"]}
    assert all("key" not in k for k in keys)  # the secret is never listed
    assert admin.req("DELETE", f"/v1/keys/{doc['id']}").status == 204
    r = sender.send(qa, b"x")
    assert r.status == 401 and r.json()["kind"] == "unauthenticated"
    r = admin.req("DELETE", f"/v1/keys/{doc['id']}")
    assert r.status == 404 and r.json()["kind"] == "not_found"


def test_global_admin_key_from_keys_api(node):
    admin = Api(node.http_url, node.admin_key)
    k = admin.create_key("*", ["admin"]).json()
    g = admin.with_key(k["key"])
    assert g.put_queue("gq", {}).status == 201
    assert g.req("GET", "/v1/keys").status == 200
    r = g.req("POST", "/v1/cluster/promote", b'{"node": "n1"}')
    assert r.status == 200 and r.json()["nodeId"] == "n1"


@pytest.mark.parametrize("body", [
    {"queue": "qa", "scopes": []}, {"queue": "qa"}, {"queue": "qa", "scopes": ["root"]},
    {"queue": "bad name", "scopes": ["send"]}, {"queue": "qa", "scopes": "send"}, [1],
    {"queue": "qa\n", "scopes": ["send"]},
])
def test_create_key_bad_input_400(api, body):
    r = api.req("POST", "/v1/keys", json.dumps(body).encode())
    assert r.status == 400 and r.json()["kind"] == "invalid_argument", r


@pytest.mark.parametrize("queue_value", [[], False, 0, {}, None])
def test_create_key_non_string_queue_is_rejected(api, queue_value):
    """BUG: a non-string ``queue`` (null, [], false, 0, {}) is read as "*" and mints a key for every queue."""
    r = api.req("POST", "/v1/keys", json.dumps({"queue": queue_value, "scopes": ["send"]}).encode())
    assert r.status == 400, f"expected invalid_argument, got {r.status} {r.body!r}"
    assert r.json()["kind"] == "invalid_argument"


def test_tampered_token_cannot_cross_queues(node):
    """BUG: the queue inside a lease token is authorized but never checked against the
    lease, so a key scoped to queue B can settle a lease of queue A by rewriting the
    queue part of A's token."""
    import base64
    admin = Api(node.http_url, node.admin_key)
    admin.put_queue("victim", {})
    admin.put_queue("mine", {})
    admin.send("victim", b"secret work")
    tok = received(admin, "victim").h("Spooler-Lease-Token")
    raw = base64.urlsafe_b64decode(tok + "=" * (-len(tok) % 4))
    forged = base64.urlsafe_b64encode(raw[:25] + b"mine").rstrip(b"=").decode()
    mine = admin.with_key(admin.create_key("mine", ["receive"]).json()["key"])
    r = mine.ack(forged)
    assert r.status in (400, 403, 409), f"a key of queue 'mine' acked a lease of 'victim': {r!r}"
    assert admin.ack(tok).status == 204


# ----------------------------------------------------------------------- tokens

@pytest.mark.parametrize("token", ["abc", "A" * 30, "A" * 401, "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
                                   "AQAAAAAAAAABAAAAAAAAAAHQMgCfbuIy-nEx" + "%C3%A9", "_" * 60])
@pytest.mark.parametrize("action", ["ack", "nack", "renew"])
def test_malformed_token_400(api, token, action):
    r = api.req("POST", f"/v1/leases/{token}/{action}")
    assert r.status == 400, r
    assert r.json()["kind"] == "invalid_argument"


def test_token_with_wrong_nonce_or_future_epoch_400(api, queue):
    import base64
    import struct
    api.send(queue, b"x")
    tok = received(api, queue).h("Spooler-Lease-Token")
    raw = bytearray(base64.urlsafe_b64decode(tok + "=" * (-len(tok) % 4)))
    bad_nonce = bytes(raw[:17]) + bytes(8) + bytes(raw[25:])
    future = bytes(raw[:1]) + struct.pack(">Q", 10 ** 6) + bytes(raw[9:])
    for forged in (bad_nonce, future):
        t = base64.urlsafe_b64encode(forged).rstrip(b"=").decode()
        r = api.ack(t)
        assert r.status == 400 and r.json()["kind"] == "invalid_argument", r
    assert api.ack(tok).status == 204  # the real lease is untouched


# ------------------------------------------------------------- epoch header, ops, cluster

def test_epoch_header_on_every_response(api, shared_node, queue):
    api.send(queue, b"x")
    rs = [api.req("GET", "/healthz", key=None), api.req("GET", "/readyz", key=None),
          api.req("GET", "/metrics", key=None), api.req("GET", "/nope"), api.req("PATCH", "/v1/queues"),
          api.req("GET", "/v1/queues", key=None), api.receive(queue), api.receive(queue),
          api.req("GET", "/v1/cluster"), api.put_queue("bad name", {})]
    statuses = [r.status for r in rs]
    assert statuses == [200, 200, 200, 404, 405, 401, 200, 204, 200, 400]
    epochs = {r.epoch for r in rs}
    assert len(epochs) == 1
    assert epochs == {api.req("GET", "/v1/cluster").json()["epoch"]}
    assert rs[3].json()["kind"] == "not_found" and rs[4].json()["kind"] == "method_not_allowed"


def test_healthz_readyz_metrics(api, queue):
    r = api.req("GET", "/healthz", key=None)
    assert r.status == 200 and r.json()["status"] == "ok"
    r = api.req("GET", "/readyz", key=None)
    assert r.status == 200 and r.json()["status"] == "ready"

    def total(name):
        m = api.req("GET", "/metrics", key=None)
        assert m.status == 200 and m.h("Content-Type").startswith("text/plain")
        found = re.search(rb"^spooler_" + name.encode() + rb"_total ([0-9.e+]+)$", m.body, re.M)
        assert found, m.body[:2000]
        return float(found.group(1))

    # the process's own: descriptors held against the limit (the connection bounds are sized to it)
    m = api.req("GET", "/metrics", key=None).body
    fds = {k.decode(): float(v) for k, v in re.findall(rb"^process_(open_fds|max_fds) ([0-9.e+]+)$", m, re.M)}
    assert set(fds) == {"open_fds", "max_fds"} and 0 < fds["open_fds"] < fds["max_fds"], fds
    n0, r0, a0 = total("sends"), total("receives"), total("acks")
    api.send(queue, b"x")
    api.send(queue, b"y")
    assert total("sends") == n0 + 2
    tok = received(api, queue).h("Spooler-Lease-Token")
    assert total("receives") == r0 + 1  # leases are not log records: counted where they are made
    assert api.ack(tok).status == 204
    assert total("acks") == a0 + 1
    # a nack and a lease expiry (the server's nack) each count in their own counter
    k0, e0 = total("nacks"), total("lease_expiries")
    tok = received(api, queue).h("Spooler-Lease-Token")
    assert api.nack(tok).status == 204
    assert (total("nacks"), total("acks")) == (k0 + 1, a0 + 1)
    short = make_queue(api, leaseTimeoutSeconds=0.2)
    api.send(short, b"z")
    received(api, short)
    # (>=: a lease left over from an earlier test on this shared node may expire meanwhile)
    wait_until(lambda: total("lease_expiries") >= e0 + 1, 10, what="the expiry counted")
    assert total("nacks") == k0 + 1


def test_cluster_shape(api, shared_node):
    r = api.req("GET", "/v1/cluster")
    assert r.status == 200
    c = r.json()
    assert c["nodeId"] == "n1" and c["role"] == "primary" and c["primary"] == "n1"
    assert isinstance(c["epoch"], int) and c["epoch"] == r.epoch >= 1
    assert len(c["nodes"]) == 1
    n = c["nodes"][0]
    assert n["id"] == "n1" and n["role"] == "primary" and n["address"] == shared_node.grpc_target


def test_promote_self_admin_ok_others_not(api):
    r = api.req("POST", "/v1/cluster/promote", json.dumps({"node": "n1"}).encode())
    assert r.status == 200
    assert r.json()["nodeId"] == "n1" and r.json()["primary"] == "n1"
    for body in (b'{"node": "n9"}', b"{}", b'{"node": 5}', b"[]", b"{", b'{"node": "n1", "extra": 1}'):
        r = api.req("POST", "/v1/cluster/promote", body)
        assert r.status == 400 and r.json()["kind"] == "invalid_argument", (body, r)
    k = api.create_key("*", ["send", "receive"]).json()["key"]
    r = api.with_key(k).req("POST", "/v1/cluster/promote", b'{"node": "n1"}')
    assert r.status == 403 and r.json()["kind"] == "forbidden"
    k = api.create_key("some-queue", ["admin"]).json()["key"]
    r = api.with_key(k).req("POST", "/v1/cluster/promote", b'{"node": "n1"}')
    assert r.status == 403 and r.json()["kind"] == "forbidden"


def test_unknown_route_and_method(api, shared_node):
    def errors_of(kind):
        try:
            return shared_node.metric(f'spooler_errors_total{{kind="{kind}",reason=""}}')
        except KeyError:
            return 0.0
    before = errors_of("not_found"), errors_of("method_not_allowed")
    r = api.req("GET", "/v2/anything")
    assert r.status == 404 and r.json()["kind"] == "not_found"
    r = api.req("POST", "/v1/queues/x")
    assert r.status == 405 and r.json()["kind"] == "method_not_allowed"
    assert set(KINDS) >= {r.json()["kind"]}
    # counted in /metrics like every other error answered
    reaches(lambda: (errors_of("not_found"), errors_of("method_not_allowed")), (before[0] + 1, before[1] + 1),
            what="spooler_errors_total to count the 404 and the 405")


# ------------------------------------------------- found by an outside audit (2026-11-30)

def test_a_body_that_does_not_decode_as_declared_is_400_and_a_good_one_is_stored_decoded(api, queue):
    import gzip
    for path, method in ((f"/v1/queues/{queue}/messages", "POST"), (f"/v1/queues/{queue}", "PUT")):
        r = api.req(method, path, b"abc", {"Content-Encoding": "gzip"})
        assert r.status == 400 and r.json()["kind"] == "invalid_argument", (path, r)
    r = api.req("POST", f"/v1/queues/{queue}/messages", gzip.compress(b"hello"), {"Content-Encoding": "gzip"})
    assert r.status == 201, r
    got = received(api, queue)
    assert got.body == b"hello" and got.h("Spooler-Message-Id") == r.json()["id"]
    assert api.stats(queue)["sentTotal"] == 1  # the bad ones stored nothing


@pytest.mark.parametrize("junk", ["!!!!", "%25%25%25%25", "****", "%20%20%20%20", "====", ".~.~", "!"])
def test_a_token_with_characters_outside_its_alphabet_is_400(api, queue, junk):
    """base64 decoding skips characters it does not know (four of them leave the
    padding right, whatever the token's length): the token's alphabet is checked first."""
    api.send(queue, b"x")
    tok = received(api, queue).h("Spooler-Lease-Token")
    for action in ("renew", "ack", "nack"):
        r = api.req("POST", f"/v1/leases/{q(tok[:20])}{junk}{q(tok[20:])}/{action}")
        assert r.status == 400 and r.json()["kind"] == "invalid_argument", (action, r)
    assert api.renew(tok).status == 200 and api.ack(tok).status == 204  # the lease itself is untouched


def test_deleting_a_queue_ends_its_long_polls_at_once(api, shared_node, queue):
    out = {}

    def consumer():
        t = time.monotonic()
        out["resp"] = api.receive(queue, wait=20)
        out["elapsed"] = time.monotonic() - t

    def waiting() -> float:
        return shared_node.metric("spooler_receives_waiting")

    before = waiting()
    th = threading.Thread(target=consumer)
    th.start()
    try:
        wait_until(lambda: waiting() > before, 10, what="the receive to wait")
        t = time.monotonic()
        assert api.req("DELETE", f"/v1/queues/{queue}").status == 204
    finally:
        th.join(25)
    assert not th.is_alive()
    r = out["resp"]
    assert r.status == 404 and r.json()["kind"] == "queue_not_found", r
    assert time.monotonic() - t < 10, "the long poll ran on to its deadline after its queue was deleted"


def test_a_long_poll_whose_client_hung_up_stops_waiting(api, shared_node, queue):
    """A client that closes its connection while its receive waits cancels the
    receive, as over gRPC: waiting polls are bounded by open connections, not by
    the rate of abandoned ones times 20 s. A message sent afterwards goes to a
    consumer still there, not to one of the abandoned polls."""
    import socket
    from urllib.parse import urlsplit
    u = urlsplit(shared_node.http_url)

    def waiting() -> float:
        return shared_node.metric("spooler_receives_waiting")

    before = waiting()
    socks = []
    try:
        for _ in range(50):
            s = socket.create_connection((u.hostname, u.port), timeout=10)
            s.sendall((f"POST /v1/queues/{queue}/receive?wait=20 HTTP/1.1\r\nHost: x\r\n"
                       f"Authorization: Bearer {shared_node.admin_key}\r\nContent-Length: 0\r\n\r\n").encode())
            socks.append(s)
        wait_until(lambda: waiting() >= before + 50, 10, what="the 50 polls to wait")
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: waiting() <= before, 10, what="the abandoned polls to stop waiting")
    assert api.send(queue, b"after").status == 201
    r = api.receive(queue, wait=5)
    assert r.status == 200 and r.body == b"after", r


def test_settings_a_window_never_rounds_to_off_and_an_integral_float_is_an_integer(api):
    r = api.put_queue(new_name(), {"dedupWindowSeconds": 4e-7, "maxRetries": 2.0})
    assert r.status == 201, r
    s = r.json()["settings"]
    assert s["dedupWindowSeconds"] > 0 and s["maxRetries"] == 2, s
    assert api.put_queue(new_name(), {"maxRetries": 2.5}).status == 400


def test_head_on_the_probes_and_every_get(api):
    """HEAD wherever GET is (RFC 9110): the GET's status and headers, no body.
    Before 0.4.37 the API's GET routes answered HEAD with 405."""
    for path in ("/healthz", "/readyz", "/metrics"):
        r = api.req("HEAD", path, key=None, check=False)
        assert r.status == 200 and r.h("Spooler-Epoch") is not None and r.body == b"", (path, r)
    name = make_queue(api)
    for path in (f"/v1/queues/{name}", "/v1/queues", "/v1/keys", "/v1/cluster"):
        r = api.req("HEAD", path, check=False)
        assert r.status == 200 and r.h("Spooler-Epoch") is not None and r.body == b"", (path, r)
        assert (r.h("Content-Type") or "").startswith("application/json"), (path, r)
        r = api.req("HEAD", path, key=None, check=False)
        assert r.status == 401 and r.body == b"", (path, r)
    r = api.req("HEAD", "/v1/queues/no-such-queue", check=False)
    assert r.status == 404 and r.body == b"", r


def test_create_key_refuses_unknown_fields(api):
    r = api.req("POST", "/v1/keys", json.dumps({"queue": "qa", "scopes": ["send"], "scope": "admin"}).encode())
    assert r.status == 400 and r.json()["kind"] == "invalid_argument", r


def test_a_small_body_limit_bounds_messages_not_the_json_of_other_routes(tmp_path):
    """--max-body-bytes is the message limit; it was also aiohttp's limit on every
    request body, so a queue's settings document could be refused as too large."""
    import gzip

    from nodeproc import NodeProc
    n = NodeProc(str(tmp_path / "small"), extra_args=["--max-body-bytes", "100"]).start()
    try:
        api = Api(n.http_url, n.admin_key)
        settings = json.dumps({"maxRetries": 3, "failureQueue": "small.dlq"}).encode() + b" " * 4000
        r = api.req("PUT", "/v1/queues/small", settings, {"Content-Type": "application/json"})
        assert r.status == 201, r
        assert api.send("small", b"x" * 100).status == 201
        for body, headers in ((b"x" * 101, {}), (gzip.compress(b"x" * 101), {"Content-Encoding": "gzip"})):
            r = api.req("POST", "/v1/queues/small/messages", body, headers)
            assert r.status == 413 and r.json()["kind"] == "message_too_large", r
        # a body without a length (chunked) is checked once read
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", n.http_port, timeout=10)
        c.request("POST", "/v1/queues/small/messages", body=iter([b"x" * 60, b"y" * 60]),
                  headers={"Authorization": f"Bearer {n.admin_key}"}, encode_chunked=True)
        resp = c.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["kind"] == "message_too_large"
        c.close()
        assert api.stats("small")["sentTotal"] == 1
    finally:
        n.kill()


def test_max_messages_bounds_every_queue_together_over_http_and_grpc(tmp_path):
    """--max-messages: past it a send is 503 unavailable with Retry-After and the
    reason node_full, over HTTP and through the SDK's gRPC; what is stored stays."""
    from nodeproc import NodeProc
    from spooler import errors
    from spooler.client import Client

    n = NodeProc(str(tmp_path / "capped"), extra_args=["--max-messages", "3"]).start()
    try:
        api = Api(n.http_url, n.admin_key)
        for name in ("one", "two"):
            assert api.put_queue(name, {}).status == 201
        assert [api.send("one", b"x").status for _ in range(2)] == [201, 201]
        assert api.send("two", b"y").status == 201
        r = api.send("two", b"z")
        assert r.status == 503 and r.json()["kind"] == "unavailable" and r.json()["reason"] == "node_full", r
        assert int(r.h("Retry-After")) >= 1
        with Client(n.grpc_target, key=n.admin_key, retry_attempts=1) as c:
            with pytest.raises(errors.Unavailable) as e:
                c.send("one", b"w")
            assert e.value.reason == errors.NODE_FULL
        assert (api.stats("one")["sentTotal"], api.stats("two")["sentTotal"]) == (2, 1)
    finally:
        n.kill()


def test_a_range_error_names_its_bounds_in_plain_digits(api):
    r = api.put_queue("plain-bounds", json.dumps({"retentionSeconds": 2_000_000}).encode(), check=False)
    assert r.status == 400 and r.json()["kind"] == "invalid_argument", r
    assert "<= 1209600" in r.json()["message"], r.json()
