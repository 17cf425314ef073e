"""Execution: success, failure, timeout with grandchildren killed, spawn failure,
backoff delays, dead and retry --force, cancel (queued and running)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from jobs_helpers import pid_gone, spool, stop_worker, wait_until  # noqa: F401
from spooler.jobs import executor, knobs, states
from spooler.jobs.store import Store, WorkerIdentity

T0 = 1_800_000_000.0


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "spool"))
    try:
        yield s
    finally:
        s.close()


def kill_group_of(pgid, *pids):
    """Test cleanup by pid: the attempt's group and any pid it reported, only while
    they still run (once gone, their ids may be other processes' by now)."""
    for fn, target, running in [(os.killpg, pgid, executor.group_alive)] + [(os.kill, p, lambda q: not pid_gone(q))
                                                                              for p in pids]:
        try:
            if target and running(target):
                fn(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_bounded(argv, tmp_path, timeout_s=None, grace_s=knobs.TERM_GRACE_S, limit_s=None, **kw):
    """``executor.run`` given a deadline to return by: its own timeout, the grace
    before the SIGKILL and the grace after it, and 5 s more (``limit_s`` for a
    run that must end by other means). A regression that leaves the runner waiting
    on a command that never ends (no kill, no SIGKILL after the grace) fails the
    test then, with the attempt's group SIGKILLed by the test, instead of after
    the command's own 300 s."""
    if limit_s is None:
        limit_s = timeout_s + 2 * grace_s + 5.0
    spawned, out = [], {}
    on_spawn = kw.pop("on_spawn", lambda pid: None)

    def record(pid):
        spawned.append(pid)
        on_spawn(pid)

    def target():
        try:
            out["res"] = executor.run(argv, str(tmp_path / "o"), str(tmp_path / "e"), timeout_s=timeout_s,
                                      grace_s=grace_s, on_spawn=record, **kw)
        except BaseException as e:   # re-raised in the test's thread
            out["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        for pid in spawned:
            kill_group_of(pid)
        t.join(10)
        pytest.fail(f"executor.run had not returned {limit_s:g}s after the command started (timeout_s="
                    f"{timeout_s}, grace_s={grace_s}): the runner still waited on a command its kill"
                    f" should have ended; the test SIGKILLed the group {spawned}")
    if "err" in out:
        raise out["err"]
    return out["res"]


def ident(hb=5.0):
    return WorkerIdentity.current(hb)


def run_claim(store, claim, **kw):
    res = executor.run(claim.command, claim.stdout, claim.stderr, claim.timeout_s, cwd=claim.cwd, **kw)
    return res, store.finish_attempt(claim, res.reason, res.exit_code, res.detail)


# --- success and failure ------------------------------------------------------

def test_success_records_exit_code_and_output(store, tmp_path):
    job_id, _ = store.submit(["sh", "-c", "echo out; echo err >&2"], cwd=str(tmp_path))
    claim = store.claim_next(ident())
    res, state = run_claim(store, claim)
    assert (res.reason, res.exit_code, state) == (None, 0, states.SUCCEEDED)
    job = store.get(job_id)
    assert job["state"] == "succeeded" and job["failure_reason"] is None
    [a] = job["attempts"]
    assert a["exit_code"] == 0 and a["failure_reason"] is None
    assert open(a["stdout"]).read() == "out\n" and open(a["stderr"]).read() == "err\n"


def test_nonzero_exit_is_a_failure_and_requeued_with_backoff(store):
    job_id, _ = store.submit(["sh", "-c", "exit 7"], max_retries=3)
    claim = store.claim_next(ident(), now=T0)
    res = executor.run(claim.command, claim.stdout, claim.stderr)
    assert (res.reason, res.exit_code) == (states.NONZERO_EXIT, 7)
    assert store.finish_attempt(claim, res.reason, res.exit_code, now=T0 + 1) == states.QUEUED
    job = store.get(job_id)
    assert job["failure_count"] == 1 and job["failure_reason"] == "nonzero_exit"
    assert job["run_after"] == pytest.approx(T0 + 1 + 2.0)
    assert job["attempts"][0]["exit_code"] == 7


# --- backoff and dead ---------------------------------------------------------

def test_backoff_delays_double_then_cap_at_60():
    assert [states.backoff_s(n) for n in range(1, 10)] == [2, 4, 8, 16, 32, 60, 60, 60, 60]
    assert states.backoff_s(10_000) == 60


def test_backoff_delays_gate_claims_then_dead_after_max_retries(store):
    job_id, _ = store.submit(["false"], max_retries=3)
    now = T0
    expected_delays = [2.0, 4.0, 8.0]
    for i, delay in enumerate(expected_delays, start=1):
        claim = store.claim_next(ident(), now=now)
        assert claim is not None and claim.n == i
        assert store.finish_attempt(claim, states.NONZERO_EXIT, 1, now=now) == states.QUEUED
        assert store.get(job_id)["run_after"] == pytest.approx(now + delay)
        assert store.claim_next(ident(), now=now + delay - 0.01) is None, "claimed before its backoff"
        now += delay
    claim = store.claim_next(ident(), now=now)
    assert store.finish_attempt(claim, states.NONZERO_EXIT, 1, now=now) == states.DEAD
    job = store.get(job_id)
    assert job["state"] == "dead" and len(job["attempts"]) == 4 and job["failure_count"] == 4
    assert store.claim_next(ident(), now=now + 3600) is None, "a dead job must not be retried"


def test_dead_job_needs_retry_force(spool):
    job_id = spool.submit("sh", "-c", "exit 3", opts=("--max-retries", "0"))
    spool.run("worker", "--drain", timeout_s=60)
    assert spool.job(job_id)["state"] == "dead"
    r = spool.run("retry", job_id, check=False)
    assert r.returncode != 0 and b"--force" in r.stderr
    assert spool.job(job_id)["state"] == "dead"
    job = spool.json("retry", job_id, "--force")
    assert job["state"] == "queued" and job["failure_count"] == 0
    spool.run("worker", "--drain", timeout_s=60)
    job = spool.job(job_id)
    assert job["state"] == "dead" and len(job["attempts"]) == 2


def test_a_job_submitted_without_budget_flags_gets_the_documented_defaults(spool, store):
    """J4's defaults, as `spoolctl submit` with no flags sets them: max_retries 3
    and max_crashes unbounded (null in the job's JSON). Then, on an injected clock
    (each attempt claimed the moment its backoff ends, no real waiting), the job
    that fails every time runs 4 times and is dead; a job whose worker dies every
    time is requeued after each of 10 crashes, never dead. (Both fixtures use the
    same spool.)"""
    import socket
    import subprocess

    from spooler.jobs import reaper

    host = socket.gethostname()
    failing = spool.json("submit", "--", "false")
    assert (failing["max_retries"], failing["max_crashes"]) == (3, None), failing
    now = time.time() + 1
    runs = 0
    while store.get(failing["id"])["state"] == states.QUEUED:
        now = max(now, store.get(failing["id"])["run_after"])
        claim = store.claim_next(ident(), now=now)
        assert claim is not None and (claim.job_id, claim.n) == (failing["id"], runs + 1)
        runs += 1
        store.finish_attempt(claim, states.NONZERO_EXIT, 1, now=now)
        assert runs <= 10, "the job is never dead"
    job = spool.job(failing["id"])
    assert (job["state"], runs, len(job["attempts"]), job["failure_count"]) == ("dead", 4, 4, 4), job

    crashing = spool.json("submit", "--", "true")
    assert (crashing["max_retries"], crashing["max_crashes"]) == (3, None), crashing
    for n in range(1, 11):
        dead = subprocess.Popen(["true"], stdin=subprocess.DEVNULL)
        dead.wait(timeout=10)
        w = WorkerIdentity(f"{host}:{dead.pid}:test", dead.pid, host, 5.0)
        assert store.claim_next(w, now=now).job_id == crashing["id"]
        [r] = reaper.reap_pass(store, now=now + 31)
        assert (r.job_id, r.new_state) == (crashing["id"], states.QUEUED), f"crash {n}: {r}"
        now += 31
    job = spool.job(crashing["id"])
    assert (job["state"], job["crash_count"], job["failure_count"]) == ("queued", 10, 0), job


def test_a_succeeded_job_is_retried_without_force(spool):
    """The contract asks --force for a dead job only: a succeeded job is requeued
    by a plain retry and runs again, its first attempt kept."""
    job_id = spool.submit("sh", "-c", "echo run $SPOOLCTL_ATTEMPT")
    spool.run("worker", "--drain", timeout_s=60)
    assert spool.job(job_id)["state"] == "succeeded"
    assert spool.json("retry", job_id)["state"] == "queued"
    spool.run("worker", "--drain", timeout_s=60)
    job = spool.job(job_id)
    assert job["state"] == "succeeded" and len(job["attempts"]) == 2
    assert spool.run("output", job_id).stdout == b"run 2\n"


def test_failure_then_success_end_to_end(spool, tmp_path):
    marker = tmp_path / "ran-once"
    job_id = spool.submit("sh", "-c", f"if [ -e {marker} ]; then echo ok; else touch {marker}; exit 1; fi")
    spool.run("worker", "--drain", timeout_s=60)
    job = spool.job(job_id)
    assert job["state"] == "succeeded"
    a1, a2 = job["attempts"]
    assert (a1["exit_code"], a1["failure_reason"]) == (1, "nonzero_exit")
    assert (a2["exit_code"], a2["failure_reason"]) == (0, None)
    assert a2["started_at"] - a1["finished_at"] >= 2.0 - 0.05, "the 2 s backoff was not respected"


# --- timeout and process groups -------------------------------------------------

def test_timeout_kills_the_whole_group_including_grandchildren(tmp_path):
    gc = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {gc}; sleep 300"
    t0 = time.monotonic()
    # (2 s: the shell has started its grandchild and written its pid by then, also when slow)
    res = run_bounded(["sh", "-c", script], tmp_path, timeout_s=2.0, limit_s=8.0)
    gpid = int(gc.read_text()) if gc.exists() else None
    try:  # (the grandchild is ended below also when an assertion fails)
        assert res.reason == states.TIMEOUT and res.exit_code == -signal.SIGTERM
        assert time.monotonic() - t0 < 8.0
        assert gpid is not None, "the shell never wrote its grandchild's pid"
        wait_until(lambda: pid_gone(gpid), 5.0, what="grandchild killed")
    finally:
        kill_group_of(res.pid, gpid)


def escape_to_own_group(gc) -> str:
    """Shell that starts a member which moves to a process group of its own
    (setpgid, as GNU timeout and job-control shells do; still in the attempt's
    session), and waits until it has moved: it writes its pid to ``gc`` then."""
    import sys
    code = "import os, sys, time; os.setpgid(0, 0); open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)"
    return f"{sys.executable} -c \"{code}\" {gc} & while [ ! -s {gc} ]; do sleep 0.01; done; "


def test_timeout_kills_a_member_that_moved_to_a_group_of_its_own(tmp_path):
    """A group kill alone missed a descendant in a group of its own (`timeout 100
    cmd` in a job): the attempt was recorded as timed out while it ran on. The kill
    reaches every process of the attempt's session too."""
    gc = tmp_path / "escaped.pid"
    res = run_bounded(["sh", "-c", escape_to_own_group(gc) + "sleep 300"], tmp_path, timeout_s=2.0, grace_s=0.5,
                      limit_s=8.0)
    gpid = int(gc.read_text()) if gc.exists() else None
    try:
        assert res.reason == states.TIMEOUT
        assert gpid is not None, "it never wrote its pid (it writes it once it has moved)"
        wait_until(lambda: pid_gone(gpid), 5.0, what="the member in its own group killed")
    finally:
        kill_group_of(res.pid, gpid)


def test_timeout_escalates_to_sigkill_when_term_is_ignored(tmp_path):
    gc = tmp_path / "gc.pid"
    script = f"trap '' TERM; sh -c 'trap \"\" TERM; sleep 300' & echo $! > {gc}; sleep 300"
    # (1.5 s: the traps are set and the pid written before the TERM, also when slow)
    res = run_bounded(["sh", "-c", script], tmp_path, timeout_s=1.5, grace_s=0.5)
    gpid = int(gc.read_text())
    try:
        assert res.reason == states.TIMEOUT
        assert res.exit_code == -signal.SIGKILL
        wait_until(lambda: pid_gone(gpid), 5.0, what="TERM-ignoring grandchild killed")
    finally:
        kill_group_of(res.pid, gpid)


def test_a_timeout_gives_the_group_its_grace_to_act_on_sigterm(tmp_path):
    """SIGTERM first, then up to the grace for the group to go before SIGKILL: a
    command that cleans up on SIGTERM (0.3 s of it here) finishes its cleanup and
    exits with its own code, instead of being SIGKILLed right after the TERM."""
    import sys
    ready, cleaned = tmp_path / "ready", tmp_path / "cleaned"
    prog = ("import signal, sys, time\n"
            "def term(*_):\n"
            "    time.sleep(0.3)\n"
            "    open(sys.argv[1], 'w').write('cleaned')\n"
            "    sys.exit(3)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "open(sys.argv[2], 'w').write('ready')\n"
            "time.sleep(300)\n")
    # (1.5 s: the handler is set before the TERM, also when slow)
    res = run_bounded([sys.executable, "-c", prog, str(cleaned), str(ready)], tmp_path, timeout_s=1.5,
                      grace_s=3.0)
    try:
        assert ready.exists(), "the command never set its SIGTERM handler"
        assert res.reason == states.TIMEOUT
        assert res.exit_code == 3, f"exit {res.exit_code}: not the command's own exit after its cleanup"
        assert cleaned.read_text() == "cleaned"
    finally:
        kill_group_of(res.pid)


def test_a_stop_the_worker_asks_for_kills_the_whole_group(tmp_path):
    """The kill a worker makes when it stops a running attempt (its own shutdown, a
    cancel seen at its heartbeat, a lost lease: ``should_stop``) is the timeout's:
    the whole group, a grandchild included, not the command alone."""
    gc = tmp_path / "gc.pid"
    script = f"sleep 300 & echo $! > {gc}; sleep 300"

    def should_stop():
        return states.WORKER_STOPPED if gc.exists() and gc.read_text().strip() else None

    # (its 60 s timeout is not what must end it: the stop, within a few polls)
    res = run_bounded(["sh", "-c", script], tmp_path, timeout_s=60, limit_s=15.0, should_stop=should_stop)
    gpid = int(gc.read_text())
    try:
        assert res.reason == states.WORKER_STOPPED
        wait_until(lambda: pid_gone(gpid), 5.0, what="grandchild killed by the worker's stop")
    finally:
        kill_group_of(res.pid, gpid)


def _exited(pid: int) -> bool:
    """Exited and not yet reaped (a zombie): it finished on its own."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("stop_reason", [None, states.CANCELED])
def test_a_command_that_finishes_while_the_runner_decides_keeps_its_own_result(tmp_path, stop_reason):
    """The deadline passes (or a cancel comes) in the moment the command exits on
    its own: it was not stopped, so its exit 0 is a success, not a timeout that
    would spend a retry and run it again. (The check that decides is held here
    until the command has exited.)"""
    spawned = []

    def should_stop():
        if spawned and not getattr(should_stop, "held", False):
            should_stop.held = True
            asked_at = time.monotonic()  # after the runner set its deadline: timeout_s from the spawn
            wait_until(lambda: _exited(spawned[0]), 5.0, what="the command exiting")
            wait_until(lambda: time.monotonic() >= asked_at + 0.1, 5.0, what="the deadline passing")
            return stop_reason
        return None

    res = executor.run(["sleep", "0.15"], str(tmp_path / "o"), str(tmp_path / "e"), timeout_s=0.1,
                       on_spawn=spawned.append, should_stop=should_stop)
    assert spawned and should_stop.held
    assert (res.reason, res.exit_code) == (None, 0), res


def test_timeout_through_the_worker_counts_against_retries(spool):
    job_id = spool.submit("sleep", "30", opts=("--timeout", "0.3", "--max-retries", "0"))
    spool.run("worker", "--drain", timeout_s=60)
    job = spool.job(job_id)
    assert job["state"] == "dead" and job["failure_reason"] == "timeout"
    assert job["attempts"][0]["failure_reason"] == "timeout"


# --- spawn failure --------------------------------------------------------------

def test_spawn_failure_counts_against_retries(store):
    job_id, _ = store.submit(["/nonexistent/definitely-not-here"], max_retries=1)
    claim = store.claim_next(ident(), now=T0)
    res, state = run_claim(store, claim)
    assert res.reason == states.SPAWN_FAILED and res.exit_code is None and "FileNotFoundError" in res.detail
    assert state == states.QUEUED and store.get(job_id)["failure_count"] == 1
    assert "cannot start" in open(claim.stderr).read()
    claim = store.claim_next(ident(), now=time.time() + 10)
    _, state = run_claim(store, claim)
    assert state == states.DEAD
    assert store.get(job_id)["failure_reason"] == "spawn_failed"


# --- cancel ---------------------------------------------------------------------

def test_cancel_queued_job_never_runs(spool, tmp_path):
    flag = tmp_path / "ran"
    job_id = spool.submit("touch", str(flag))
    job = spool.json("cancel", job_id)
    assert job["state"] == "canceled"
    spool.run("worker", "--drain", timeout_s=30)
    job = spool.job(job_id)
    assert job["state"] == "canceled" and job["attempts"] == [] and not flag.exists()


def test_cancel_running_job_kills_its_process_group(spool, tmp_path):
    """J7: `spoolctl cancel` kills a running job's whole group itself. The owning
    worker is stopped (SIGSTOP) meanwhile, so that its own next heartbeat, which
    would also end a canceled attempt, cannot be what killed it."""
    gc = tmp_path / "gc.pid"
    job_id = spool.submit("sh", "-c", f"sleep 300 & echo $! > {gc}; sleep 300")
    w = spool.start_worker()
    try:
        wait_until(lambda: gc.exists() and gc.read_text().strip(), 15, what="job running")
        wait_until(lambda: spool.job(job_id)["attempts"][0]["pid"], 10, what="pid recorded")
        gpid = int(gc.read_text())
        try:
            # (not inside one of its own write transactions, a heartbeat or a reap
            # pass: the spool would stay locked, and the cancel wait, until it went on)
            spool.freeze_outside_write_lock(w)
            r = spool.run("cancel", "--json", job_id, check=False, env={"SPOOLCTL_BUSY_TIMEOUT": "1"})
            assert r.returncode == 0, r
            assert json.loads(r.stdout)["state"] == "canceled"
            wait_until(lambda: pid_gone(gpid), 10, what="grandchild killed by cancel")
        finally:
            os.kill(w.pid, signal.SIGCONT)
        wait_until(lambda: spool.job(job_id)["attempts"][0]["exit_code"] is not None, 10,
                   what="worker recorded the attempt")
        job = spool.job(job_id)
        assert job["state"] == "canceled"
        assert job["attempts"][0]["failure_reason"] == "canceled"
        assert w.poll() is None, "the worker survives a cancel"
    finally:
        stop_worker(w)


@pytest.mark.parametrize("command", [("sleep", "300"), ("env", "-i", "sleep", "300")])
def test_a_worker_counts_a_canceled_job_as_canceled_not_failed(spool, command):
    """The worker's summary: `spoolctl cancel` kills the group itself, so the worker
    may see the attempt end as a signal exit; it is a cancel, not the job's failure.
    A command that cleared its environment carries no attempt token, so `cancel`
    leaves it to the worker, which kills it at its next heartbeat: counted the same."""
    job_id = spool.submit(*command)
    w = spool.start_worker("--drain", "--json")
    try:
        wait_until(lambda: spool.job(job_id)["attempts"] and spool.job(job_id)["attempts"][0]["pid"], 15,
                   what="job running with its pid recorded")
        assert spool.json("cancel", job_id)["state"] == "canceled"
        out, _ = w.communicate(timeout=30)  # --drain: it exits once nothing is queued or running
    finally:
        stop_worker(w)
    summary = json.loads(out)
    assert (summary["canceled"], summary["failed"], summary["succeeded"]) == (1, 0, 0), summary


def test_a_running_job_that_cancel_cannot_recognise_is_stopped_by_its_worker_at_its_next_heartbeat(spool):
    """J7: the owning worker learns of a cancel at its next heartbeat and kills the
    job's group itself. The command cleared its environment (`env -i sleep`), so no
    process carries the attempt's token: `cancel` takes its recorded group for
    another program's and its search by token finds nothing, so it kills nothing,
    and only the worker can stop the command. With the 0.1 s test heartbeat it is
    gone within 2 s of the cancel (a heartbeat, a 0.1 s poll, the SIGTERM), the
    worker still running, and the worker records the attempt's end: killed by its
    SIGTERM, canceled. (In the other J7 tests cancel's own kill does the work, so
    they pass without the heartbeat's part.)"""
    job_id = spool.submit("env", "-i", "sleep", "300")
    w = spool.start_worker()
    pid = None
    try:
        pid = wait_until(lambda: (spool.job(job_id)["attempts"] or [{}])[0].get("pid"), 15,
                         what="job running with its pid recorded")
        # the premise: the group's only member is `sleep`, with an empty environment
        wait_until(lambda: open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"sleep\0"), 10,
                   what="env to exec sleep")
        assert open(f"/proc/{pid}/environ", "rb").read() == b""
        assert executor.group_carries(pid, f"{job_id}:1") is False
        assert spool.json("cancel", job_id)["state"] == "canceled"
        wait_until(lambda: pid_gone(pid), 2.0, what="the worker to stop the canceled command at its heartbeat")
        wait_until(lambda: spool.job(job_id)["attempts"][0]["exit_code"] is not None, 10,
                   what="the worker to record the attempt's end")
        job = spool.job(job_id)
        assert job["state"] == "canceled" and len(job["attempts"]) == 1
        a = job["attempts"][0]
        assert (a["failure_reason"], a["exit_code"]) == ("canceled", -signal.SIGTERM), a
        assert w.poll() is None, "the worker survives the cancel"
    finally:
        stop_worker(w)
        if pid:
            kill_group_of(pid)


def test_cancel_of_a_finished_job_is_refused(spool):
    job_id = spool.submit("true")
    spool.run("worker", "--drain", timeout_s=30)
    r = spool.run("cancel", job_id, check=False)
    assert r.returncode != 0
    assert spool.job(job_id)["state"] == "succeeded"


def test_worker_sigterm_stops_running_job_and_requeues_it(spool, tmp_path):
    started = tmp_path / "started"
    job_id = spool.submit("sh", "-c", f"echo $$ > {started}.tmp; mv {started}.tmp {started}; exec sleep 300")
    w = spool.start_worker()
    try:
        wait_until(started.exists, 15, what="job started")
        job_pid = int(started.read_text())
        rc, _, _ = stop_worker(w)
        assert rc == 0
        job = spool.job(job_id)
        assert job["state"] == "queued" and job["failure_count"] == 0 and job["crash_count"] == 0
        assert job["attempts"][0]["failure_reason"] == "worker_stopped"
        # the worker ended the command before it left: requeued, it must not also run on
        wait_until(lambda: pid_gone(job_pid), 10, what="the stopped job's process to end")
    finally:
        if w.poll() is None:
            w.kill()
        if started.exists() and not pid_gone(int(started.read_text())):
            os.kill(int(started.read_text()), signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_a_job_signalled_with_its_stopping_worker_is_requeued_as_stopped(spool, tmp_path, sig):
    """A service manager's stop signals every process of the unit: the job's
    process may die of the stop's signal (any of the four) before the worker
    kills its group, and before the worker's own signal arrives. That is the
    stop, not the job's failure: no retry is spent, even the last. The worker's
    signal comes only once the worker has collected the dead job, so it is
    judged while the worker waits (up to half a second) for its own stop."""
    started = tmp_path / "started"
    job_id = spool.submit("sh", "-c", f"echo $$ > {started}.tmp; mv {started}.tmp {started}; exec sleep 300",
                          opts=("--max-retries", "0"))
    w = spool.start_worker()
    try:
        wait_until(started.exists, 15, what="job started")
        job_pid = int(started.read_text())
        os.kill(job_pid, sig)  # the job first, as a unit-wide stop may deliver it
        # gone from /proc, not a zombie: its worker has collected it and judges it now
        wait_until(lambda: not os.path.exists(f"/proc/{job_pid}"), 10, 0.005, what="the worker to collect the job")
        w.send_signal(signal.SIGTERM)
        rc, _, _ = stop_worker(w)
        assert rc == 0
        job = spool.job(job_id)
        assert job["attempts"][0]["failure_reason"] == "worker_stopped", job["attempts"]
        assert job["state"] == "queued" and job["failure_count"] == 0 and job["crash_count"] == 0
    finally:
        if w.poll() is None:
            w.kill()


# --- found by an outside audit (2026-11-30) ------------------------------------------

def test_cancel_leaves_alone_a_process_group_that_took_over_the_attempts_id(spool):
    """After a crash (or a reboot) the attempt's recorded group id may be another
    program's: cancel signals the group only while a member carries the attempt's
    token."""
    import subprocess
    import sys
    job_id = spool.submit_direct("sleep", "300")
    st = Store(spool.path)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                stdin=subprocess.DEVNULL, start_new_session=True)
    spool.extra_procs.append(stranger)
    try:
        w = WorkerIdentity("gone:1:test", 1, "gone", 5.0)
        c = st.claim_next(w)
        assert c.job_id == job_id
        st.conn.execute("UPDATE jobs SET worker_host=NULL WHERE id=?", (job_id,))  # judged here, as local
        st.conn.execute("UPDATE attempts SET pid=?, worker_host=NULL WHERE job_id=?", (stranger.pid, job_id))
        # a process of the attempt that left its group (its own session) still
        # carries the attempt's token: that one cancel finds and stops
        stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, executor.ATTEMPT_ENV: f"{job_id}:{c.n}"})
        spool.extra_procs.append(stray)
        wait_until(lambda: executor.ATTEMPT_ENV.encode() in open(f"/proc/{stray.pid}/environ", "rb").read(), 10,
                   what="the stray's environment")
        job = spool.json("cancel", job_id)
        assert job["state"] == "canceled"
        assert stranger.poll() is None, "cancel killed a process group that was not the attempt's"
        assert stray.wait(timeout=10) == -signal.SIGKILL, "cancel left a process of the attempt running"
    finally:
        st.close()
        for proc in (stranger, locals().get("stray")):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=10)


