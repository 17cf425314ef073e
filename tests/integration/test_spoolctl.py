"""spoolctl's spool commands against a real node, run as a user runs them: a
separate process, its exit status, its stdout bytes, its --json output."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from nodeproc import free_ports, sh_then

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
    assert run_json(node, "send", "jobs", "to be purged")[0] == 0
    assert run_json(node, "purge", "jobs") == (0, {"purged": 1})
    assert run(node, "purge", "jobs")[1].decode().strip() == "purged 0 messages from jobs"
    rc, k = run_json(node, "keys", "create", "--queue", "jobs", "--scope", "send")
    assert rc == 0 and k["queue"] == "jobs" and k["scopes"] == ["send"]
    assert k["id"] in [x["id"] for x in run_json(node, "keys", "list")[1]["keys"]]
    assert run_json(node, "keys", "delete", k["id"]) == (0, {"deleted": k["id"]})
    rc, c = run_json(node, "cluster", "status")
    assert rc == 0 and c["role"] == "primary" and c["nodeId"] == "n1"
    assert run_json(node, "queue", "delete", "jobs") == (0, {"deleted": "jobs"})


def test_a_dedup_key_beyond_ascii_is_the_same_key_as_over_grpc(node):
    """The key goes out as UTF-8, the bytes the node reads a header as, so that a
    send through spoolctl and one through the gRPC SDK with the same key are one
    message. spoolctl refused such a key before (http.client encodes Latin-1)."""
    from spooler import Client

    with Client(node.grpc_target, node.admin_key) as c:
        c.put_queue("dk", dedupWindowSeconds=300)
        first = c.send("dk", b"x", dedup_key="clé-日本")
    rc, d = run_json(node, "send", "dk", "x", "--dedup-key", "clé-日本")
    assert rc == 0 and d == {"id": first.id, "duplicate": True}, d
    rc, d = run_json(node, "send", "dk", "y", "--dedup-key", "cle")
    assert rc == 0 and d["duplicate"] is False


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


class _AckAnswerLost:
    """A proxy to the node that passes every request on and every answer back,
    except an ack's answer: the ack reaches the node, then the connection closes."""

    def __init__(self, node):
        import http.client
        import http.server
        import threading
        from urllib.parse import urlsplit
        target = urlsplit(node.http_url)

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self._relay()

            def do_GET(self):
                self._relay()

            def do_PUT(self):
                self._relay()

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body,
                                 headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
                    r = conn.getresponse()
                    data = r.read()
                finally:
                    conn.close()
                if self.path.endswith("/ack"):
                    self.close_connection = True  # the ack landed; its answer never comes back
                    return
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_receive_ack_whose_ack_fails_still_gives_the_message_and_its_token(node):
    """A lost ack answer must not take the message with it: plain, the body is on
    stdout before the ack, and stderr has its id and token; with --json the error
    carries the message, its ``acked`` null (the ack may have landed: here it did)."""
    assert run(node, "queue", "create", "lostack")[0] == 0
    proxy = _AckAnswerLost(node)
    try:
        assert run(node, "send", "lostack", "one")[0] == 0
        rc, out, err = run(node, "receive", "lostack", "--ack", server=proxy.url)
        assert rc == 1 and out == b"one", (rc, out, err)
        assert "operation_unconfirmed" in err and "token=" in err and "spoolctl ack TOKEN" in err, err
        assert run(node, "send", "lostack", "two")[0] == 0
        rc, out, err = run(node, "receive", "lostack", "--ack", "--json", server=proxy.url)
        assert out.count(b"\n") == 1, (rc, out, err)
        d = json.loads(out)
        assert rc == 1 and d["error"]["kind"] == "operation_unconfirmed", d
        assert d["received"]["body"] == "two" and d["received"]["acked"] is None and d["received"]["token"], d
    finally:
        proxy.close()
    rc, st = run_json(node, "stats", "lostack")
    assert st["queues"][0]["stats"]["ackedTotal"] == 2  # both acks landed; both bodies were shown


