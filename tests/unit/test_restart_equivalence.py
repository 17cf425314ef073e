"""A restart rebuilds the state the log says, whatever was checkpointed when.

A node's state after a restart is built from its checkpointed tables (queues,
segments, message rows, dedup keys, API keys, counters) plus a replay of the
log after the checkpoint (Engine.load). Here a single node runs a random mix
of every kind of write through the Service (queues created, changed, deleted
and created again; sends one by one, with delays and dedup keys, and in runs;
receives, acks, nacks with delays, renewals; leases and retention that expire
on their own; moves to the failure queue and redrives; purges; API keys made
and deleted), with checkpoints taken at random moments. At random moments its
files are copied as a kill -9 would leave them, and once more after a graceful
stop. Each copy is loaded by a fresh Engine, and its state must be the state
of a core that applied the copy's whole log from the first record: a
checkpoint that wrote a change wrongly, or a load that read one back wrongly,
shows as a difference.
"""
import asyncio
import os
import random
import shutil

import pytest

from node.api.service import Principal, Service
from node.core.spool import Core
from node.engine import Engine
from node.store.sqlite import Store
from spooler.pb import log_pb2

ADMIN = Principal(admin=True)
QUEUES = ("a", "b", "a.failed")


def _state(core: Core, now: int) -> dict:
    """Everything a restart must give back: per queue its settings, counters,
    messages (id, seq, retry, visible at, expires at) in seq order, dedup keys
    and counts by state; and the API keys."""
    out = {}
    for name, q in sorted(core.queues.items()):
        core.promote(q, now)
        out[name] = (dict(q.settings), dict(q.counters), core.messages(name), dict(q.dedup),
                     (q.size, q.n_ready, q.n_delayed, q.n_leased))
    out["keys"] = dict(core.keys)
    return out


def _replayed(data_dir: str) -> Core:
    """A core that applied every record of the store's log from lsn 1 (a replica's view)."""
    st = Store(os.path.join(data_dir, "spool.db"), prefill_wal=False)
    try:
        rows = st.records_after(0, limit=1_000_000)
    finally:
        st.close()
    assert rows and rows[0][0] == 1, "the log no longer starts at its first record"
    core = Core(rand=os.urandom)
    for _, _, _, data in rows:
        core.apply(log_pb2.Record.FromString(data))
    return core, rows[-1][0]


def _loaded(data_dir: str) -> Core:
    eng = Engine(data_dir, checkpoint_interval_s=3600)
    try:
        eng.load()
        return eng.core, eng.core.lsn
    finally:
        eng.store.close()


def _copy_as_after_a_crash(src_dir: str, dst_dir: str) -> None:
    os.makedirs(dst_dir)
    for suffix in ("", "-wal"):
        path = os.path.join(src_dir, "spool.db" + suffix)
        if os.path.exists(path):
            shutil.copyfile(path, os.path.join(dst_dir, "spool.db" + suffix))


def _same_after_load(data_dir: str) -> tuple:
    ref, ref_lsn = _replayed(data_dir)
    got, got_lsn = _loaded(data_dir)
    assert got_lsn == ref_lsn
    now = 1 << 62  # past every delay: both promote the same messages
    assert ref.check() == [] and got.check() == [], data_dir
    a, b = _state(ref, now), _state(got, now)
    if a != b:
        diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        raise AssertionError(f"{data_dir}: the loaded state is not the replayed log's: {diff}")
    return ref_lsn, sum(len(ref.messages(q)) for q in ref.queues)


