"""Crash recovery: stale heartbeat, PID liveness (dead / alive / recycled /
permission denied), the in-transaction re-check, crash count and failure_reason,
and the whole cycle with a SIGKILLed worker process."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from jobs_helpers import pid_gone, spool, wait_until  # noqa: F401
from spooler.jobs import reaper, states
from spooler.jobs.store import Store, WorkerIdentity

T0 = 1_800_000_000.0
HOST = socket.gethostname()


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "spool"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def procs():
    started = []

    def start(argv):
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        started.append(p)
        return p
    try:
        yield start
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def dead_pid(procs) -> int:
    p = procs(["true"])
    p.wait(timeout=10)
    return p.pid


def claim_as(store, pid: int, now: float = T0, hb: float = 5.0):
    w = WorkerIdentity(f"{HOST}:{pid}:test", pid, HOST, hb)
    return w, store.claim_next(w, now=now)


# --- staleness ------------------------------------------------------------------

def test_stale_heartbeat_becomes_a_candidate_only_past_the_threshold(store):
    store.submit(["true"])
    store.submit(["true"])
    _, c1 = claim_as(store, 999_999, hb=5.0)     # threshold max(20, 30) = 30
    _, c2 = claim_as(store, 999_998, hb=10.0)    # threshold max(40, 30) = 40
    assert store.reap_candidates(now=T0 + 29.9) == []
    assert [c.job_id for c in store.reap_candidates(now=T0 + 30.1)] == [c1.job_id]
    assert {c.job_id for c in store.reap_candidates(now=T0 + 40.1)} == {c1.job_id, c2.job_id}
    # the test knob overrides the threshold
    assert len(store.reap_candidates(now=T0 + 1.1, threshold_override_s=1.0)) == 2


def test_heartbeat_keeps_a_job_off_the_candidate_list(store):
    store.submit(["true"])
    w, c = claim_as(store, os.getpid())
    assert store.heartbeat(w, {(c.job_id, c.n)}, now=T0 + 25) == set()
    assert store.reap_candidates(now=T0 + 31) == []
    assert len(store.reap_candidates(now=T0 + 56)) == 1


def test_a_clock_stepped_back_leaves_no_job_waiting_for_the_old_time(store, procs):
    """Times are the wall clock's. Stepped back by ten minutes, a queued job
    written "later" is eligible at once (not in ten minutes), and a dead
    worker's job whose heartbeat lies in the future is judged by its PID now;
    a live worker's is still left alone."""
    later = T0 + 600
    queued, _ = store.submit(["true"], now=later)
    w, c = claim_as(store, os.getpid(), now=T0)  # the job above: eligible although written "later"
    assert c is not None and c.job_id == queued
    store.finish_attempt(c, states.NONZERO_EXIT, 1, "exit 1", now=later)  # backoff from "later"
    assert store.get(queued)["run_after"] > later
    again = store.claim_next(w, now=T0 + 1)
    assert again is not None and again.job_id == queued, "a backoff measured from a time not yet come"
    # a dead worker's heartbeat "in the future": a candidate now, reaped by its PID
    dead_job, _ = store.submit(["true"], now=T0)
    _, dc = claim_as(store, dead_pid(procs), now=later)
    assert dc.job_id == dead_job
    assert [x.job_id for x in store.reap_candidates(now=T0 + 2)] == [dead_job], "the live one is not stale"
    results = reaper.reap_pass(store, now=T0 + 2)
    assert [(r.job_id, r.verdict, r.new_state) for r in results] == [(dead_job, reaper.DEAD, states.QUEUED)]
    # a live worker with a heartbeat in the future is probed and left alone
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "spoolctl", "worker"])
    wait_until(lambda: "spoolctl" in (reaper.read_cmdline(p.pid) or []), 5)
    _, lc = claim_as(store, p.pid, now=later)
    assert lc.job_id == dead_job
    results = reaper.reap_pass(store, now=T0 + 3)
    assert [(r.job_id, r.verdict, r.new_state) for r in results] == [(lc.job_id, reaper.ALIVE, None)]


# --- liveness -------------------------------------------------------------------

def test_liveness_dead_pid(procs):
    assert reaper.liveness(dead_pid(procs), HOST) == reaper.DEAD


def test_liveness_alive_with_marker(procs):
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "-m", "spooler", "worker"])
    wait_until(lambda: reaper.read_cmdline(p.pid) and "spooler" in reaper.read_cmdline(p.pid), 5)
    assert reaper.liveness(p.pid, HOST) == reaper.ALIVE


def test_liveness_recycled_pid_without_marker(procs):
    p = procs(["sleep", "60"])
    wait_until(lambda: reaper.read_cmdline(p.pid) == ["sleep", "60"], 5)
    assert reaper.liveness(p.pid, HOST) == reaper.RECYCLED