def test_an_output_file_that_cannot_be_made_fails_the_attempt_not_the_worker(spool):
    bad = spool.submit_direct("true", max_retries=0)
    good = spool.submit_direct("true")
    os.makedirs(os.path.join(spool.path, "output"), exist_ok=True)
    with open(os.path.join(spool.path, "output", bad), "w") as f:
        f.write("a file where the attempt's directory should be")
    r = spool.run("worker", "--drain", "--json", timeout_s=60)
    assert json.loads(r.stdout).get("errors") in (None, []), r.stdout
    assert spool.job(good)["state"] == "succeeded"
    b = spool.job(bad)
    assert b["state"] == "dead" and b["attempts"][0]["failure_reason"] == "spawn_failed", b
    assert b["crash_count"] == 0


@pytest.mark.parametrize("script, reason", [
    ("sleep 300 & echo $! > {gc}; exit 0", None),   # a normal end
    ("env -i sleep 300 & echo $! > {gc}; exit 0", None),   # a member that carries no token
    ("sh -c 'trap \"\" TERM; sleep 300' & echo $! > {gc}; sleep 0.3; kill -9 $$", states.NONZERO_EXIT),
    (escape_to_own_group("{gc}") + "exit 0", None),   # a member in a group of its own, in the session
])
def test_what_a_command_leaves_running_in_its_group_ends_with_it(tmp_path, script, reason):
    """The command exits (on its own, or killed) before its timeout and leaves a
    background member of its group running: that member is stopped when the
    attempt ends (SIGKILL after the grace if it ignores SIGTERM), not left to run
    on past the attempt and its timeout."""
    gc = tmp_path / "gc.pid"
    env = {**os.environ, executor.ATTEMPT_ENV: "job:1"}
    # (the command ends on its own: the 60 s timeout must not be what ends the run)
    res = run_bounded(["sh", "-c", script.format(gc=gc)], tmp_path, timeout_s=60, grace_s=0.5, limit_s=10.0,
                      env=env)
    gpid = int(gc.read_text())
    try:
        assert res.reason == reason
        wait_until(lambda: pid_gone(gpid), 5.0, what="the leftover member stopped")
    finally:
        kill_group_of(res.pid, gpid)


