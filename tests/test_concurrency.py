"""Atomic claiming: many worker processes, many jobs; nothing double-claimed,
nothing lost. And the lock-timeout failure mode leaves the job queued."""
from __future__ import annotations

import collections
import json
import subprocess
import threading
import time

import apsw
import pytest

from jobs_helpers import spool  # noqa: F401
from spooler.jobs import states
from spooler.jobs.store import Store, WorkerIdentity

N_JOBS = 240
N_WORKERS = 4


def test_many_workers_many_jobs_nothing_double_claimed_nothing_lost(spool, tmp_path):
    ledger = tmp_path / "ledger"
    store = Store(spool.path)
    try:
        ids = [store.submit(["sh", "-c", f'echo "$SPOOLCTL_JOB_ID $SPOOLCTL_ATTEMPT" >> {ledger}'],
                            priority=i % 3)[0] for i in range(N_JOBS)]
    finally:
        store.close()
    workers = [spool.start_worker("--drain", "--concurrency", "2", "--json") for _ in range(N_WORKERS)]
    summaries = []
    # one deadline for the whole drain; a run beyond the jobs' number (a job run
    # again: a claim that left it queued is taken for ever) fails it at once
    deadline = time.monotonic() + 60
    for w in workers:
        while True:
            try:
                out, err = w.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                runs = len(ledger.read_text().splitlines()) if ledger.exists() else 0
                assert runs <= N_JOBS, f"{runs} runs of {N_JOBS} jobs, the workers still draining: a job ran again"
                assert time.monotonic() < deadline, f"the workers had not drained {N_JOBS} jobs in 60 s ({runs} runs)"
        assert w.returncode == 0, err
        summaries.append(json.loads(out))
    # BEGIN IMMEDIATE makes claimants queue on the lock (busy handler) instead of
    # failing a read-to-write upgrade: no claim pass should have been refused
    assert sum(s["busy_timeouts"] for s in summaries) == 0, summaries
    assert sum(s["succeeded"] for s in summaries) == N_JOBS
    store = Store(spool.path)
    try:
        jobs = store.list()
    finally:
        store.close()
    # nothing lost: every job ran to success exactly once
    assert sorted(j["id"] for j in jobs) == sorted(ids)
    assert all(j["state"] == states.SUCCEEDED for j in jobs)
    assert all(len(j["attempts"]) == 1 for j in jobs), "a job was claimed twice"
    runs = collections.Counter(line.split()[0] for line in ledger.read_text().splitlines())
    assert set(runs) == set(ids)
    dupes = {k: v for k, v in runs.items() if v != 1}
    assert not dupes, f"executed more than once: {dupes}"
    # the work was actually shared between the processes
    owners = collections.Counter(j["attempts"][0]["worker_pid"] for j in jobs)
    assert len(owners) >= 2, owners


def test_concurrent_claimers_in_threads_never_share_a_job(tmp_path):
    """Same property without process start-up noise: 8 connections racing claim_next."""
    path = str(tmp_path / "spool")
    s = Store(path)
    for _ in range(300):
        s.submit(["true"])
    claimed = collections.defaultdict(list)
    errors = []
    busy = []
    # Every claimer stops at the first claim beyond the 300 jobs (a job handed out
    # again: a claim that left it queued would be taken for ever), or at the deadline.
    claims, enough, out_of_time = [], threading.Event(), []
    deadline = time.monotonic() + 30

    def claimer(i):
        st = Store(path)
        w = WorkerIdentity.current(5.0)
        try:
            while not enough.is_set():
                if time.monotonic() >= deadline:
                    out_of_time.append(i)
                    return
                try:
                    c = st.claim_next(w)
                except apsw.BusyError:
                    busy.append(i)   # would mean claimants raced instead of queueing
                    continue
                if c is None:
                    return
                claimed[c.job_id].append(i)
                claims.append(c.job_id)
                if len(claims) > 300:
                    enough.set()
        except Exception as e:   # pragma: no cover - reported below
            errors.append(e)
        finally:
            st.close()

    threads = [threading.Thread(target=claimer, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()) + 10)
    assert not any(t.is_alive() for t in threads), "a claimer was still in claim_next 10 s past the deadline"
    assert len(claims) <= 300, (f"{len(claims)} claims of 300 jobs: a job was handed out again"
                                f" ({len(claimed)} distinct jobs claimed)")
    assert not out_of_time, f"claimers {out_of_time} were still claiming after 30 s ({len(claims)} claims)"
    assert not errors
    assert not busy, f"{len(busy)} claim passes failed on the lock"
    assert len(claimed) == 300
    assert all(len(v) == 1 for v in claimed.values())
    assert s.counts()["running"] == 300
    s.close()