def test_liveness_permission_denied_is_inconclusive():
    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")
    assert reaper.liveness(12345, HOST, kill=kill) == reaper.INCONCLUSIVE


def test_marker_matches_console_script_and_module_forms():
    assert reaper.is_spoolctl_argv(["/venv/bin/python", "/venv/bin/spoolctl", "worker"])
    assert reaper.is_spoolctl_argv(["python3", "-m", "spooler", "worker"])
    assert reaper.is_spoolctl_argv(["python3", "-m", "spooler.jobs", "worker"])
    assert not reaper.is_spoolctl_argv(["python3", "-m", "spoolerx"])
    assert not reaper.is_spoolctl_argv(["sleep", "60"])
    assert not reaper.is_spoolctl_argv(["spooler-node", "--id", "n1"])


# --- the reap ---------------------------------------------------------------------

def test_dead_worker_job_is_requeued_with_crash_count_and_reason(store, procs):
    job_id, _ = store.submit(["true"])
    _, c = claim_as(store, dead_pid(procs))
    results = reaper.reap_pass(store, now=T0 + 31)
    assert [(r.job_id, r.verdict, r.new_state) for r in results] == [(job_id, reaper.DEAD, states.QUEUED)]
    job = store.get(job_id)
    assert job["state"] == "queued" and job["crash_count"] == 1 and job["failure_count"] == 0
    assert job["failure_reason"] == "worker_crashed" and job["worker"] is None
    a = job["attempts"][0]
    assert a["failure_reason"] == "worker_crashed" and a["finished_at"] == T0 + 31
    assert "dead" in a["detail"]
    # requeued at once: claimable again, as attempt 2
    assert store.claim_next(WorkerIdentity.current(5.0), now=T0 + 31).n == 2


def test_the_orphan_is_killed_before_its_job_is_requeued(store, procs, monkeypatch):
    """J2: the dead worker's command is stopped while its job still reads running
    (its attempt open), so no other worker can claim a new attempt while the old
    one still runs; the requeue comes after."""
    job_id, _ = store.submit(["true"])
    _, c = claim_as(store, dead_pid(procs))
    seen = []

    def kill_orphans(pgid, token):
        job = store.get(job_id)
        seen.append((token, job["state"], job["attempts"][-1]["finished_at"]))

    monkeypatch.setattr(reaper.executor, "kill_orphans", kill_orphans)
    [r] = reaper.reap_pass(store, now=T0 + 31)
    assert (r.verdict, r.new_state) == (reaper.DEAD, states.QUEUED)
    assert seen == [(f"{job_id}:1", "running", None)], seen
    assert store.get(job_id)["state"] == "queued"


def test_recycled_pid_job_is_reaped(store, procs):
    job_id, _ = store.submit(["true"])
    p = procs(["sleep", "60"])
    claim_as(store, p.pid)
    wait_until(lambda: reaper.read_cmdline(p.pid) == ["sleep", "60"], 5)
    [r] = reaper.reap_pass(store, now=T0 + 31)
    assert (r.verdict, r.new_state) == (reaper.RECYCLED, states.QUEUED)
    assert store.get(job_id)["crash_count"] == 1


def test_alive_worker_job_is_left_alone(store, procs):
    job_id, _ = store.submit(["true"])
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "spoolctl", "worker"])
    claim_as(store, p.pid)
    wait_until(lambda: "spoolctl" in (reaper.read_cmdline(p.pid) or []), 5)
    [r] = reaper.reap_pass(store, now=T0 + 3600)
    assert (r.verdict, r.new_state) == (reaper.ALIVE, None)
    assert store.get(job_id)["state"] == "running" and store.get(job_id)["crash_count"] == 0


def test_permission_denied_worker_job_is_left_alone(store):
    job_id, _ = store.submit(["true"])
    claim_as(store, 4242)

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")
    [r] = reaper.reap_pass(store, now=T0 + 3600, kill=kill)
    assert (r.verdict, r.new_state) == (reaper.INCONCLUSIVE, None)
    assert store.get(job_id)["state"] == "running"


def test_other_host_worker_is_never_judged(store, procs):
    job_id, _ = store.submit(["true"])
    w = WorkerIdentity("elsewhere:1:x", dead_pid(procs), "elsewhere", 5.0)
    store.claim_next(w, now=T0)
    [r] = reaper.reap_pass(store, now=T0 + 3600)
    assert r.new_state is None and store.get(job_id)["state"] == "running"


