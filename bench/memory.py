"""Memory: what a Spooler node keeps resident, per message it holds, and the peers' beside it.

Two kinds of figure, both read from ``/proc/<pid>/status`` (``VmRSS``: resident now;
``VmHWM``: the most it was resident at once):

* ``run()``: three scenarios, each on a fresh ``spooler-node`` with the asyncio SDK: the
  node's resident size idle, then holding the messages below, read once the node has
  checkpointed everything (bodies leave memory at a checkpoint, DESIGN.md) and its size
  has held still. The growth divided by the messages is ``bytes_per_message``:

  - ``batch``: ``n_batch`` messages sent with ``send_batch`` of 1,000 (the compact form:
    one segment object per batch, DESIGN.md "Segments");
  - ``keyed``: ``n_keyed`` sends, 64 in flight, each with its own dedup key, to a queue with
    a dedup window of an hour (one message object and one dedup entry each: what sends
    that are safe to retry cost);
  - ``leased``: ``n_lease_fill`` messages sent in batches, then ``n_leased`` of them received
    (100 at a time) and not acked (one lease object and one token each: ``bytes_per_lease``).

* ``key_bytes()``: what a remembered dedup key takes by itself, measured in this process
  with tracemalloc on the core alone (``dedup_key`` in the output).

* ``proc_memory(pids)``: the resident size of given processes, which bench.spool,
  bench.cluster and bench.peers read at the end of each workload: the same workload's
  footprint for Spooler and for each peer's three nodes.

Python's allocator and the C library keep freed memory for reuse (a node hands the C
library's back after a checkpoint lets bodies go, node/process.py), so resident sizes move
in steps; the figures are what the operating system sees, an upper bound on the objects.

    .venv/bin/python -m bench.memory            # prints JSON
"""
from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from nodeproc import NodeProc  # noqa: E402  (tests/nodeproc.py)

BODY = b"x" * 256
SETTLE_TIMEOUT_S = 60.0


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Name", "VmRSS", "VmHWM"):
                out[k] = v.strip()
    return out


def _kib(v: str) -> int:
    return int(v.split()[0]) if v else 0


def proc_memory(pids) -> dict:
    """Resident sizes of ``pids`` (the ones still alive), each and in total, in MiB."""
    procs = []
    for pid in pids:
        try:
            s = _status(pid)
        except OSError:
            continue  # gone meanwhile
        procs.append({"pid": pid, "name": s.get("Name"), "rss_mib": round(_kib(s.get("VmRSS", "")) / 1024, 1),
                      "peak_rss_mib": round(_kib(s.get("VmHWM", "")) / 1024, 1)})
    return {"rss_mib": round(sum(p["rss_mib"] for p in procs), 1),
            "peak_rss_mib": round(sum(p["peak_rss_mib"] for p in procs), 1), "processes": procs}


def rss_bytes(pid: int) -> int:
    return _kib(_status(pid).get("VmRSS", "")) * 1024


def settled_rss(pid: int, timeout_s: float = SETTLE_TIMEOUT_S, interval_s: float = 0.5) -> int:
    """The resident size once it holds still: three samples ``interval_s`` apart within 1%
    of each other, or the last sample at the deadline."""
    deadline = time.monotonic() + timeout_s
    xs = [rss_bytes(pid)]
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        xs = (xs + [rss_bytes(pid)])[-3:]
        if len(xs) == 3 and max(xs) - min(xs) <= 0.01 * max(xs):
            break
    return xs[-1]