def test_a_member_caught_inside_execve_still_counts_as_the_attempts(tmp_path, monkeypatch):
    """``sleep 300 &``: a member can be caught while still inside execve, when /proc
    shows no environment for it (the new image's is not mapped yet). Such a member
    is read again before it counts as not carrying the attempt's token, so a
    cancel (``group_carries``) still takes the group as the attempt's. Here its
    first reads come back empty, as they do in that window."""
    import subprocess
    real, blanks = executor._environ, {}

    def mid_exec(pid):
        if blanks.get(pid, 0) < 3:
            blanks[pid] = blanks.get(pid, 0) + 1
            return b""
        return real(pid)

    env = {**os.environ, executor.ATTEMPT_ENV: "job:1"}
    p = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    try:
        wait_until(lambda: f"{executor.ATTEMPT_ENV}=job:1".encode() in real(p.pid).split(b"\0"), 5.0,
                   what="the command exec'd with its token")
        monkeypatch.setattr(executor, "_environ", mid_exec)
        assert executor.group_carries(p.pid, "job:1") is True
        assert blanks.get(p.pid) == 3, "the member's environment was not read as if mid-exec"
        assert executor.group_carries(p.pid, "job:2") is False
    finally:
        p.kill()
        p.wait(timeout=10)


def test_a_group_whose_leader_lives_is_not_taken_for_leftovers():
    """``end_leftovers`` runs after the attempt's leader was reaped. A group with
    the leader's id whose leader is alive is another program's (the id was handed
    out again, which the kernel does only once nothing of the attempt's group is
    left): it is left running."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert executor.end_leftovers(p.pid, grace_s=0.2) is False
        assert p.poll() is None, "another program's group was stopped"
    finally:
        p.kill()
        p.wait(timeout=10)


def test_a_group_the_worker_may_not_signal_is_waited_for_boundedly_and_stops_nothing(monkeypatch):
    """A command that ran a setuid program leaves a group a non-root worker may not
    signal: killpg says PermissionError. kill_group must neither raise (that would
    stop the worker's slot) nor wait for ever on a leader it could not kill."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        def refused(pgid, sig):
            raise PermissionError(1, "Operation not permitted")
        monkeypatch.setattr(executor.os, "killpg", refused)
        t = time.monotonic()
        executor.kill_group(p.pid, p, grace_s=0.2)   # returns, without raising
        assert time.monotonic() - t < 5, "kill_group waited on a leader it could not signal"
        assert p.poll() is None   # (it could not be stopped: nothing was)
    finally:
        p.kill()
        p.wait(timeout=10)


def test_a_worker_told_to_stop_after_its_claim_starts_nothing(tmp_path, monkeypatch):
    """The stop was checked at the top of a slot's loop only: a SIGTERM landing
    during the claim (or the reap pass before it) still started the command, to
    kill it and requeue the job some 50 ms later. The runner asks once more
    before it starts anything: the attempt ends worker_stopped, never started,
    and the job waits queued for the next worker, counting nothing."""
    from spooler.jobs.worker import Worker

    spool_dir, ledger = str(tmp_path / "spool"), tmp_path / "ran"
    s = Store(spool_dir)
    job_id, _ = s.submit(["sh", "-c", f"echo ran >> {ledger}"])
    s.close()
    w = Worker(spool_dir, settings=knobs.Settings(), drain=True)
    claim_next = Store.claim_next

    def claim_then_stop(self, *args, **kw):
        claim = claim_next(self, *args, **kw)
        w.stop()   # the stop lands between the claim and the start
        return claim
    monkeypatch.setattr(Store, "claim_next", claim_then_stop)
    summary = w.run()
    assert summary["claimed"] == 1 and not ledger.exists(), summary
    s = Store(spool_dir)
    try:
        job = s.get(job_id)
    finally:
        s.close()
    assert job["state"] == "queued", job
    assert [(a["exit_code"], a["failure_reason"]) for a in job["attempts"]] == [(None, states.WORKER_STOPPED)], job
    assert job["crash_count"] == 0, job