def test_reap_rechecks_staleness_inside_the_transaction(store, procs, monkeypatch):
    """The worker heartbeats between the candidate scan and the reap: untouched, and
    its command is not killed either (the kill used to come before the re-check, so
    a hung worker that woke in that gap kept its job with its command killed, and
    recorded that against its retries)."""
    job_id, _ = store.submit(["true"])
    w, c = claim_as(store, dead_pid(procs))
    killed = []
    monkeypatch.setattr(reaper.executor, "kill_orphans", lambda pgid, token: killed.append(token))
    other = Store(store.spool_dir)
    try:
        def kill(pid, sig):   # the liveness probe runs between scan and reap
            other.heartbeat(w, {(c.job_id, c.n)}, now=T0 + 31)
            raise ProcessLookupError
        [r] = reaper.reap_pass(store, now=T0 + 31, kill=kill)
    finally:
        other.close()
    assert (r.verdict, r.new_state) == (reaper.DEAD, None)
    job = store.get(job_id)
    assert job["state"] == "running" and job["crash_count"] == 0 and job["attempts"][0]["finished_at"] is None
    assert killed == []


def test_no_heartbeat_lands_between_the_reap_s_recheck_and_its_kill(store, procs, monkeypatch):
    """The kill runs inside the reap's transaction, which holds the spool's write
    lock: a worker waking during the kill cannot heartbeat until the reap has
    committed, and then learns it lost the attempt (its command is the one killed).
    With the kill before the re-check, the heartbeat went in first and the reap
    left the job, its command killed all the same."""
    job_id, _ = store.submit(["true"])
    w, c = claim_as(store, dead_pid(procs))
    other = Store(store.spool_dir)
    beat: dict = {}

    def wakes():
        beat["lost"] = other.heartbeat(w, {(c.job_id, c.n)}, now=T0 + 31)

    t = threading.Thread(target=wakes)

    def kill_orphans(pgid, token):
        t.start()
        t.join(1.0)  # time enough for the heartbeat to go in, were the lock not held
        beat["during_kill"] = dict(beat)

    monkeypatch.setattr(reaper.executor, "kill_orphans", kill_orphans)
    try:
        [r] = reaper.reap_pass(store, now=T0 + 31)
        t.join(30)
    finally:
        other.close()
    assert beat["during_kill"] == {}  # it waited for the lock
    assert (r.verdict, r.new_state) == (reaper.DEAD, states.QUEUED)
    assert beat["lost"] == {(c.job_id, c.n)}


def test_reap_rechecks_ownership_inside_the_transaction(store, procs):
    """Another reaper requeued it and a worker reclaimed it (attempt 2): a late reap of
    the attempt-1 candidate must not touch attempt 2, even though it is stale too."""
    job_id, _ = store.submit(["true"])
    claim_as(store, dead_pid(procs))
    [cand] = store.reap_candidates(now=T0 + 31)
    assert store.reap(cand, "first reaper", now=T0 + 31) == states.QUEUED
    claim_as(store, dead_pid(procs), now=T0 + 31)
    assert store.reap(cand, "late reaper", now=T0 + 100) is None
    job = store.get(job_id)
    assert job["state"] == "running" and job["crash_count"] == 1 and len(job["attempts"]) == 2


def test_max_crashes_exhausted_goes_dead(store, procs):
    job_id, _ = store.submit(["true"], max_crashes=1)
    now = T0
    for expected in (states.QUEUED, states.DEAD):
        claim_as(store, dead_pid(procs), now=now)
        [r] = reaper.reap_pass(store, now=now + 31)
        assert r.new_state == expected
        now += 31
    job = store.get(job_id)
    assert job["state"] == "dead" and job["crash_count"] == 2 and job["failure_reason"] == "worker_crashed"
    assert job["failure_count"] == 0, "crashes must not spend the job's own retry budget"


def test_retry_force_starts_the_crash_budget_afresh(store, spool, procs):
    """J4: a job made dead by crashes (--max-crashes spent) and retried with
    `retry --force` has crash_count 0 again, so its next crash requeues it
    instead of making it dead at once. (Both fixtures use the same spool.)"""
    job_id, _ = store.submit(["true"], max_crashes=1)
    now = time.time()
    for expected in (states.QUEUED, states.DEAD):   # crash 1 requeues, crash 2 is past the budget
        claim_as(store, dead_pid(procs), now=now)
        [r] = reaper.reap_pass(store, now=now + 31)
        assert r.new_state == expected
        now += 31
    assert (store.get(job_id)["state"], store.get(job_id)["crash_count"]) == ("dead", 2)
    job = spool.json("retry", job_id, "--force")
    assert job["state"] == "queued" and job["crash_count"] == 0
    assert spool.job(job_id)["crash_count"] == 0
    # the next crash is the first of a fresh budget of one: requeued, not dead
    now = max(now, time.time()) + 1
    claim_as(store, dead_pid(procs), now=now)
    [r] = reaper.reap_pass(store, now=now + 31)
    assert r.new_state == states.QUEUED, "the forced retry kept the spent crash budget"
    job = spool.job(job_id)
    assert job["state"] == "queued" and job["crash_count"] == 1 and len(job["attempts"]) == 3
    assert [a["failure_reason"] for a in job["attempts"]] == ["worker_crashed"] * 3, "history kept"


