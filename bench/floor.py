"""The bare stack: the benchmark's send shapes with none of Spooler's code in between.

What grpc.aio, apsw and asyncio give on this machine in the shape of each send figure
of bench/spool.py and bench/cluster.py, measured in the same run, so that each Spooler
figure can be read against what its own libraries do without it:

* the client writes each request as raw bytes on one open bidi stream (no protobuf
  message, no SDK), and the harness of the 64-in-flight figure is the peers' one
  (a semaphore and one coroutine per send) with a 20-line batcher behind it;
* the servers run gRPC's older I/O path, as a Spooler node does by default (the client
  is this process, on whichever path the benchmark's client runs);
* a "primary" process commits each request as one row (SQLite WAL, synchronous=FULL,
  on its event loop) and answers with 16 bytes per message (an id);
* for 3 nodes, the primary first writes each request to two "replica" processes over
  open bidi streams; each commits it the same way and answers; the primary answers the
  client once its own commit and one replica's answer are in (2 of 3).

None of these processes keeps a queue, a lease, a log position, a checksum, a key or a
metric, and none of them can fail over. So the figures are not a hard bound, only what
the same libraries do for the same round trips and fsyncs on the same disk; how far a
Spooler figure sits from them is what Spooler's own code costs. Receive + ack has no
bare figure: it needs a queue to lease from.

    .venv/bin/python -m bench.floor            # both shapes, prints JSON
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BODY = b"x" * 256
ID = b"0123456789abcdef"  # 16 bytes: about a message id's size
METHOD = "/bare.Bare/Stream"
READY_TIMEOUT_S = 30.0


def _identity(b):
    return b


# ------------------------------------------------------------------ the servers
def _open_db(path: str):
    import apsw

    db = apsw.Connection(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS log(lsn INTEGER PRIMARY KEY, epoch INTEGER, crc INTEGER, rec BLOB)")
    return db


async def _serve(role: str, db_path: str, replicas: list) -> None:
    import grpc

    db = _open_db(db_path)
    lsn = [0]

    def commit(data: bytes) -> None:
        lsn[0] += 1
        with db:
            db.execute("INSERT INTO log VALUES(?, 1, 0, ?)", (lsn[0], data))

    streams = [_Bare(addr) for addr in replicas]  # the primary's open streams to its replicas

    async def handler(it, ctx):
        async for req in it:
            if role == "replica":
                commit(req)
                yield b"ok"
                continue
            n = max(1, len(req) // len(BODY))
            if streams:
                # ship first, so that the replicas write while this process does;
                # answer once this commit and one replica's are in (2 of 3)
                acks = [asyncio.ensure_future(s.request(req)) for s in streams]
                for _ in range(3):
                    await asyncio.sleep(0)
                commit(req)
                await asyncio.wait(acks, return_when=asyncio.FIRST_COMPLETED)
            else:
                commit(req)
            yield ID * n

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bare.Bare", {
        "Stream": grpc.stream_stream_rpc_method_handler(handler, request_deserializer=_identity,
                                                        response_serializer=_identity)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await server.wait_for_termination()


# ------------------------------------------------------------------ the client side
class _Bare:
    """One open stream to the primary; requests are answered in order."""

    def __init__(self, target: str):
        import grpc

        self.ch = grpc.aio.insecure_channel(target)
        self.call = self.ch.stream_stream(METHOD, request_serializer=_identity, response_deserializer=_identity)()
        self.lock = asyncio.Lock()
        self.answers: list = []  # futures, in the order their requests were written

    async def request(self, data: bytes) -> bytes:
        fut = asyncio.get_running_loop().create_future()
        self.answers.append(fut)
        await self.call.write(data)
        if len(self.answers) == 1:
            asyncio.ensure_future(self._read())
        return await fut

    async def _read(self) -> None:
        while self.answers:
            resp = await self.call.read()
            self.answers.pop(0).set_result(resp)

    async def close(self) -> None:
        await self.call.done_writing()
        await self.ch.close()


class _Batcher:
    """The least an auto-batching client does: concurrent sends leave as one request of
    up to 100 bodies, with up to 4 requests in flight."""

    def __init__(self, bare: _Bare):
        self.bare = bare
        self.pending: list = []  # futures of the callers
        self.bodies: list = []   # their bodies
        self.in_flight = 0

    async def send(self, body: bytes) -> bytes:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        self.bodies.append(body)
        if self.in_flight < 4:
            self.in_flight += 1
            asyncio.ensure_future(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self.pending:
                futs, bodies = self.pending[:100], self.bodies[:100]
                del self.pending[:100], self.bodies[:100]
                ans = await self.bare.request(b"".join(bodies))
                for i, f in enumerate(futs):
                    f.set_result(ans[16 * i:16 * i + 16])
        finally:
            self.in_flight -= 1


async def _workload(target: str, n: int, n_seq: int, n_batches: int) -> dict:
    bare = _Bare(target)
    try:
        await bare.request(BODY)  # warm the path (not counted)
        lat = []
        t = time.perf_counter()
        for _ in range(n_seq):
            s = time.perf_counter()
            await bare.request(BODY)
            lat.append(time.perf_counter() - s)
        dt = time.perf_counter() - t
        lat.sort()
        out = {"send_sequential_per_s": round(n_seq / dt),
               "send_sequential_p50_ms": round(statistics.median(lat) * 1e3, 3)}
        # the peers' harness: at most 64 sends awaiting their answer, one coroutine each
        b = _Batcher(bare)
        sem = asyncio.Semaphore(64)

        async def one():
            async with sem:
                await b.send(BODY)

        t = time.perf_counter()
        await asyncio.gather(*[one() for _ in range(n)])
        out["send_64_in_flight_per_s"] = round(n / (time.perf_counter() - t))
        batch = BODY * 100
        t = time.perf_counter()
        for _ in range(n_batches):
            await bare.request(batch)
        out["send_batch_100_per_s"] = round(n_batches * 100 / (time.perf_counter() - t))
        return out
    finally:
        await bare.close()


# ------------------------------------------------------------------ running it
def _server_env() -> dict:
    """The bare servers take the gRPC I/O path a Spooler node takes by default (node/process.py),
    whatever this process's client runs; the bare client is this process, like Spooler's."""
    from spooler.grpc_io import LEGACY

    return dict(os.environ, GRPC_EXPERIMENTS=LEGACY)


def _start(role: str, d: str, replicas: list, i: int) -> tuple:
    cmd = [sys.executable, "-m", "bench.floor", "--serve", role, "--db", os.path.join(d, f"{role}{i}.db")]
    if replicas:
        cmd += ["--replicas", ",".join(replicas)]
    # stderr to a file, never an undrained pipe: a server that logs enough would
    # block on a full pipe and stall the whole run
    err_path = os.path.join(d, f"{role}{i}.stderr")
    with open(err_path, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=_server_env(),
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    deadline = time.monotonic() + READY_TIMEOUT_S
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = p.stdout.readline()
            if line:
                return p, f"127.0.0.1:{json.loads(line)['port']}"
        if p.poll() is not None:
            break
    p.kill()
    p.wait()
    with open(err_path) as f:
        raise RuntimeError(f"bare {role} did not start: {f.read()[-500:] or 'timeout'}")


def _shape(nodes: int, n: int, n_seq: int, n_batches: int, repeats: int) -> dict:
    d = tempfile.mkdtemp(prefix="spooler-bench-bare-")
    procs = []
    try:
        replicas = []
        for i in range(nodes - 1):
            p, addr = _start("replica", d, [], i)
            procs.append(p)
            replicas.append(addr)
        p, target = _start("primary", d, replicas, 0)
        procs.append(p)
        samples: dict = {}
        for _ in range(repeats):
            r = asyncio.run(_workload(target, n, n_seq, n_batches))
            for k, v in r.items():
                samples.setdefault(k, []).append(v)
        med = {k: (round(statistics.median(v), 3) if k.endswith("_ms") else round(statistics.median(v)))
               for k, v in samples.items()}
        return {"median": med, "samples": samples}
    finally:
        for p in procs:  # by pid, also when the workload failed
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
        shutil.rmtree(d, ignore_errors=True)


def run(n: int = 5000, n_seq: int = 1000, n_batches: int = 200, repeats: int = 3, log=print) -> dict:
    out = {"what": "the send figures' shapes on raw grpc.aio streams and apsw commits, nothing of Spooler's "
                   "(bench/floor.py); not a hard bound"}
    for nodes, key in ((1, "one_node"), (3, "three_nodes")):
        log(f"bare stack: {nodes} process(es) serving, x{repeats}")
        try:
            out[key] = _shape(nodes, n, n_seq, n_batches, repeats)
        except Exception as e:  # noqa: BLE001 - reported, the rest of the run goes on
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


def share(spooler_median: dict, bare: dict) -> dict:
    """Spooler's figure as a share of the bare stack's (1 = as fast as the bare stack;
    for latency, bare / Spooler, so that below 1 always means slower)."""
    out = {}
    for fig, v in (bare.get("median") or {}).items():
        mine = spooler_median.get(fig)
        if mine:
            out[fig] = round(v / mine, 3) if fig.endswith("_ms") else round(mine / v, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", choices=("primary", "replica"), help=argparse.SUPPRESS)
    ap.add_argument("--db", help=argparse.SUPPRESS)
    ap.add_argument("--replicas", default="", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--n-seq", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.serve:
        asyncio.run(_serve(a.serve, a.db, [x for x in a.replicas.split(",") if x]))
        return 0
    print(json.dumps(run(a.n, a.n_seq, a.batches, a.repeats, log=lambda m: print(m, file=sys.stderr)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
