"""A node process settles gRPC's I/O path before grpc is imported (node/process.py),
whichever way it is started: the ``spooler-node`` script (what make run, the
Dockerfile and the systemd unit run) or ``python -m node.main`` (the tests, the
drills, make cluster)."""
import json
import os
import subprocess
import sys
import time

import pytest

from nodeproc import NodeProc, free_ports, sh_then, wait_until
from node.process import GRPC_IO_LEGACY

LINE = f"gRPC I/O path: legacy (GRPC_EXPERIMENTS={GRPC_IO_LEGACY})"


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", "SPOOLER_GRPC_IO")}


def test_python_m_node_main_runs_on_the_older_io_path(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    monkeypatch.delenv("SPOOLER_GRPC_IO", raising=False)
    n = NodeProc(str(tmp_path / "n")).start()
    try:
        assert LINE in n.read_log()
    finally:
        n.kill()


def test_the_spooler_node_script_runs_on_the_older_io_path(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "spooler-node")
    if not os.path.exists(script):
        pytest.skip("no spooler-node script beside this interpreter (not installed in a venv)")
    log = tmp_path / "node.log"
    with open(log, "wb") as err:
        p = subprocess.Popen([script, "--id", "n1", "--data", str(tmp_path / "d"), "--http", "127.0.0.1:0",
                              "--grpc", "127.0.0.1:0", "--admin-key", "k"], stdout=subprocess.PIPE, stderr=err,
                             env=_env())
    try:
        ready = json.loads(p.stdout.readline() or b"{}")
        assert ready.get("event") == "ready", log.read_text()
        assert ready.get("pid") == p.pid, ready  # the pid to stop it by (make run's node, README)
        wait_until(lambda: LINE in log.read_text(), 5, what="the I/O path in the log")
        # every log line names its node after the time (a cluster's logs read apart)
        line = next(x for x in log.read_text().splitlines() if LINE in x)
        assert line.split()[2] == "n1", line
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("flag", ["--grpc", "--http"])
def test_an_address_in_use_is_one_clear_line_and_exit_1(tmp_path, flag):
    """A port another process holds: the node says which address it could not
    listen on, in one line, and exits 1 (no traceback), whichever of its two
    listeners it was."""
    import socket
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    addrs = {"--grpc": "127.0.0.1:0", "--http": "127.0.0.1:0", flag: f"127.0.0.1:{port}"}
    try:
        p = subprocess.run([sys.executable, "-m", "node.main", "--id", "n1", "--data", str(tmp_path / "d"),
                            "--admin-key", "k-123", "--grpc", addrs["--grpc"], "--http", addrs["--http"]],
                           capture_output=True, timeout=60)
    finally:
        held.close()
    err = p.stderr.decode()
    what = "gRPC" if flag == "--grpc" else "HTTP"
    assert p.returncode == 1, (p.returncode, err[-2000:])
    assert f"spooler-node: cannot listen for {what} on 127.0.0.1:{port}" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert b'"ready"' not in p.stdout
    # refused before anything was made: no data directory, no store, no election,
    # and not gRPC's own log line about the bind beside ours
    assert not (tmp_path / "d").exists()
    assert "elected" not in err and "Failed to add port" not in err, err[-2000:]


def _ipv6_loopback() -> bool:
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_node_listens_on_ipv6_addresses_for_both_apis(tmp_path):
    """[::1]:PORT for --grpc as for --http: gRPC is given the address in brackets
    (it once got ::1:PORT and refused it after making the data directory)."""
    from spooler import Client
    g, h = free_ports(2)
    p = subprocess.Popen([sys.executable, "-m", "node.main", "--id", "n1", "--data", str(tmp_path / "d"),
                          "--admin-key", "k-123", "--grpc", f"[::1]:{g}", "--http", f"[::1]:{h}"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready = json.loads(p.stdout.readline() or b"{}")
        assert ready.get("grpc") == f"[::1]:{g}" and ready.get("http") == f"[::1]:{h}", ready
        with Client(f"[::1]:{g}", "k-123", timeout_s=10) as c:
            c.put_queue("v6")
            assert not c.send("v6", b"x").duplicate
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("grpc_host, http_host", [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"),
                                                  ("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "0.0.0.0"),
                                                  ("localhost", "[::1]"), ("[::]", "0.0.0.0"),
                                                  ("[::]", "127.0.0.1"), ("0.0.0.0", "[::]")])
def test_the_same_address_for_both_apis_is_refused_before_anything_is_made(tmp_path, grpc_host, http_host):
    """Also under two spellings of one address, or a wildcard and one of its
    addresses: the kernel would refuse the second bind, after the data directory
    and the store were made. gRPC binds a wildcard for both families and resolves
    "localhost" to both loopback addresses itself."""
    if ":" in grpc_host + http_host and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    port = free_ports(1)[0]
    p = subprocess.run([sys.executable, "-m", "node.main", "--id", "n1", "--data", str(tmp_path / "d"),
                        "--admin-key", "k-123", "--grpc", f"{grpc_host}:{port}", "--http", f"{http_host}:{port}"],
                       capture_output=True, timeout=60)
    err = p.stderr.decode()
    assert p.returncode == 1 and "the same address as --grpc" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "d").exists()


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("taken, grpc_host", [("::", "0.0.0.0"), ("::1", "localhost")])
def test_a_grpc_address_that_grpc_itself_would_take_is_not_refused(taken, grpc_host):
    """gRPC starts on a wildcard when [::] is taken (v6-only) but 0.0.0.0 is free,
    and on localhost when one loopback is free: the check before start-up must not
    refuse what gRPC would take."""
    import socket
    from node.api.grpc_api import ListenError
    from node.main import check_both_listenable
    port, other_port = free_ports(2)
    with socket.socket(socket.AF_INET6) as other:
        other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        other.bind((taken, port))
        other.listen(1)
        check_both_listenable(f"{grpc_host}:{port}", f"127.0.0.1:{other_port}")
        with pytest.raises(ListenError, match="the same address as --grpc"):
            check_both_listenable(f"{grpc_host}:{port}", f"127.0.0.1:{port}")


def test_a_node_that_makes_its_own_admin_key_says_where_it_is_not_what_it_is(tmp_path):
    """With no --admin-key the node makes one and keeps it in DATA/admin.key (mode
    0600). It printed the secret itself into its log; now only where it is."""
    env = _env()
    env.pop("SPOOLER_ADMIN_KEY", None)
    log = tmp_path / "node.log"
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "node.main", "--id", "n1", "--data", str(tmp_path / "d"),
                              "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"], stdout=subprocess.PIPE,
                             stderr=err, env=env)
    try:
        ready = json.loads(p.stdout.readline() or b"{}")
        assert ready.get("event") == "ready", log.read_text()
        key_file = tmp_path / "d" / "admin.key"
        key = key_file.read_text().strip()
        assert len(key) >= 20 and oct(key_file.stat().st_mode & 0o777) == "0o600"
        text = log.read_text()
        assert str(key_file) in text and key not in text, text
    finally:
        p.kill()
        p.wait()


def test_a_node_out_of_file_descriptors_logs_it_once_not_a_traceback_per_attempt(tmp_path):
    """Connections that send nothing, enough to use up the node's descriptors (no
    key needed): asyncio logged "socket.accept() out of system resource" with a
    traceback per attempt, thousands a second (84 MB of log in 35 s in a
    review). Now one line a minute; the node serves again once they close."""
    import socket

    limit = 200

    http, grpc_port = free_ports(2)
    log = tmp_path / "node.log"
    with open(log, "wb") as err:
        p = subprocess.Popen(sh_then(f"ulimit -n {limit}", [sys.executable, "-m", "node.main", "--id", "n1",
                                                             "--data", str(tmp_path / "d"), "--http", f"127.0.0.1:{http}",
                                                             "--grpc", f"127.0.0.1:{grpc_port}", "--admin-key", "k"]),
                             stdout=subprocess.PIPE, stderr=err, env=_env())
    socks = []
    try:
        ready = json.loads(p.stdout.readline() or b"{}")
        assert ready.get("event") == "ready", log.read_text()
        for _ in range(limit + 50):
            s = socket.create_connection(("127.0.0.1", http), timeout=5)
            socks.append(s)
        wait_until(lambda: "out of system resource" in log.read_text(), 15, what="the node to run out")
        # asyncio tries again every 0.1 s or so while out: a few seconds gave dozens of lines
        start = log.read_text().count("out of system resource")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert log.read_text().count("out of system resource") == start == 1, log.read_text()[-2000:]
            time.sleep(0.2)
        assert "Traceback" not in log.read_text()
        for s in socks:
            s.close()
        socks = []
        import urllib.request

        def healthy():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_until(healthy, 15, what="the node to serve again")
    finally:
        for s in socks:
            s.close()
        p.kill()
        p.wait()