def test_a_page_of_live_workers_jobs_does_not_hide_a_dead_workers_job(store, procs):
    """100 stale jobs of a frozen (alive) worker come first by heartbeat: the pass
    judges that worker once, looks past its jobs, and reaps the dead worker's."""
    frozen = procs(["bash", "-c", "exec -a spoolctl-frozen-worker sleep 300"])
    wait_until(lambda: b"spoolctl" in open(f"/proc/{frozen.pid}/cmdline", "rb").read(), 5,
               what="the frozen worker's command line")
    for i in range(100):
        store.submit(["true"], now=T0)
        claim_as(store, frozen.pid, now=T0 + i * 0.001)
    job_id, _ = store.submit(["true"], now=T0)
    claim_as(store, dead_pid(procs), now=T0 + 1)
    results = reaper.reap_pass(store, now=T0 + 100)
    assert [r.job_id for r in results if r.new_state] == [job_id]
    assert store.get(job_id)["state"] == states.QUEUED
    assert sum(1 for r in results if r.verdict == reaper.ALIVE) == 100  # each of its jobs left alone


def test_orphan_without_recorded_pid_is_found_by_its_token(store, procs):
    """A worker that dies within 50 ms of spawning its command never wrote the
    command's pid: the reaper finds the command by its attempt token alone, and
    leaves a process carrying another attempt's token alone."""
    from spooler.jobs import executor
    job_id, _ = store.submit(["sleep", "60"])
    _, c = claim_as(store, dead_pid(procs))
    assert store.get(job_id)["attempts"][0]["pid"] is None
    mine, other = [subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL,
                                    env={**os.environ, executor.ATTEMPT_ENV: tok})
                   for tok in (f"{job_id}:{c.n}", f"{job_id}:{c.n + 1}")]
    try:
        wait_until(lambda: all(executor.ATTEMPT_ENV.encode() in open(f"/proc/{p.pid}/environ", "rb").read()
                               for p in (mine, other)), 5, what="both processes exec'd with their tokens")
        [r] = reaper.reap_pass(store, now=T0 + 31)
        assert r.new_state == states.QUEUED
        wait_until(lambda: mine.poll() is not None, 5, what="the orphan killed by its token")
        assert other.poll() is None, "a process of another attempt was killed"
    finally:
        for p in (mine, other):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_cancel_of_a_running_attempt_without_a_pid_kills_it_by_its_token(store, procs):
    """The worker died before it wrote its command's pid, then the operator cancels:
    the command is found by its attempt token and killed, the attempt closed
    (nothing else would: the reaper never looks at a canceled job)."""
    from spooler.cli import main
    from spooler.jobs import executor
    job_id, _ = store.submit(["sleep", "60"])
    _, c = claim_as(store, dead_pid(procs), now=time.time())
    mine = subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, executor.ATTEMPT_ENV: f"{job_id}:{c.n}"})
    try:
        wait_until(lambda: executor.ATTEMPT_ENV.encode() in open(f"/proc/{mine.pid}/environ", "rb").read(), 5,
                   what="the command exec'd with its token")
        assert main(["--spool", store.spool_dir, "cancel", job_id]) == 0
        wait_until(lambda: mine.poll() is not None, 5, what="the command killed by its token")
        job = store.get(job_id)
        assert job["state"] == states.CANCELED
        assert job["attempts"][0]["finished_at"] is not None and job["attempts"][0]["failure_reason"] == "canceled"
    finally:
        if mine.poll() is None:
            mine.kill()
        mine.wait(timeout=10)


def test_a_heartbeat_names_the_attempt_it_lost_not_the_job_claimed_again(store):
    """An attempt that ended and its job claimed again by the same worker: a
    heartbeat taken with the first attempt in hand names that attempt lost, and
    the second stays its own (by job id alone, the second was stopped as canceled)."""
    job_id, _ = store.submit(["false"], max_retries=1)
    w, c1 = claim_as(store, os.getpid())
    store.finish_attempt(c1, states.NONZERO_EXIT, 1, now=T0 + 1)
    c2 = store.claim_next(w, now=T0 + 10)  # past its backoff
    assert (c2.job_id, c2.n) == (job_id, 2)
    assert store.heartbeat(w, {(job_id, 1), (job_id, 2)}, now=T0 + 11) == {(job_id, 1)}


