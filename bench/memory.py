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
    return out


if __name__ == "__main__":
    import json
    print(json.dumps(run(), indent=2))