def test_lock_timeout_leaves_the_job_queued(tmp_path):
    path = str(tmp_path / "spool")
    holder = Store(path)
    job_id, _ = holder.submit(["true"])
    claimer = Store(path, busy_timeout_s=0.2)
    try:
        holder.conn.execute("BEGIN IMMEDIATE")   # another writer holds the lock
        try:
            with pytest.raises(apsw.BusyError):
                claimer.claim_next(WorkerIdentity.current(5.0))
        finally:
            holder.conn.execute("ROLLBACK")
        job = claimer.get(job_id)
        assert job["state"] == "queued" and job["attempts"] == []
        # the next pass claims it
        assert claimer.claim_next(WorkerIdentity.current(5.0)).job_id == job_id
    finally:
        claimer.close()
        holder.close()


def test_claim_takes_highest_priority_then_oldest(tmp_path):
    s = Store(str(tmp_path / "spool"))
    try:
        low = s.submit(["true"], priority=-1)[0]
        a = s.submit(["true"], priority=5)[0]
        mid = s.submit(["true"])[0]
        b = s.submit(["true"], priority=5)[0]
        w = WorkerIdentity.current(5.0)
        assert [s.claim_next(w).job_id for _ in range(4)] == [a, b, mid, low]
        assert s.claim_next(w) is None
    finally:
        s.close()


def test_a_claim_that_waited_for_the_lock_keeps_a_backoff_set_meanwhile(tmp_path):
    """J4: a claim reads the time once it holds the write lock. One that read it
    before waiting took a job whose failure (and 2 s backoff) committed during
    the wait: the failure's updated_at, after that stale time, looked like a
    clock stepped back, and the attempt ran again at once."""
    d = str(tmp_path)
    s_fail, s_claim, blocker = Store(d), Store(d), Store(d)
    jid, _ = s_fail.submit(["false"], max_retries=3)
    first = s_fail.claim_next(WorkerIdentity.current(5.0))
    waiting, go = threading.Event(), threading.Event()
    on_busy = s_claim._on_busy

    def held(count):  # the claim meets the lock taken: it waits until the failure is in
        waiting.set()
        go.wait(10)
        return on_busy(count)

    s_claim.conn.setbusyhandler(held)
    blocker.conn.execute("BEGIN IMMEDIATE")  # another worker's write holds the lock
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("claim", s_claim.claim_next(WorkerIdentity.current(5.0))))
    t.start()
    try:
        assert waiting.wait(10), "the claim never met the lock"
        blocker.conn.execute("COMMIT")
        assert s_fail.finish_attempt(first, "nonzero_exit", 1, "exit code 1") == states.QUEUED
        assert s_fail.get(jid)["run_after"] > s_fail.get(jid)["updated_at"] + 1  # a backoff
    finally:
        go.set()
        t.join(10)
    assert got["claim"] is None, "claimed inside its backoff"


def test_a_cancel_closes_the_attempt_it_canceled_not_a_later_one(tmp_path):
    """J7: the cancel closes the attempt it found running once its kill is done;
    a retry and a new claim may come in the meantime. It closed "the latest"
    attempt before: the new, running one, and left the canceled one open."""
    s = Store(str(tmp_path))
    jid, _ = s.submit(["sleep", "100"])
    s.claim_next(WorkerIdentity.current(5.0))  # attempt 1; its worker then dies
    prev, _, _, token = s.cancel(jid)
    assert prev == states.RUNNING and token == f"{jid}:1"
    s.retry(jid)  # meanwhile (the kill can take seconds): a retry, and another worker claims
    assert s.claim_next(WorkerIdentity.current(5.0)).n == 2
    s.close_canceled_attempt(jid, int(token.rpartition(":")[2]))
    job = s.get(jid)
    by_n = {a["n"]: a for a in job["attempts"]}
    assert job["state"] == states.RUNNING
    assert by_n[1]["finished_at"] is not None and by_n[1]["failure_reason"] == states.CANCELED_REASON
    assert by_n[2]["finished_at"] is None and by_n[2]["failure_reason"] is None


def test_a_claim_is_on_disk_when_claim_next_returns(tmp_path):
    """J1: the claim's transaction is fsync'd at its commit (WAL, synchronous=FULL):
    the WAL is synced before claim_next returns, so a power loss cannot forget a
    claim whose command may already run. (With synchronous=NORMAL a WAL commit is
    synced only at a later checkpoint.) Sync calls are counted by a VFS that
    passes everything on to SQLite's own."""
    synced = []

    class File(apsw.VFSFile):
        def __init__(self, base, name, flags):
            self.path = name.filename() if isinstance(name, apsw.URIFilename) else (name or "")
            super().__init__(base, name, flags)

        def xSync(self, flags):
            synced.append(self.path)
            return super().xSync(flags)

    class Counting(apsw.VFS):
        def __init__(self):
            super().__init__("spoolctl-test-count-syncs", "unix", makedefault=True)

        def xOpen(self, name, flags):
            return File("unix", name, flags)

    vfs = Counting()
    try:
        path = str(tmp_path / "spool")
        s = Store(path)
        try:
            job_id, _ = s.submit(["true"])
            synced.clear()
            claim = s.claim_next(WorkerIdentity.current(5.0))
            assert claim is not None and claim.job_id == job_id
            assert any(p.endswith("-wal") for p in synced), f"the claim's commit synced nothing: {synced}"
        finally:
            s.close()
    finally:
        vfs.unregister()