@pytest.mark.parametrize("reason", [states.CANCELED_REASON, states.LEASE_LOST])
def test_an_attempt_its_worker_stopped_for_a_loss_that_did_not_happen_is_requeued_free(store, reason):
    """Still the worker's when it reports a cancel (or lost lease): not a ValueError
    that kills the worker's slot and leaves the job running, but a requeue that
    spends neither the retry nor the crash budget."""
    job_id, _ = store.submit(["true"])
    w, c = claim_as(store, os.getpid())
    assert store.finish_attempt(c, reason, -9, now=T0 + 1) == states.QUEUED
    job = store.get(job_id)
    assert (job["failure_count"], job["crash_count"]) == (0, 0)
    assert job["attempts"][0]["failure_reason"] == states.WORKER_STOPPED


def test_a_loss_seen_for_an_ended_attempt_stops_no_later_attempt_of_its_job(tmp_path):
    """The heartbeat's snapshot held attempt 1; attempt 1 ended and the job's retry
    (attempt 2) began before the heartbeat's answer came: that answer stops neither."""
    from spooler.jobs import knobs
    from spooler.jobs.worker import Worker

    w = Worker(str(tmp_path / "spool"), settings=knobs.Settings())
    w._owned = {("j", 2)}
    w._note_lost({("j", 1)})
    assert w._should_stop(("j", 2)) is None and not w._lost
    w._note_lost({("j", 2)})
    assert w._should_stop(("j", 2)) == states.CANCELED_REASON


def test_an_attempt_canceled_before_its_pid_was_written_is_stopped_by_its_worker(tmp_path):
    """record_pid finds the attempt no longer the worker's (canceled in its first
    moments, when cancel had no pid to kill): the worker stops it at once instead
    of at its next heartbeat, and its retry is not touched."""
    from spooler.jobs import knobs
    from spooler.jobs.worker import Worker

    spool = str(tmp_path / "spool")
    store = Store(spool)
    try:
        job_id, _ = store.submit(["sleep", "30"])
        w = Worker(spool, settings=knobs.Settings(heartbeat_interval_s=3600.0))
        real = store.record_pid

        def canceled_first(claim, pid):
            other = Store(spool)  # (a connection of its own, as spoolctl cancel's)
            try:
                other.cancel(claim.job_id)
            finally:
                other.close()
            return real(claim, pid)

        store.record_pid = canceled_first
        claim = store.claim_next(w.identity)
        t = time.monotonic()
        w._execute(store, claim)
        assert time.monotonic() - t < 10, "the canceled command ran on"
        assert not w._owned and not w._lost
        assert store.get(job_id)["state"] == states.CANCELED
    finally:
        store.close()


def test_a_heartbeat_that_fails_for_good_stops_its_worker(tmp_path, capfd):
    """The heartbeat meets an error that is not a busy spool (here an I/O error):
    the worker stops (its running attempt ends as worker_stopped, requeued without
    spending a retry) and says why, instead of running on without heartbeats, blind
    to cancels and losses."""
    import apsw
    from spooler.jobs import knobs
    from spooler.jobs.worker import Worker

    spool = str(tmp_path / "spool")
    store = Store(spool)
    try:
        job_id, _ = store.submit(["sleep", "30"])
        w = Worker(spool, settings=knobs.Settings(heartbeat_interval_s=0.05))

        def broken(self, worker, pairs):
            raise apsw.IOError("disk I/O error")

        out = {}
        real = Store.heartbeat
        Store.heartbeat = broken
        try:
            t = threading.Thread(target=lambda: out.setdefault("summary", w.run()))
            t.start()
            t.join(timeout=15)
            ran_on = t.is_alive()
            w.stop()
            t.join(timeout=30)
            assert not t.is_alive(), "the worker did not end once told to stop"
        finally:
            Store.heartbeat = real
        assert not ran_on, "the worker ran on without heartbeats"
        summary = out["summary"]
        assert any("IOError" in e for e in summary["errors"])
        assert "heartbeat failed" in capfd.readouterr().err
        job = store.get(job_id)
        assert job["state"] == states.QUEUED and (job["failure_count"], job["crash_count"]) == (0, 0)
        assert job["attempts"][0]["failure_reason"] == states.WORKER_STOPPED
    finally:
        store.close()


# --- the whole cycle with real processes ---------------------------------------------

