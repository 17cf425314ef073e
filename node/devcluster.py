"""`make cluster`: three spooler-node processes on 127.0.0.1 for trying things out.

HTTP 8081-8083, gRPC 27061-27063 (first ports from SPOOLER_CLUSTER_HTTP_PORT and
SPOOLER_CLUSTER_GRPC_PORT), data under ./var/cluster/nN (SPOOLER_CLUSTER_DIR), one
admin key (SPOOLER_ADMIN_KEY, default dev-admin-key). Each node's stdout lines
(its ready line) are printed with its id in front; its log goes to stderr as it
is (each log line names its node after the time). Their pids are printed at the start. A node that exits is reported once, and
the others keep running (stopping one is how a failover is tried); once none
is left, this exits 1. Ctrl-C (or
SIGTERM) stops all of them; each is ended by its pid.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

IDS = ("n1", "n2", "n3")


def _port(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535 - len(IDS):
        raise SystemExit(f"{name} must be a port number (1-{65535 - len(IDS)}), not {raw!r}")
    return port


_OUT = threading.Lock()  # one line at a time: the three echo threads and main() share stdout


def say(text: str) -> None:
    with _OUT:
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):  # stdout went away (`make cluster | head`): the nodes go on
            pass


def _echo(node_id: str, stream) -> None:
    for line in stream:
        say(f"{node_id}: {line.decode(errors='replace').rstrip()}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:  # it takes no arguments: --help (or anything) prints what it does, and starts nothing
        print(__doc__.strip())
        return 0 if argv[0] in ("-h", "--help") else 2
    key = os.environ.get("SPOOLER_ADMIN_KEY", "dev-admin-key")
    base = os.environ.get("SPOOLER_CLUSTER_DIR", "./var/cluster")
    http0, grpc0 = _port("SPOOLER_CLUSTER_HTTP_PORT", 8081), _port("SPOOLER_CLUSTER_GRPC_PORT", 27061)
    grpc = {i: grpc0 + k for k, i in enumerate(IDS)}
    http = {i: http0 + k for k, i in enumerate(IDS)}
    peers = ",".join(f"{i}=127.0.0.1:{grpc[i]}" for i in IDS)
    procs: dict = {}
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for i in IDS:
            cmd = [sys.executable, "-m", "node.main", "--id", i, "--data", os.path.join(base, i),
                   "--http", f"127.0.0.1:{http[i]}", "--grpc", f"127.0.0.1:{grpc[i]}", "--peers", peers,
                   "--admin-key", key]
            procs[i] = subprocess.Popen(cmd, stdout=subprocess.PIPE)
            threading.Thread(target=_echo, args=(i, procs[i].stdout), daemon=True).start()
        say(f"3 nodes: HTTP {', '.join(f'{i}=http://127.0.0.1:{http[i]}' for i in IDS)}; "
            f"gRPC {','.join(f'127.0.0.1:{grpc[i]}' for i in IDS)}; "
            f"pids {', '.join(f'{i}={p.pid}' for i, p in procs.items())}")
        say(f"admin key: {key}   try: export SPOOLER_URL=http://127.0.0.1:{http['n1']} SPOOLER_KEY={key}; "
            f".venv/bin/spoolctl cluster status")
        say("Ctrl-C stops the cluster.")
        ended: set = set()
        while not stop["now"]:
            for i, p in procs.items():
                if i not in ended and p.poll() is not None:
                    ended.add(i)
                    say(f"{i} exited with {p.returncode}"
                        + ("; the others keep running" if len(ended) < len(procs) else ""))
            if len(ended) == len(procs):
                say("no node is left running")
                return 1
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