async def _checkpointed(c, node, queue: str, count: int, timeout_s: float = SETTLE_TIMEOUT_S,
                        quiet_s: float = 3.0) -> None:
    """Wait until the node's queue holds ``count`` messages and the node has checkpointed
    everything: it takes a checkpoint only while something changed, so its count of
    them (spooler_checkpoint_seconds in /metrics) stops moving once all is written and
    the bodies have left memory."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        q = await c.get_queue(queue)
        if q["stats"]["visible"] + q["stats"]["leased"] >= count:
            break
        await asyncio.sleep(0.1)
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        n = await asyncio.to_thread(node.metric, "spooler_checkpoint_seconds_count")
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        await asyncio.sleep(0.2)


async def _fill(c, node, kind: str, n: int) -> None:
    if kind == "batch":
        await c.put_queue("mem")
        for i in range(0, n, 1000):
            await c.send_batch("mem", [BODY] * min(1000, n - i))
    else:  # keyed
        await c.put_queue("mem", dedupWindowSeconds=3600)
        sem = asyncio.Semaphore(64)

        async def one(i):
            async with sem:
                await c.send("mem", BODY, dedup_key=f"key-{i}")

        await asyncio.gather(*[one(i) for i in range(n)])
    await _checkpointed(c, node, "mem", n)


async def _scenario(node, kind: str, n: int, n_leased: int) -> dict:
    """On a fresh node: its resident size idle, holding ``n`` messages sent as ``kind``,
    and (``n_leased``) once that many of them are leased."""
    from spooler import AsyncClient

    pid = node.pid
    idle = await asyncio.to_thread(settled_rss, pid)
    out = {"idle_rss_mib": round(idle / 2**20, 1)}
    async with AsyncClient(node.grpc_target, node.admin_key) as c:
        await _fill(c, node, kind, n)
        full = await asyncio.to_thread(settled_rss, pid)
        out.update(messages=n, rss_mib=round(full / 2**20, 1), bytes_per_message=round((full - idle) / n))
        if n_leased:
            got = 0
            while got < n_leased:
                got += len(await c.receive("mem", max_messages=min(100, n_leased - got)))
            leased = await asyncio.to_thread(settled_rss, pid)
            out.update(leased=n_leased, leased_rss_mib=round(leased / 2**20, 1),
                       bytes_per_lease=round((leased - full) / n_leased))
    out["peak_rss_mib"] = proc_memory([pid])["processes"][0]["peak_rss_mib"]
    return out


def key_bytes(n: int = 50_000, key_chars: int = 36) -> dict:
    """What a remembered dedup key takes by itself, in the core's own objects
    (tracemalloc, in this process: no node, no allocator slack): ``n`` sends of
    256 bytes to a queue with an hour's window, every one then received and
    acked, so the queue holds nothing but what it remembers; once with a key of
    ``key_chars`` characters each (a UUID's 36 by default), once without. The
    difference per send is the key's: its entry in the queue's table and in the
    expiry heap. The store's copy of it is on disk, not counted here."""
    import gc
    import tracemalloc

    from node.core.spool import Core
    from spooler.pb import log_pb2

    def apply(core, rec, ts):
        rec.epoch, rec.lsn, rec.ts_us = 1, core.lsn + 1, ts
        core.apply(rec)

    def remembered(keyed: bool) -> float:
        core = Core(rand=lambda k: b"\x01" * k)
        apply(core, log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id="n1")), 0)
        apply(core, log_pb2.Record(queue_put=log_pb2.QueuePut(
            name="q", settings=log_pb2.QueueSettings(dedup_window_us=3600 * 10**6))), 0)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i in range(0, n, 100):
                rec = log_pb2.Record()
                for j in range(i, min(i + 100, n)):
                    rec.send.entries.add(queue="q", id=f"m{j:025d}", body=BODY,
                                         dedup_key=f"{j:0{key_chars}d}" if keyed else "")
                apply(core, rec, 1 + i)
            while got := core.receive("q", n + 1, 1000):
                rec = log_pb2.Record()
                for m, _ in got:
                    rec.settle.entries.add(kind=log_pb2.ACK, queue="q", id=m.id)
                apply(core, rec, n + 1)
            assert core.stats("q", n + 2)["visible"] == 0 and core.dedup_n == (n if keyed else 0)
            core.dirty.__init__()  # what the next checkpoint would write: gone once written
            gc.collect()
            return (tracemalloc.get_traced_memory()[0] - base) / n
        finally:
            tracemalloc.stop()

    with_keys, without = remembered(True), remembered(False)
    return {"keys": n, "key_chars": key_chars, "bytes_per_key": round(with_keys - without),
            "bytes_per_acked_send_with_key": round(with_keys), "bytes_per_acked_send_without": round(without),
            "method": "tracemalloc, in process"}


def run(n_batch: int = 200_000, n_keyed: int = 50_000, n_lease_fill: int = 20_000, n_leased: int = 10_000,
        log=print) -> dict:
    """Each scenario on a fresh node; never raises for a node failure (that scenario's
    result carries ``error``)."""
    params = {"n_batch": n_batch, "n_keyed": n_keyed, "n_lease_fill": n_lease_fill, "n_leased": n_leased}
    out = {"system": "spooler", "nodes": 1, "message_bytes": len(BODY), "params": params, "scenarios": {}}
    # name -> (how the messages are sent, how many, how many of them are then leased)
    scenarios = {"batch": ("batch", n_batch, 0), "keyed": ("keyed", n_keyed, 0),
                 "leased": ("batch", n_lease_fill, n_leased)}
    for name, (kind, n, leased) in scenarios.items():
        data_dir = tempfile.mkdtemp(prefix="spooler-bench-mem-")
        node = NodeProc(data_dir, node_id="mem1")
        try:
            node.start()
            r = asyncio.run(_scenario(node, kind, n, leased))
        except BaseException as e:  # noqa: BLE001 - report, never hide, and still stop the node
            r = {"error": f"{type(e).__name__}: {e}", "node_log_tail": node.read_log()[-2000:]}
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            node.kill()
            shutil.rmtree(data_dir, ignore_errors=True)
        out["scenarios"][name] = r
        log(f"memory: {name}: {r}")
    try:
        out["dedup_key"] = key_bytes()
    except Exception as e:  # noqa: BLE001 - report, never hide
        out["dedup_key"] = {"error": f"{type(e).__name__}: {e}"}
    log(f"memory: dedup_key: {out['dedup_key']}")
    return out


if __name__ == "__main__":
    import json
    print(json.dumps(run(), indent=2))
