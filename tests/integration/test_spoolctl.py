"""spoolctl's spool commands against a real node, run as a user runs them: a
separate process, its exit status, its stdout bytes, its --json output."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from nodeproc import free_ports

BODY = bytes(range(256)) * 4  # every byte value, no trailing newline


def run(node, *argv, stdin: bytes = b"", env: dict | None = None, server: str | None = None):
    """spoolctl ARGV with --server/--key from ``node`` (unless ``env`` carries them)."""
    base = [] if env else ["--server", server or node.http_url, "--key", node.admin_key]
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_")} | (env or {})
    p = subprocess.run([sys.executable, "-m", "spooler", *base, *argv], input=stdin, capture_output=True,
                       timeout=60, env=e)
    return p.returncode, p.stdout, p.stderr.decode(errors="replace")


def run_json(node, *argv, **kw):
    rc, out, err = run(node, *argv, "--json", **kw)
    assert out.count(b"\n") == 1, (rc, out, err)  # one JSON document, one line
    return rc, json.loads(out)


def test_every_spool_command_round_trips_in_json(node):
    rc, d = run_json(node, "queue", "create", "jobs", "--max-retries", "1", "--lease-timeout", "5")
    assert rc == 0 and d["name"] == "jobs" and d["created"] is True and d["settings"]["maxRetries"] == 1
    assert run_json(node, "queue", "get", "jobs")[1]["settings"]["leaseTimeoutSeconds"] == 5
    assert [q["name"] for q in run_json(node, "queue", "list")[1]["queues"]] == ["jobs"]
    rc, sent = run_json(node, "send", "jobs", "hello", "--dedup-key", "k1")
    assert rc == 0 and sent["duplicate"] is False
    rc, got = run_json(node, "receive", "jobs")
    assert rc == 0 and got["id"] == sent["id"] and got["body"] == "hello" and got["retryCount"] == 0
    rc, renewed = run_json(node, "renew", got["token"])
    assert rc == 0 and renewed["expiresAt"].endswith("Z")
    assert run_json(node, "nack", got["token"]) == (0, {"nacked": True})
    # retry count 1 = maxRetries: the next nack moves it to jobs.failed
    rc, again = run_json(node, "receive", "jobs", "--wait", "5")
    assert again["id"] == sent["id"] and again["retryCount"] == 1
    assert run_json(node, "nack", again["token"])[0] == 0
    assert run_json(node, "stats", "jobs.failed")[1]["queues"][0]["stats"]["visible"] == 1
    assert run_json(node, "redrive", "jobs") == (0, {"moved": 1})
    rc, back = run_json(node, "receive", "jobs", "--ack")
    assert back["id"] == sent["id"] and back["retryCount"] == 0 and back["acked"] is True
    assert run_json(node, "receive", "jobs") == (0, {"message": None})
    rc, k = run_json(node, "keys", "create", "--queue", "jobs", "--scope", "send")
    assert rc == 0 and k["queue"] == "jobs" and k["scopes"] == ["send"]
    assert k["id"] in [x["id"] for x in run_json(node, "keys", "list")[1]["keys"]]
    assert run_json(node, "keys", "delete", k["id"]) == (0, {"deleted": k["id"]})
    rc, c = run_json(node, "cluster", "status")
    assert rc == 0 and c["role"] == "primary" and c["nodeId"] == "n1"
    assert run_json(node, "queue", "delete", "jobs") == (0, {"deleted": "jobs"})


def test_json_may_come_before_or_after_the_action(node):
    """API.md: ``spoolctl COMMAND [--json] ...``, and every command takes --json:
    for the commands with actions, both ``queue --json list`` and ``queue list --json``."""
    assert run(node, "queue", "create", "jq")[0] == 0
    for argv in (["queue", "--json", "list"], ["queue", "list", "--json"], ["queue", "--json", "get", "jq"],
                 ["cluster", "--json", "status"], ["keys", "--json", "list"]):
        rc, out, err = run(node, *argv)
        assert rc == 0 and out.count(b"\n") == 1, (argv, rc, out, err)
        json.loads(out)
    rc, out, _ = run(node, "queue", "--json", "get", "nope")
    assert rc == 1 and json.loads(out)["error"]["kind"] == "queue_not_found"
    rc, out, _ = run(node, "queue", "list")
    assert rc == 0 and out.strip() and not out.startswith(b"{")  # plain text without --json


def test_scope_may_be_repeated(node):
    rc, k = run_json(node, "keys", "create", "--queue", "jq2", "--scope", "receive", "--scope", "send")
    assert rc == 0 and sorted(k["scopes"]) == ["receive", "send"], k
    rc, k = run_json(node, "keys", "create", "--queue", "jq2")
    assert rc == 0 and sorted(k["scopes"]) == ["receive", "send"], k  # the default


def test_binary_body_survives_stdin_to_stdout(node):
    assert run(node, "queue", "create", "bin")[0] == 0
    rc, out, err = run(node, "send", "bin", "-", stdin=BODY)
    assert rc == 0, err
    rc, out, err = run(node, "receive", "bin", "--ack")
    assert rc == 0, err
    assert out == BODY  # every byte, and nothing added
    assert "id=" in err
    rc, out, err = run(node, "receive", "bin")
    assert rc == 3 and out == b"" and "(no message)" in err  # nothing there: exit 3, and stdout holds no body


def test_environment_names_the_server_and_key(node):
    env = {"SPOOLER_URL": node.http_url, "SPOOLER_KEY": node.admin_key}
    assert run_json(node, "queue", "create", "envq", env=env)[0] == 0
    rc, d = run_json(node, "queue", "get", "envq", env={"SPOOLER_URL": node.http_url, "SPOOLER_KEY": "wrong"})
    assert rc == 1 and d["error"]["kind"] == "unauthenticated"


def test_errors_are_contract_kinds_in_json_with_exit_1(node):
    rc, d = run_json(node, "queue", "get", "nope")
    assert rc == 1 and d["error"]["kind"] == "queue_not_found"
    rc, d = run_json(node, "ack", "")
    assert rc == 1 and d["error"]["kind"] == "invalid_argument"  # not a 404 for a route
    rc, d = run_json(node, "ack", "garbage-token-garbage-token-garbage")
    assert rc == 1 and d["error"]["kind"] == "invalid_argument"
    # "" is not "every queue": the node refuses it, and no key is made
    before = run_json(node, "keys", "list")[1]["keys"]
    rc, d = run_json(node, "keys", "create", "--queue", "", "--scope", "send,receive,admin")
    assert rc == 1 and d["error"]["kind"] == "invalid_argument"
    assert run_json(node, "keys", "list")[1]["keys"] == before
    assert run(node, "queue", "create", "dq")[0] == 0
    rc, d = run_json(node, "send", "dq", "x", "--dedup-key", "")
    assert rc == 1 and d["error"]["kind"] == "invalid_argument"
    assert run_json(node, "stats", "dq")[1]["queues"][0]["stats"]["sentTotal"] == 0
    rc, d = run_json(node, "queue", "get", "q\udcff")  # not UTF-8 on the command line
    assert rc == 1 and d["error"]["kind"] == "invalid_argument"


def test_tiny_delays_and_waits_are_sent_as_plain_seconds(node):
    assert run(node, "queue", "create", "tiny")[0] == 0
    rc, d = run_json(node, "send", "tiny", "x", "--delay", "0.0000001")  # would be "1e-07"
    assert rc == 0 and d["duplicate"] is False
    rc, d = run_json(node, "receive", "tiny", "--wait", "0.00001")
    assert rc == 0 and d["body"] == "x"


@pytest.mark.parametrize("argv", [("receive", "q", "--wait", "nan"), ("send", "q", "x", "--delay", "inf"),
                                  ("nack", "tok", "--delay", "-1"), ("ack",)])
def test_usage_errors_under_json_are_json(node, argv):
    rc, out, err = run(node, *argv, "--json")
    assert rc == 2 and "usage:" in err
    assert json.loads(out)["error"]["kind"] == "invalid_argument"


def test_no_server_is_unavailable_not_unconfirmed(node):
    port = free_ports(1)[0]  # nothing listens there
    for argv in (("send", "q", "x"), ("queue", "create", "q"), ("queue", "list")):
        rc, d = run_json(node, *argv, server=f"http://127.0.0.1:{port}")
        assert rc == 1 and d["error"]["kind"] == "unavailable", (argv, d)  # nothing left: safe to retry
    rc, d = run_json(node, "queue", "list", server="http://127.0.0.1:notaport")
    assert rc == 1 and d["error"]["kind"] == "invalid_argument"


def test_a_server_that_is_not_http_gives_an_error_not_a_traceback(node):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    import threading

    def serve():
        for _ in range(2):
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"SSH-2.0-not-http\r\n")
            conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        rc, d = run_json(node, "queue", "list", server=f"http://127.0.0.1:{port}")
        assert rc == 1 and d["error"]["kind"] == "unavailable"  # a read: nothing changed
        rc, d = run_json(node, "send", "q", "x", server=f"http://127.0.0.1:{port}")
        assert rc == 1 and d["error"]["kind"] == "operation_unconfirmed"  # it left: outcome unknown
    finally:
        srv.close()
        t.join(timeout=10)


def test_a_closed_pipe_ends_quietly(node):
    for i in range(3):
        assert run(node, "queue", "create", f"pipe{i}")[0] == 0
    base = ["--server", node.http_url, "--key", node.admin_key]
    # stdout to a pipe is block-buffered (unless PYTHONUNBUFFERED): the broken pipe
    # then shows only when the buffer is flushed, which must still be inside main()
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_") and k != "PYTHONUNBUFFERED"}
    for json_flag in ([], ["--json"]):
        p = subprocess.Popen([sys.executable, "-m", "spooler", *base, "queue", "list", *json_flag],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)
        try:
            p.stdout.close()  # the reader is gone before spoolctl writes
            err = p.stderr.read().decode()
            rc = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert rc == 1 and "BrokenPipe" not in err and "Traceback" not in err and "Exception ignored" not in err, \
            (rc, err)