def test_receive_ack_whose_body_cannot_be_written_leaves_it_unacked(node):
    """Plain ``receive --ack`` writes the body before it acks: a stdout that fails
    leaves the message leased, to be delivered again, not acked unseen."""
    assert run(node, "queue", "create", "fullout", "--lease-timeout", "30")[0] == 0
    assert run(node, "send", "fullout", "kept")[0] == 0
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_")}
    with open("/dev/full", "wb") as full:
        p = subprocess.run([sys.executable, "-m", "spooler", "--server", node.http_url, "--key", node.admin_key,
                            "receive", "fullout", "--ack"], stdout=full, stderr=subprocess.PIPE, timeout=60, env=e)
    err = p.stderr.decode()
    assert p.returncode == 1 and "output_failed" in err and "not acked" in err, err
    rc, st = run_json(node, "stats", "fullout")
    assert (st["queues"][0]["stats"]["ackedTotal"], st["queues"][0]["stats"]["leased"]) == (0, 1), st


def test_an_empty_name_is_invalid_argument_on_every_command_never_another_route(node):
    """"" as a queue name or key id would make another path (/v1/queues/ is no
    route; stats of "" read as every queue): a malformed name, as API.md says."""
    assert run(node, "queue", "create", "kept")[0] == 0
    assert run(node, "send", "kept", "x")[0] == 0
    for argv in (("queue", "create", ""), ("queue", "get", ""), ("queue", "delete", ""), ("send", "", "hi"),
                 ("receive", ""), ("redrive", ""), ("purge", ""), ("stats", ""), ("keys", "delete", "")):
        rc, d = run_json(node, *argv)
        assert rc == 1 and d["error"]["kind"] == "invalid_argument", (argv, d)
    assert run_json(node, "stats", "kept")[1]["queues"][0]["stats"]["visible"] == 1  # nothing lost
    # refused before anything is sent: the same answer with no server there at all
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    for argv in (("send", "", "hi"), ("queue", "get", ""), ("keys", "delete", "")):
        rc, d = run_json(node, *argv, server=dead)
        assert rc == 1 and d["error"]["kind"] == "invalid_argument", (argv, d)
    # the node says the same to any client that sends such a path
    import urllib.error
    import urllib.request
    for method, path in (("POST", "/v1/queues//messages"), ("POST", "/v1/queues//receive"),
                         ("POST", "/v1/queues//purge"),
                         ("PUT", "/v1/queues/"), ("POST", "/v1/leases//ack"), ("DELETE", "/v1/keys/")):
        req = urllib.request.Request(node.http_url + path, data=b"x" if method != "DELETE" else None,
                                     method=method, headers={"Authorization": f"Bearer {node.admin_key}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400 and json.loads(e.value.read())["kind"] == "invalid_argument", (method, path)


def test_queue_setting_flags_take_plain_ascii_numbers(node):
    for flag, value in (("--max-retries", "1_000"), ("--max-retries", "\u0663"), ("--max-retries", "2.5"),
                        ("--lease-timeout", "1_0"), ("--lease-timeout", "nan"), ("--retention", "inf"),
                        ("--dedup-window", "\u0665")):
        rc, out, err = run(node, "queue", "create", "flags", flag, value)
        assert rc == 2 and "usage:" in err, (flag, value, rc, err)
    rc, d = run_json(node, "queue", "create", "flags", "--lease-timeout", "-1")  # a number, out of range
    assert rc == 1 and d["error"]["kind"] == "invalid_argument", d
    rc, d = run_json(node, "queue", "create", "flags", "--max-retries", "7", "--lease-timeout", "2.5",
                     "--retention", "1e3", "--dedup-window", "60")
    assert rc == 0 and d["settings"] == {"leaseTimeoutSeconds": 2.5, "maxRetries": 7, "retentionSeconds": 1000,
                                         "dedupWindowSeconds": 60, "failureQueue": "flags.failed"}, d


def test_send_from_a_closed_stdin_is_invalid_argument_not_a_traceback(node):
    assert run(node, "queue", "create", "nostdin")[0] == 0
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_")}
    for extra in ([], ["--json"]):
        p = subprocess.run(sh_then("exec 0<&-", [sys.executable, "-m", "spooler", "--server", node.http_url,
                                                 "--key", node.admin_key, "send", "nostdin", "-", *extra]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, env=e)
        err = p.stderr.decode()
        assert p.returncode == 1 and "invalid_argument" in err and "standard input is closed" in err, err
        assert "Traceback" not in err, err
    assert run_json(node, "stats", "nostdin")[1]["queues"][0]["stats"]["sentTotal"] == 0


def test_an_empty_listing_says_so_on_stderr_not_as_an_item(node):
    for argv in (("queue", "list"), ("stats",), ("keys", "list")):
        rc, out, err = run(node, *argv)
        assert rc == 0 and out == b"" and "(no " in err, (argv, out, err)


def test_an_empty_spooler_url_is_unset(monkeypatch):
    from spooler.cli import build_parser
    monkeypatch.setenv("SPOOLER_URL", "")
    assert build_parser().parse_args(["stats"]).server == "http://127.0.0.1:8080"
    monkeypatch.setenv("SPOOLER_URL", "http://10.0.0.1:9")
    assert build_parser().parse_args(["stats"]).server == "http://10.0.0.1:9"


def test_with_stderr_closed_nothing_meant_for_it_reaches_stdout(node):
    """Notes meant for stderr (an empty listing, receive's id line) go nowhere when
    stderr is closed: never onto stdout, which a script reads."""
    assert run(node, "queue", "create", "errclosed")[0] == 0
    assert run(node, "send", "errclosed", "body")[0] == 0
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_")}
    base = [sys.executable, "-m", "spooler", "--server", node.http_url, "--key", node.admin_key]
    for argv, want in ((["keys", "list"], b""), (["receive", "errclosed", "--ack"], b"body")):
        p = subprocess.run(sh_then("exec 2>&-", base + argv), stdout=subprocess.PIPE, timeout=60, env=e)
        assert (p.returncode, p.stdout) == (0, want), (argv, p.returncode, p.stdout)


def test_timeout_gives_up_on_a_server_that_never_answers(node, tmp_path):
    """A node that is stopped (SIGSTOP) or hung accepts the connection and never
    answers: spoolctl waited its fixed 30 s, just when an operator needed it in a
    drill. --request-timeout (or SPOOLCTL_REQUEST_TIMEOUT) bounds each request
    (not --timeout: submit has its own, the job's)."""
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # the kernel accepts the connections; nobody ever reads or answers
    port = srv.getsockname()[1]
    try:
        t = time.monotonic()
        rc, d = run_json(node, "--request-timeout", "0.5", "cluster", "status", server=f"http://127.0.0.1:{port}")
        took = time.monotonic() - t
        assert rc == 1 and d["error"]["kind"] == "unavailable", d
        assert took < 20, took  # (30 s and more without it; the process's start is most of this)
        rc, d = run_json(node, "cluster", "status", server=f"http://127.0.0.1:{port}",
                         env={"SPOOLER_URL": f"http://127.0.0.1:{port}", "SPOOLER_KEY": node.admin_key,
                              "SPOOLCTL_REQUEST_TIMEOUT": "0.5"})
        assert rc == 1 and d["error"]["kind"] == "unavailable", d
    finally:
        srv.close()
    for bad in ("0", "3601"):  # a number out of its range: invalid_argument, exit 1
        rc, d = run_json(node, "--request-timeout", bad, "queue", "list")
        assert rc == 1 and d["error"]["kind"] == "invalid_argument", d
    rc, d = run_json(node, "--request-timeout", "soon", "queue", "list")  # not a number: a usage error
    assert rc == 2 and d["error"]["kind"] == "invalid_argument"
    env = {"SPOOLER_URL": node.http_url, "SPOOLER_KEY": node.admin_key, "SPOOLCTL_REQUEST_TIMEOUT": "soon"}
    rc, d = run_json(node, "queue", "list", env=env)
    assert rc == 1 and "SPOOLCTL_REQUEST_TIMEOUT" in d["error"]["message"], d
    # a command that asks no server is not held up by it (read only where it is used)
    rc, out, err = run(node, "--spool", str(tmp_path / "spool"), "submit", "--", "true", env=env)
    assert rc == 0, err
