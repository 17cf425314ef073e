"""Helpers for the job-runner tests: run spoolctl as a real subprocess, poll
with deadlines, and end every process a test started by its pid.

Workers run as ``python -m spooler`` (``python -m spooler.jobs`` while the
spool CLI module is absent), whose argv carries the liveness marker
``-m spooler``; the reaper treats that, or an argv naming ``spoolctl``, as a
live worker.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# fast reap cycle for tests: heartbeat 0.1 s, reap after 1 s of silence
FAST_KNOBS = {"SPOOLCTL_TEST_HEARTBEAT_INTERVAL": "0.1", "SPOOLCTL_TEST_REAP_THRESHOLD": "1.0"}


def spoolctl_argv() -> list:
    if os.path.exists(os.path.join(REPO, "spooler", "cli", "spool.py")):
        return [sys.executable, "-m", "spooler"]
    return [sys.executable, "-m", "spooler.jobs"]


def wait_until(pred, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped by a signal (state T) or gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if stat[stat.rfind(b")") + 2:].split()[0] not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def pid_gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):  # (the second: it went between the open and the read)
        return True
    return stat[stat.rfind(b")") + 2:].split()[0] == b"Z"


class Spool:
    def __init__(self, path: str, env: Optional[dict] = None):
        self.path = path
        self.cwd = os.path.dirname(path)
        self.env = {**os.environ, "PYTHONPATH": REPO, **FAST_KNOBS, **(env or {})}
        self.env.pop("SPOOLCTL_DIR", None)
        self.procs: list = []
        self.extra_procs: list = []  # other processes a test started (Popen), ended at cleanup

    def run(self, *args, env: Optional[dict] = None, check: bool = True, timeout_s: float = 60.0,
            global_args=()):
        cmd = [*spoolctl_argv(), "--spool", self.path, *global_args, *args]
        r = subprocess.run(cmd, capture_output=True, cwd=self.cwd, env={**self.env, **(env or {})},
                           timeout=timeout_s)
        if check and r.returncode != 0:
            raise AssertionError(f"{cmd} -> {r.returncode}\nstdout: {r.stdout!r}\nstderr: {r.stderr!r}")
        return r

    def json(self, command, *args, **kw):
        r = self.run(command, "--json", *args, **kw)
        return json.loads(r.stdout)

    def submit(self, *cmd, opts=()) -> str:
        return self.run("submit", *opts, "--", *cmd).stdout.decode().strip()

    def submit_direct(self, *cmd, **opts) -> str:
        """Submit through the store API (no process start): for tests of other things."""
        from spooler.jobs.store import Store
        st = Store(self.path)
        try:
            return st.submit(list(cmd), cwd=self.cwd, **opts)[0]
        finally:
            st.close()

    def job(self, job_id: str) -> dict:
        return self.json("status", job_id)

    def start_worker(self, *args, env: Optional[dict] = None, global_args=(), **popen_kw) -> subprocess.Popen:
        cmd = [*spoolctl_argv(), "--spool", self.path, *global_args, "worker", *args]
        popen_kw.setdefault("stdout", subprocess.PIPE)
        popen_kw.setdefault("stderr", subprocess.PIPE)
        p = subprocess.Popen(cmd, cwd=self.cwd, env={**self.env, **(env or {})}, **popen_kw)
        self.procs.append(p)
        return p

    def freeze_outside_write_lock(self, proc: subprocess.Popen, tries: int = 50) -> None:
        """SIGSTOP ``proc`` at a moment it does not hold the spool's write lock.

        A worker frozen inside one of its short transactions (a heartbeat, a claim,
        a reap pass) blocks every other process's writes on the spool until it goes
        on (guarantees.md, J2's failure mode): a test of what happens to a hung
        worker's job means one hung outside them. After each stop, take the lock
        for a moment (waiting up to 0.2 s); if the frozen process holds it, let it
        go on and stop it again."""
        import apsw
        for _ in range(tries):
            proc.send_signal(signal.SIGSTOP)
            # stopped indeed, every thread of it, before the lock is looked at: a
            # signal takes effect when the process next runs, and on a loaded
            # machine a worker could still take the lock after the check, then
            # stop inside its transaction (every other writer then waits for ever)
            wait_until(lambda: all_threads_stopped(proc.pid), 10, 0.001, what=f"pid {proc.pid} stopped")
            c = apsw.Connection(os.path.join(self.path, "spool.db"))
            try:
                c.setbusytimeout(200)
                c.execute("BEGIN IMMEDIATE")
                c.execute("ROLLBACK")
                return
            except apsw.BusyError:
                proc.send_signal(signal.SIGCONT)
            finally:
                c.close()
        raise AssertionError(f"pid {proc.pid} held the spool's write lock at each of {tries} stops")

    def attempt_pgids(self) -> list:
        """(process group id, the attempt's token) of every attempt that had one."""
        try:
            import apsw
            c = apsw.Connection(os.path.join(self.path, "spool.db"), flags=apsw.SQLITE_OPEN_READONLY)
            try:
                return [(pid, f"{job}:{n}") for pid, job, n in
                        c.execute("SELECT pid, job_id, n FROM attempts WHERE pid IS NOT NULL")]
            finally:
                c.close()
        except Exception:
            return []

    def cleanup(self) -> None:
        """End every worker we started and every job process group it spawned, by pid."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()
        # a job's group only while a member still carries its attempt's token: an id
        # of a group long gone may be another process's by now
        from spooler.jobs.executor import group_carries
        for pgid, token in self.attempt_pgids():
            if group_carries(pgid, token):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.extra_procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def spool(tmp_path):
    s = Spool(str(tmp_path / "spool"))
    try:
        yield s
    finally:
        s.cleanup()


def stop_worker(p: subprocess.Popen, timeout_s: float = 15.0) -> tuple:
    """SIGTERM and wait (the worker kills its jobs' groups within the 5 s grace)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=timeout_s)
    return p.returncode, out, err


def cli_inprocess(argv: list, env: Optional[dict] = None) -> tuple:
    """Run spoolctl's main() in this process (argument validation tests): (rc, stdout, stderr)."""
    import contextlib
    import io
    from spooler.cli import main
    saved = dict(os.environ)
    os.environ.update(env or {})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rc, out.getvalue(), err.getvalue()