def test_sigkilled_worker_job_is_reaped_and_rerun(spool, tmp_path):
    """J2, and J6: what the first attempt wrote before its worker died is kept in
    that attempt's files (the command writes them itself, nothing is held in the
    worker)."""
    first = tmp_path / "first.pid"
    script = (f'if [ "$SPOOLCTL_ATTEMPT" = 1 ]; then echo before-crash; echo on-stderr >&2; echo $$ > {first}; '
              f'sleep 300; fi; echo attempt $SPOOLCTL_ATTEMPT')
    job_id = spool.submit("sh", "-c", script)
    w1 = spool.start_worker()
    wait_until(lambda: first.exists() and first.read_text().strip(), 15, what="attempt 1 running")
    orphan = int(first.read_text())
    wait_until(lambda: spool.job(job_id)["attempts"][0]["pid"], 10, what="attempt pid recorded")
    w1.send_signal(signal.SIGKILL)
    w1.wait(timeout=10)
    assert not pid_gone(orphan), "the job's own session outlives its worker"
    # a second worker reaps (heartbeat 1 s stale, PID dead), kills the orphan, reruns
    spool.run("worker", "--drain", "--json", timeout_s=60)
    job = spool.job(job_id)
    assert job["state"] == "succeeded" and job["crash_count"] == 1
    a1, a2 = job["attempts"]
    assert a1["failure_reason"] == "worker_crashed" and a1["exit_code"] is None
    assert a2["exit_code"] == 0
    assert spool.run("output", job_id).stdout == b"attempt 2\n"
    assert spool.run("output", job_id, "--attempt", "1").stdout == b"before-crash\n"
    assert spool.run("output", job_id, "--attempt", "1", "--stderr").stdout == b"on-stderr\n"
    wait_until(lambda: pid_gone(orphan), 5, what="orphaned attempt killed by the reaper")


def test_a_hung_worker_is_reaped_once_its_heartbeat_was_watched_standing_still(spool, tmp_path):
    """Seed 000: a worker alive but hung (here SIGSTOPped: its PID probes alive with
    the marker) is eventually reaped. Another worker watches its stale heartbeat
    stand still for ten of its own reap thresholds (0.3 s here, so 3 s), on its own
    monotonic clock, then reaps it: the command is killed and the job runs again.
    Woken afterwards, the hung worker finds its attempt gone and leaves the job alone,
    and its summary counts that attempt nowhere (it is not the job's failure)."""
    first = tmp_path / "first.pid"
    script = (f'if [ "$SPOOLCTL_ATTEMPT" = 1 ]; then echo $$ > {first}; sleep 300; fi; echo attempt $SPOOLCTL_ATTEMPT')
    job_id = spool.submit("sh", "-c", script)
    w1 = spool.start_worker("--json", stdout=subprocess.PIPE)
    try:
        wait_until(lambda: first.exists() and first.read_text().strip(), 15, what="attempt 1 running")
        orphan = int(first.read_text())
        wait_until(lambda: spool.job(job_id)["attempts"][0]["pid"], 10, what="attempt pid recorded")
        # (not inside a heartbeat's transaction: frozen there, it would hold the
        # write lock, and nobody could reap it: J2's failure mode, not this test)
        spool.freeze_outside_write_lock(w1)
        began = time.monotonic()
        r = spool.run("worker", "--drain", "--json", env={"SPOOLCTL_TEST_REAP_THRESHOLD": "0.3"}, timeout_s=60)
        took = time.monotonic() - began
        assert json.loads(r.stdout)["reaped"] == 1, r
        # not before its heartbeat stood still for ten thresholds (a lower bound only:
        # a slow machine makes it later, never earlier)
        assert took >= 10 * 0.3, took
        job = spool.job(job_id)
        assert job["state"] == "succeeded" and job["crash_count"] == 1, job
        a1, a2 = job["attempts"]
        assert a1["failure_reason"] == "worker_crashed" and "hung" in a1["detail"], a1
        assert spool.run("output", job_id).stdout == b"attempt 2\n"
        wait_until(lambda: pid_gone(orphan), 5, what="the hung worker's command killed by the reaper")
        w1.send_signal(signal.SIGCONT)
        w1.send_signal(signal.SIGTERM)
        out, _ = w1.communicate(timeout=30)
        job = spool.job(job_id)
        assert job["state"] == "succeeded" and len(job["attempts"]) == 2, job
        summary = json.loads(out)
        assert (summary["claimed"], summary["failed"], summary["succeeded"], summary["stopped"]) == (1, 0, 0, 0), \
            summary
    finally:
        if w1.poll() is None:
            w1.send_signal(signal.SIGCONT)
            w1.kill()
            w1.wait(timeout=10)