async def _random_writes(rng: random.Random, eng: Engine, svc: Service, images: list, base: str, steps: int):
    tokens: list = []
    keys: list = []
    for _ in range(steps):
        q = rng.choice(QUEUES)
        op = rng.random()
        try:
            if op < 0.06:
                settings = {}
                if rng.random() < 0.5:
                    settings["maxRetries"] = rng.choice([0, 1, 2])
                if rng.random() < 0.4:
                    settings["leaseTimeoutSeconds"] = rng.choice([0.005, 0.02, 30])
                if rng.random() < 0.3:
                    settings["retentionSeconds"] = rng.choice([0.03, 3600])
                if rng.random() < 0.3:
                    settings["dedupWindowSeconds"] = rng.choice([0, 0.05, 60])
                await svc.put_queue(ADMIN, q, settings)
            elif op < 0.08:
                await svc.delete_queue(ADMIN, q)
            elif op < 0.30:
                entries = [(q, os.urandom(rng.choice([1, 50, 300])), rng.choice([0.0, 0.0, 0.01]),
                            rng.choice(["", "", "k1", "k2"])) for _ in range(rng.randint(1, 3))]
                await svc.send(ADMIN, entries)
            elif op < 0.40:
                bodies = [os.urandom(rng.choice([1, 100])) for _ in range(rng.randint(1, 12))]
                await svc.send(ADMIN, [], (q, bodies, rng.choice([0.0, 0.0, 0.01])))
            elif op < 0.58:
                got = await svc.receive(ADMIN, q, 0, rng.randint(1, 5))
                tokens += [d.token for d in got]
            elif op < 0.80 and tokens:
                tok = tokens.pop(rng.randrange(len(tokens)))
                what = rng.random()
                if what < 0.5:
                    await svc.ack(ADMIN, tok)
                elif what < 0.85:
                    await svc.nack(ADMIN, tok, rng.choice([0.0, 0.01]))
                else:
                    await svc.renew(ADMIN, tok)
                    tokens.append(tok)
            elif op < 0.815:
                await svc.redrive(ADMIN, q)
            elif op < 0.83:
                await svc.purge(ADMIN, q)
            elif op < 0.86:
                if keys and rng.random() < 0.4:
                    await svc.delete_key(ADMIN, keys.pop(rng.randrange(len(keys))))
                else:
                    keys.append((await svc.create_key(ADMIN, q, ["send", "receive"]))["id"])
            elif op < 0.92:
                await eng.checkpoint_now()
            elif op < 0.95:
                # a kill -9 now: the files as they are (the answers so far were fsync'd)
                dst = os.path.join(base, f"crash-{len(images)}")
                _copy_as_after_a_crash(eng.data_dir, dst)
                images.append(dst)
            else:
                # time for leases, delays, dedup windows and retention to end on their own
                await asyncio.sleep(rng.choice([0.005, 0.02, 0.05]))
        except Exception as e:  # noqa: BLE001 - refusals of the contract are part of the mix
            kind = getattr(e, "kind", None)
            assert kind in ("queue_not_found", "stale_lease", "invalid_argument", "not_found"), repr(e)
        if rng.random() < 0.3:  # a /metrics scrape (it drops stale heap entries as a receive would)
            for name in list(eng.core.queues):
                eng.core.first_in_line_since(name, eng.now_us())
        assert eng.core.check() == [], eng.core.check()  # the live primary's, leases and all


@pytest.mark.parametrize("seed", range(6))
def test_a_restart_loads_what_the_whole_log_says_whenever_the_checkpoints_came(tmp_path, seed):
    rng = random.Random(seed)
    base = str(tmp_path)
    node_dir = os.path.join(base, "n")
    images: list = []

    async def main():
        eng = Engine(node_dir, checkpoint_interval_s=3600)
        await eng.start()
        try:
            await _random_writes(rng, eng, Service(eng, ["k"]), images, base, 400)
        finally:
            await eng.stop()  # graceful: a last checkpoint
        dst = os.path.join(base, "stopped")
        _copy_as_after_a_crash(node_dir, dst)
        images.append(dst)

    asyncio.run(main())
    assert len(images) >= 2
    held = [_same_after_load(d) for d in images]
    assert held[-1][0] > 100 and max(n for _, n in held) > 0, held  # a run with something in it
