"""`make cluster`: three spooler-node processes on 127.0.0.1 for trying things out.

HTTP 8081-8083, gRPC 50061-50063, data under ./var/cluster/nN, one admin key.
Ctrl-C (or SIGTERM) stops all three; each is ended by its pid.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main() -> int:
    key = os.environ.get("SPOOLER_ADMIN_KEY", "dev-admin-key")
    base = os.environ.get("SPOOLER_CLUSTER_DIR", "./var/cluster")
    ids = ["n1", "n2", "n3"]
    grpc = {i: 50061 + k for k, i in enumerate(ids)}
    http = {i: 8081 + k for k, i in enumerate(ids)}
    peers = ",".join(f"{i}=127.0.0.1:{grpc[i]}" for i in ids)
    procs = {}
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for i in ids:
            cmd = [sys.executable, "-m", "node.main", "--id", i, "--data", os.path.join(base, i),
                   "--http", f"127.0.0.1:{http[i]}", "--grpc", f"127.0.0.1:{grpc[i]}", "--peers", peers,
                   "--admin-key", key]
            procs[i] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        print(f"3 nodes: HTTP {', '.join(f'{i}=http://127.0.0.1:{http[i]}' for i in ids)}", flush=True)
        print(f"admin key: {key}   try: curl -s -H 'Authorization: Bearer {key}' http://127.0.0.1:8081/v1/cluster",
              flush=True)
        print("Ctrl-C stops the cluster.", flush=True)
        while not stop["now"]:
            for i, p in procs.items():
                if p.poll() is not None:
                    print(f"{i} exited with {p.returncode}", flush=True)
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