def test_the_hung_watch_counts_only_its_own_clock_and_a_standing_heartbeat(store, procs):
    """The watch starts when the reaping worker first sees the stale heartbeat, on its
    monotonic clock (a suspended machine adds nothing), and starts again when the
    heartbeat moves. Without a watch (or with a PID that does not probe alive) the
    verdicts are as before."""
    clock = [100.0]
    watch = reaper.HungWatch(5.0, clock=lambda: clock[0])
    job_id, _ = store.submit(["true"])
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "spoolctl", "worker"])
    wait_until(lambda: "spoolctl" in (reaper.read_cmdline(p.pid) or []), 5)
    w, c = claim_as(store, p.pid)
    [r] = reaper.reap_pass(store, now=T0 + 3600, watch=watch)  # an hour stale by the wall clock
    assert (r.verdict, r.new_state) == (reaper.ALIVE, None), "the wall clock's gap counts for nothing"
    clock[0] += 4.9
    [r] = reaper.reap_pass(store, now=T0 + 3600, watch=watch)
    assert (r.verdict, r.new_state) == (reaper.ALIVE, None)
    store.heartbeat(w, {(c.job_id, c.n)}, now=T0 + 10)  # it moved: the watch starts again
    clock[0] += 0.2
    [r] = reaper.reap_pass(store, now=T0 + 3600, watch=watch)
    assert (r.verdict, r.new_state) == (reaper.ALIVE, None)
    clock[0] += 5.0
    [r] = reaper.reap_pass(store, now=T0 + 3600, watch=watch)
    assert (r.verdict, r.new_state) == (reaper.HUNG, states.QUEUED)
    job = store.get(job_id)
    assert job["crash_count"] == 1 and job["failure_reason"] == "worker_crashed"
    assert reaper.reap_pass(store, now=T0 + 3600) == []  # (requeued: no candidate left)


def test_live_worker_is_not_reaped_while_running(spool, tmp_path):
    """Heartbeats (every 0.05 s here) keep a long job alive well past the 0.2 s
    threshold, and past the 2 s (ten thresholds) after which another worker takes
    a live worker whose heartbeat stands still for a hung one: its PID probing
    alive is not enough to keep the job, only its heartbeats do. The job's
    state is watched while it runs, and a reap fails the test at once."""
    env = {"SPOOLCTL_TEST_HEARTBEAT_INTERVAL": "0.05", "SPOOLCTL_TEST_REAP_THRESHOLD": "0.2"}
    job_id = spool.submit("sleep", "4")
    w1 = spool.start_worker(env=env)
    st = Store(spool.path)
    try:
        wait_until(lambda: st.get(job_id)["state"] == "running", 15, what="the job running")
        w2 = spool.start_worker("--drain", env=env)
        deadline = time.monotonic() + 30
        while w2.poll() is None:
            job = st.get(job_id)
            assert job["crash_count"] == 0 and len(job["attempts"]) == 1, (
                "the live worker's job was reaped: "
                f"{[(a['n'], a['failure_reason'], a['detail']) for a in job['attempts']]}")
            assert time.monotonic() < deadline, f"the --drain worker had not exited 30 s after the job's start: {job}"
            time.sleep(0.05)
        assert w2.returncode == 0
        job = st.get(job_id)
        assert job["state"] == "succeeded" and job["crash_count"] == 0 and len(job["attempts"]) == 1, job
    finally:
        st.close()
        for w in spool.procs:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
                w.wait(timeout=15)


# --- a pid taken over by another spoolctl process (found by an outside audit) ------

def test_a_pid_reused_by_another_spoolctl_process_is_recycled_by_its_start_time(store, procs):
    """A worker id carries its process's start time. A worker that died and whose
    pid now belongs to another spoolctl process (a new worker in a restarted
    container, say) passes the command-line check; the start time tells them apart."""
    from spooler.jobs.store import process_start
    job_id, _ = store.submit(["true"])
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "spoolctl", "worker"])
    wait_until(lambda: "spoolctl" in (reaper.read_cmdline(p.pid) or []), 5)
    start = process_start(p.pid)
    assert start is not None
    # the same pid, the marker, and the start time of the process as it is: alive
    assert reaper.liveness(p.pid, HOST, start=start) == reaper.ALIVE
    # a worker that started at another time under this pid is not this process
    w = WorkerIdentity(f"{HOST}:{p.pid}:test:{start - 1}", p.pid, HOST, 5.0)
    store.claim_next(w, now=T0)
    [r] = reaper.reap_pass(store, now=T0 + 31)
    assert (r.verdict, r.new_state) == (reaper.RECYCLED, states.QUEUED)
    assert store.get(job_id)["crash_count"] == 1


def test_a_worker_id_names_its_start_time():
    from spooler.jobs.store import process_start, start_of
    w = WorkerIdentity.current(5.0)
    assert start_of(w.worker_id) == process_start(os.getpid()) is not None
    assert start_of(f"{HOST}:123:abcd1234") is None  # ids written before carry none


def test_a_cluster_row_never_touched_since_its_start_is_not_judged_hung(store, procs):
    """A --queue worker of spoolctl before 0.4.18 records its running jobs but never
    heartbeats them. Sharing a spool with this version's workers, whose reapers now
    read cluster rows too, its live worker must not be taken for a hung one: a
    cluster row whose heartbeat is still its attempt's start is not judged hung.
    Once touched (this version's --queue workers touch theirs every renewal), a
    heartbeat that then stands still is watched as any other."""
    clock = [100.0]
    watch = reaper.HungWatch(5.0, clock=lambda: clock[0])
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "spoolctl", "worker", "--queue", "q"])
    wait_until(lambda: "spoolctl" in (reaper.read_cmdline(p.pid) or []), 5)
    w = WorkerIdentity(f"{HOST}:{p.pid}:test", p.pid, HOST, 5.0)
    c = store.begin_remote(w, "m1", "http://n/v1/queues/q", ["true"], None, 0, 3, None, now=T0)
    for _ in range(3):
        [r] = reaper.reap_pass(store, now=T0 + 3600, watch=watch)
        assert (r.verdict, r.new_state) == (reaper.ALIVE, None), r
        clock[0] += 5.0
    assert store.get("m1")["state"] == "running"
    store.heartbeat(w, {(c.job_id, c.n)}, now=T0 + 10)  # a worker that heartbeats: judged as any
    [r] = reaper.reap_pass(store, now=T0 + 3600, watch=watch)
    assert (r.verdict, r.new_state) == (reaper.ALIVE, None)
    clock[0] += 5.0
    [r] = reaper.reap_pass(store, now=T0 + 3600, watch=watch)
    assert (r.verdict, r.new_state) == (reaper.HUNG, states.QUEUED), r
    assert store.get("m1")["attempts"][0]["failure_reason"] == "worker_crashed"


def test_a_cluster_row_is_watched_from_its_commands_start_not_from_its_first_periodic_heartbeat(store, procs):
    """The worker touches its row when it records its command's pid: a worker that
    hangs after that, before its first periodic heartbeat (a heartbeat interval, 5 s
    by default, after the worker started), is judged hung as any other once the
    heartbeat has stood still long enough. (The row was left as at its start, the
    mark of spoolctl before 0.4.18, which the reaper spares for good.)"""
    clock = [100.0]
    watch = reaper.HungWatch(5.0, clock=lambda: clock[0])
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "spoolctl", "worker", "--queue", "q"])
    wait_until(lambda: "spoolctl" in (reaper.read_cmdline(p.pid) or []), 5)
    w = WorkerIdentity(f"{HOST}:{p.pid}:test", p.pid, HOST, 5.0)
    c = store.begin_remote(w, "m3", "http://n/v1/queues/q", ["true"], None, 0, 3, None, now=time.time())
    assert store.record_pid(c, 4_000_000) is True
    [r] = reaper.reap_pass(store, now=time.time() + 3600, watch=watch)
    assert (r.verdict, r.new_state) == (reaper.ALIVE, None), r  # first seen: watched from now
    clock[0] += 5.0
    [r] = reaper.reap_pass(store, now=time.time() + 3600, watch=watch)
    assert (r.verdict, r.new_state) == (reaper.HUNG, states.QUEUED), r
    assert store.get("m3")["attempts"][0]["failure_reason"] == "worker_crashed"


def test_a_cluster_rows_result_is_not_written_over_a_reap_that_came_first(store):
    """finish_remote checks, in its own transaction, that the attempt is still its
    worker's running one: a reap that closed it between the worker's own check and
    its write stands (the worker had been stopped in between)."""
    w = WorkerIdentity(f"{HOST}:999999:test", 999_999, HOST, 5.0)
    c = store.begin_remote(w, "m2", "http://n/v1/queues/q", ["true"], None, 0, 3, None, now=T0)
    [cand] = store.reap_candidates(now=T0 + 3600)
    assert store.reap(cand, "worker pid 999999 is dead", now=T0 + 3600) == states.QUEUED
    assert store.finish_remote(c, states.NONZERO_EXIT, 3, states.QUEUED, 0, "failed") is False
    job = store.get("m2")
    assert job["attempts"][0]["failure_reason"] == "worker_crashed" and job["failure_reason"] == "worker_crashed"
    c2 = store.begin_remote(w, "m2", "http://n/v1/queues/q", ["true"], None, 0, 3, None, now=T0 + 3601)
    assert store.finish_remote(c2, None, 0, states.SUCCEEDED, 1) is True
    assert store.get("m2")["state"] == "succeeded"
