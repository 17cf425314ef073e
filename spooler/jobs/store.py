"""The spool: one SQLite file (apsw, WAL, synchronous=FULL) plus per-attempt output files.

Every state change runs in its own ``BEGIN IMMEDIATE`` transaction, which takes
SQLite's write lock when the transaction opens: concurrent workers serialize on
the lock instead of racing to upgrade a read lock. Each function takes ``now``
(Unix seconds) so tests can drive time. A ``Store`` is one connection: use one
per thread.

Only jobs with ``backend = 'local'`` are claimed here; rows that a cluster
worker records (``backend = 'spooler'``) are history, their truth is the Spooler
queue. Both are reaped: a dead cluster worker's command is killed, and its row
closed (``queued``: the queue redelivers the job once its lease expires).
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import apsw

from spooler.errors import InvalidArgument, NotFound
from spooler.jobs import knobs, states

DB_NAME = "spool.db"
OUTPUT_DIR = "output"
SCHEMA_VERSION = 1

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        idem_key TEXT UNIQUE,
        backend TEXT NOT NULL DEFAULT 'local',
        source TEXT,                      -- cluster back-end: server URL and queue
        command TEXT NOT NULL,            -- JSON argv
        cwd TEXT,
        priority INTEGER NOT NULL,
        state TEXT NOT NULL,
        max_retries INTEGER NOT NULL,
        max_crashes INTEGER,              -- NULL: unbounded
        timeout_s REAL,                   -- NULL: none
        failure_count INTEGER NOT NULL DEFAULT 0,  -- job-owned failures in the current budget
        crash_count INTEGER NOT NULL DEFAULT 0,    -- worker crashes in the current budget
        attempt_count INTEGER NOT NULL DEFAULT 0,  -- attempts ever started (= last attempt n)
        failure_reason TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        run_after REAL NOT NULL,          -- a queued job is eligible from this time
        worker_id TEXT,
        worker_pid INTEGER,
        worker_host TEXT,
        heartbeat_at REAL,
        heartbeat_interval_s REAL         -- of the owning worker: sets its reap threshold
    )""",
    "CREATE INDEX IF NOT EXISTS jobs_claim ON jobs(backend, state, priority DESC, seq)",
    "CREATE INDEX IF NOT EXISTS jobs_running ON jobs(state, heartbeat_at)",
    "CREATE INDEX IF NOT EXISTS jobs_worker ON jobs(worker_id)",
    """CREATE TABLE IF NOT EXISTS attempts (
        job_id TEXT NOT NULL,
        n INTEGER NOT NULL,               -- 1-based
        worker_id TEXT,
        worker_pid INTEGER,
        worker_host TEXT,
        pid INTEGER,                      -- the command's pid = its process group id
        started_at REAL NOT NULL,
        finished_at REAL,
        exit_code INTEGER,                -- negative: killed by that signal
        failure_reason TEXT,
        detail TEXT,
        stdout TEXT NOT NULL,
        stderr TEXT NOT NULL,
        PRIMARY KEY (job_id, n)
    )""",
]


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    pid: int
    host: str
    heartbeat_interval_s: float

    @classmethod
    def current(cls, heartbeat_interval_s: float) -> "WorkerIdentity":
        host = socket.gethostname()
        pid = os.getpid()
        # the start time tells this process from a later one given the same pid
        # (reaper.liveness); "host:pid:random[:start]"
        start = process_start(pid)
        wid = f"{host}:{pid}:{uuid.uuid4().hex[:8]}" + ("" if start is None else f":{start}")
        return cls(wid, pid, host, heartbeat_interval_s)


def process_start(pid: int) -> Optional[int]:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22);
    None where there is no /proc or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def start_of(worker_id: Optional[str]) -> Optional[int]:
    """The start time a worker id carries (ids written before it carry none)."""
    parts = (worker_id or "").split(":")
    return int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else None


@dataclass(frozen=True)
class Claim:
    job_id: str
    n: int
    command: list
    cwd: Optional[str]
    timeout_s: Optional[float]
    stdout: str
    stderr: str
    worker_id: str


@dataclass(frozen=True)
class Candidate:
    job_id: str
    n: int
    worker_id: str
    worker_pid: Optional[int]
    worker_host: Optional[str]
    heartbeat_at: Optional[float]
    pgid: Optional[int] = None   # the attempt's process group, if it was spawned
    backend: str = "local"
    started_at: Optional[float] = None  # the attempt's start


def new_job_id() -> str:
    return uuid.uuid4().hex[:16]


def validate_command(command: list) -> list:
    if not command:
        raise InvalidArgument("a command is required after --")
    if len(command) > knobs.COMMAND_ARGS_MAX:
        raise InvalidArgument(f"command has {len(command)} arguments; the limit is {knobs.COMMAND_ARGS_MAX}")
    size = sum(len(a.encode("utf-8", "surrogateescape")) + 1 for a in command)
    if size > knobs.COMMAND_BYTES_MAX:
        raise InvalidArgument(f"command is {size} bytes; the limit is {knobs.COMMAND_BYTES_MAX}")
    return [str(a) for a in command]


def validate_job_options(priority: int, max_retries: int, max_crashes: Optional[int],
                         timeout_s: Optional[float], key: Optional[str]) -> None:
    if not knobs.PRIORITY_MIN <= priority <= knobs.PRIORITY_MAX:
        raise InvalidArgument(f"--priority must be in [{knobs.PRIORITY_MIN}, {knobs.PRIORITY_MAX}]")
    if not 0 <= max_retries <= knobs.MAX_RETRIES_MAX:
        raise InvalidArgument(f"--max-retries must be in [0, {knobs.MAX_RETRIES_MAX}]")
    if max_crashes is not None and not 0 <= max_crashes <= knobs.MAX_CRASHES_MAX:
        raise InvalidArgument(f"--max-crashes must be in [0, {knobs.MAX_CRASHES_MAX}]")
    if timeout_s is not None and not (0 < timeout_s <= knobs.TIMEOUT_S_MAX):
        raise InvalidArgument(f"--timeout must be > 0 and <= {knobs.TIMEOUT_S_MAX:g} seconds")
    if key is not None and (key == "" or len(key.encode()) > knobs.IDEMPOTENCY_KEY_BYTES_MAX):
        raise InvalidArgument(f"--key must be 1..{knobs.IDEMPOTENCY_KEY_BYTES_MAX} bytes")


class Store:
    def __init__(self, spool_dir: str, busy_timeout_s: float = knobs.DEFAULT_BUSY_TIMEOUT_S, create: bool = True):
        """``create``: make the spool if it is not there (submit, worker); without
        it a missing spool is ``not_found``, so a mistyped ``--spool`` is not
        mistaken for an empty spool."""
        self.spool_dir = os.path.abspath(spool_dir)
        self.output_dir = os.path.join(self.spool_dir, OUTPUT_DIR)
        self.path = os.path.join(self.spool_dir, DB_NAME)
        if not create and not os.path.isfile(self.path):
            if os.path.exists(self.spool_dir) and not os.path.isdir(self.spool_dir):
                # as submit and worker say it (their makedirs meets the same file)
                raise states.SpoolUnusable(f"spool {self.spool_dir} is not a directory")
            raise NotFound(f"no spool at {self.spool_dir} (no {DB_NAME} there)")
        os.makedirs(self.output_dir, exist_ok=True)
        self.conn = apsw.Connection(self.path)
        self.busy_timeout_s = busy_timeout_s
        self._busy_since = 0.0
        # SQLite's own busy timeout sleeps up to 100 ms between tries; under
        # contention the lock is free again within a millisecond or two, so poll
        # it faster (same deadline, same outcome: BusyError when it passes)
        self.conn.setbusyhandler(self._on_busy)
        try:
            self._init()
        except BaseException:
            self.conn.close()
            raise

    def close(self) -> None:
        self.conn.close()

    # --- plumbing ---------------------------------------------------------
    def _on_busy(self, count: int) -> bool:
        now = time.monotonic()
        if count == 0:
            self._busy_since = now
        if now - self._busy_since >= self.busy_timeout_s:
            return False
        time.sleep(0.0005 * min(count + 1, 8))   # 0.5 ms .. 4 ms
        return True

    def _init(self) -> None:
        c = self.conn
        if c.execute("PRAGMA journal_mode").fetchall()[0][0] != "wal":
            c.execute("PRAGMA journal_mode=WAL").fetchall()
        c.execute("PRAGMA synchronous=FULL").fetchall()   # fsync the WAL on every commit
        version = c.execute("PRAGMA user_version").fetchall()[0][0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            # a newer spoolctl's spool: never stamped back to this version (its
            # tables may mean more than this build knows), and nothing written
            raise states.SpoolUnusable(f"spool {self.spool_dir} has schema {version}, newer than this "
                                       f"spoolctl's {SCHEMA_VERSION}: use the spoolctl that made it")
        with self.immediate():
            for stmt in SCHEMA:
                c.execute(stmt)
            c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextmanager
    def immediate(self) -> Iterator[apsw.Connection]:
        """One write transaction. BusyError from BEGIN means nothing happened.

        The write methods read the time inside it, once the lock is held: a time
        read before waiting for the lock (up to the busy timeout) can be older
        than what another process committed meanwhile. A claim that read it so
        took a job whose failure had just set a backoff, since an ``updated_at``
        after its "now" looks like a clock stepped back."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        try:
            self.conn.execute("COMMIT")
        except BaseException:
            if not self.conn.getautocommit():
                self.conn.execute("ROLLBACK")
            raise

    def _one(self, sql: str, params=()) -> Optional[tuple]:
        for row in self.conn.execute(sql, params):
            return row
        return None

    def _out_paths(self, job_id: str, n: int) -> tuple:
        d = os.path.join(self.output_dir, job_id)
        return os.path.join(d, f"{n}.stdout"), os.path.join(d, f"{n}.stderr")

    # --- submit -----------------------------------------------------------
    def submit(self, command: list, priority: int = knobs.DEFAULT_PRIORITY,
               max_retries: int = knobs.DEFAULT_MAX_RETRIES, max_crashes: Optional[int] = None,
               timeout_s: Optional[float] = None, key: Optional[str] = None, cwd: Optional[str] = None,
               now: Optional[float] = None) -> tuple:
        """Queue a job. Returns (job_id, duplicate). A repeated ``key`` returns the first id."""
        command = validate_command(command)
        validate_job_options(priority, max_retries, max_crashes, timeout_s, key)
        with self.immediate() as c:
            now = time.time() if now is None else now
            if key is not None:
                row = self._one("SELECT id FROM jobs WHERE idem_key=?", (key,))
                if row:
                    return row[0], True
            job_id = new_job_id()
            c.execute(
                "INSERT INTO jobs(id, idem_key, command, cwd, priority, state, max_retries, max_crashes,"
                " timeout_s, created_at, updated_at, run_after) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (job_id, key, json.dumps(command), cwd, priority, states.QUEUED, max_retries, max_crashes,
                 timeout_s, now, now, now))
        return job_id, False

    # --- claim ------------------------------------------------------------
    def claim_next(self, worker: WorkerIdentity, now: Optional[float] = None) -> Optional[Claim]:
        """Atomically take the highest-priority eligible job (then the oldest).

        Raises apsw.BusyError if the write lock was not had within the busy
        timeout; the job then stays queued for the next pass.
        """
        with self.immediate() as c:
            now = time.time() if now is None else now
            row = self._one(
                "SELECT id, state, attempt_count, command, cwd, timeout_s FROM jobs"
                " WHERE backend='local' AND state='queued' AND (run_after <= ? OR updated_at > ?)"
                " ORDER BY priority DESC, seq LIMIT 1", (now, now))
            if row is None:
                return None
            job_id, state, count, command, cwd, timeout_s = row
            states.transition(state, "claim")
            n = count + 1
            out, err = self._out_paths(job_id, n)
            c.execute(
                "UPDATE jobs SET state='running', attempt_count=?, worker_id=?, worker_pid=?, worker_host=?,"
                " heartbeat_at=?, heartbeat_interval_s=?, updated_at=? WHERE id=? AND state='queued'",
                (n, worker.worker_id, worker.pid, worker.host, now, worker.heartbeat_interval_s, now, job_id))
            if c.changes() != 1:  # cannot happen under BEGIN IMMEDIATE; never claim twice if it does
                raise RuntimeError(f"job {job_id}'s row changed under BEGIN IMMEDIATE while it was claimed")
            c.execute(
                "INSERT INTO attempts(job_id, n, worker_id, worker_pid, worker_host, started_at, stdout, stderr)"
                " VALUES (?,?,?,?,?,?,?,?)",
                (job_id, n, worker.worker_id, worker.pid, worker.host, now, out, err))
        return Claim(job_id, n, json.loads(command), cwd, timeout_s, out, err, worker.worker_id)

    def record_pid(self, claim: Claim, pid: int) -> bool:
        """Note the attempt's process. False: this worker no longer owns the attempt
        (it was canceled before its pid was known, so nobody could kill it yet)."""
        with self.immediate() as c:
            c.execute("UPDATE attempts SET pid=? WHERE job_id=? AND n=? AND worker_id=?",
                      (pid, claim.job_id, claim.n, claim.worker_id))
            # the attempt's first heartbeat, strictly after its start: a row touched
            # since its start is one whose worker heartbeats, so the reaper watches it
            # from here (it spares a cluster row never touched, which spoolctl before
            # 0.4.18 left so; this version's first periodic beat can be a heartbeat
            # interval away, and a worker hung before it was never judged hung)
            c.execute("UPDATE jobs SET heartbeat_at=MAX(?, heartbeat_at + 0.000001) WHERE id=? AND state='running'"
                      " AND worker_id=? AND attempt_count=?", (time.time(), claim.job_id, claim.worker_id, claim.n))
            return self.owns(claim)

    # --- heartbeat --------------------------------------------------------
    def heartbeat(self, worker: WorkerIdentity, owned, now: Optional[float] = None) -> set:
        """Touch every running job of this worker. ``owned``: the (job_id, attempt n)
        pairs it runs. Returns the pairs it no longer owns (canceled or reaped).
        By attempt, not by job: a job whose attempt ended and that was claimed
        again meanwhile is a new pair, never mistaken for the old one's loss."""
        lost = set()
        with self.immediate() as c:
            now = time.time() if now is None else now
            c.execute("UPDATE jobs SET heartbeat_at=? WHERE state='running' AND worker_id=?",
                      (now, worker.worker_id))
            for job_id, n in owned:
                row = self._one("SELECT state, worker_id, attempt_count FROM jobs WHERE id=?", (job_id,))
                if row is None or row != ("running", worker.worker_id, n):
                    lost.add((job_id, n))
        return lost

    # --- finish -----------------------------------------------------------
    def finish_attempt(self, claim: Claim, reason: Optional[str], exit_code: Optional[int],
                       detail: str = "", now: Optional[float] = None) -> str:
        """Record an attempt's end and move its job. Returns the job's state afterwards.

        The job only moves if this worker still owns this attempt (it may have
        been canceled, or reaped if this worker looked dead).
        """
        return self.finish_attempt_owned(claim, reason, exit_code, detail, now)[0]

    def finish_attempt_owned(self, claim: Claim, reason: Optional[str], exit_code: Optional[int],
                             detail: str = "", now: Optional[float] = None) -> tuple:
        """As finish_attempt; -> (the job's state afterwards, whether the attempt was
        still this worker's: if not, its end moved nothing and counts for nobody)."""
        with self.immediate() as c:
            now = time.time() if now is None else now
            row = self._one(
                "SELECT state, worker_id, attempt_count, failure_count, crash_count, max_retries"
                " FROM jobs WHERE id=?", (claim.job_id,))
            if row is None:
                raise NotFound(f"job {claim.job_id} vanished")
            state, owner, count, failures, crashes, max_retries = row
            owned = state == states.RUNNING and owner == claim.worker_id and count == claim.n
            if not owned:
                # canceled or reaped meanwhile: keep whatever reason closed the attempt first
                c.execute(
                    "UPDATE attempts SET exit_code=COALESCE(exit_code, ?), finished_at=COALESCE(finished_at, ?),"
                    " failure_reason=COALESCE(failure_reason, ?) WHERE job_id=? AND n=?",
                    (exit_code, now, states.CANCELED_REASON if state == states.CANCELED else reason,
                     claim.job_id, claim.n))
                return state, False
            if reason in (states.CANCELED_REASON, states.LEASE_LOST):
                # stopped by its worker for a loss that did not happen (still ours):
                # requeued like an interrupted attempt, no budget spent
                reason = states.WORKER_STOPPED
            d = states.after_attempt(reason, failures, crashes, max_retries, now)
            to = states.transition(state, d.event)
            c.execute("UPDATE attempts SET exit_code=?, finished_at=?, failure_reason=?, detail=?"
                      " WHERE job_id=? AND n=?", (exit_code, now, reason, detail or None, claim.job_id, claim.n))
            self._move(claim.job_id, to, d, now)
            return to, True

    def _move(self, job_id: str, to: str, d: states.Decision, now: float) -> None:
        self.conn.execute(
            "UPDATE jobs SET state=?, failure_count=?, crash_count=?, failure_reason=?,"
            " run_after=COALESCE(?, run_after), updated_at=?,"
            " worker_id=NULL, worker_pid=NULL, worker_host=NULL, heartbeat_at=NULL WHERE id=?",
            (to, d.failure_count, d.crash_count, d.failure_reason, d.run_after, now, job_id))

    # --- reap -------------------------------------------------------------
    # Times are the wall clock's, which can be stepped back (NTP, an operator). A
    # row written "later" than now says so: a queued job's backoff (``run_after``)
    # then no longer means anything and it is eligible at once; a heartbeat more
    # than a threshold in the future cannot show staleness, so its job is a
    # candidate and the PID probe decides (reaper.py: a live worker is left alone,
    # and only this host's workers are ever judged).
    _THRESHOLD = "COALESCE(?, MAX(4 * COALESCE(heartbeat_interval_s, 5.0), 30.0))"
    _STALE = (f"state='running' AND (heartbeat_at < ? - {_THRESHOLD}"
              f" OR heartbeat_at > ? + {_THRESHOLD})")

    @staticmethod
    def _stale_args(now: float, threshold_override_s: Optional[float]) -> tuple:
        """The bindings of _STALE's placeholders, in order."""
        return (now, threshold_override_s, now, threshold_override_s)

    def reap_candidates(self, now: Optional[float] = None, threshold_override_s: Optional[float] = None,
                        limit: int = 100, skip_workers=()) -> list:
        """Stale running jobs, oldest heartbeat first; ``skip_workers``: worker ids
        already judged alive this pass (their jobs would hide the ones behind them)."""
        now = time.time() if now is None else now
        skip = list(skip_workers)
        not_in = f" AND j.worker_id NOT IN ({','.join('?' * len(skip))})" if skip else ""
        rows = self.conn.execute(
            f"SELECT j.id, j.attempt_count, j.worker_id, j.worker_pid, j.worker_host, j.heartbeat_at, a.pid,"
            f" j.backend, a.started_at"
            f" FROM jobs j LEFT JOIN attempts a ON a.job_id=j.id AND a.n=j.attempt_count"
            f" WHERE {self._STALE}{not_in} ORDER BY j.heartbeat_at LIMIT ?",
            (*self._stale_args(now, threshold_override_s), *skip, limit))
        return [Candidate(*r) for r in rows]

    def reap(self, cand: Candidate, detail: str, now: Optional[float] = None,
             threshold_override_s: Optional[float] = None, before: Optional[Callable[[], object]] = None) -> Optional[str]:
        """Requeue (or bury) a candidate whose worker was confirmed dead.

        Re-checks inside the transaction that the job is still stale and still
        owned by the same worker and attempt: a worker that heartbeated since
        the scan is left alone. Returns the new state, or None if untouched.
        ``before``: run once the re-check has passed, still inside the
        transaction, before anything moves (the reaper kills the attempt's
        command there). The transaction holds the spool's write lock, so the
        worker cannot heartbeat between the re-check and ``before``: a worker
        that wakes meanwhile finds, once it gets the lock, that it lost the
        attempt. It is never a worker that heartbeated whose command is killed.
        """
        with self.immediate() as c:
            now = time.time() if now is None else now
            row = self._one(
                f"SELECT state, failure_count, crash_count, max_crashes, backend FROM jobs"
                f" WHERE id=? AND worker_id=? AND attempt_count=? AND {self._STALE}",
                (cand.job_id, cand.worker_id, cand.n, *self._stale_args(now, threshold_override_s)))
            if row is None:
                return None
            if before is not None:
                before()
            state, failures, crashes, max_crashes, backend = row
            if backend != "local":
                # a cluster job: its queue decides what comes next (the lease expires
                # and the job is delivered again, a retry counted there); this row
                # only stops claiming that it runs here
                c.execute("UPDATE attempts SET finished_at=?, failure_reason=?, detail=?"
                          " WHERE job_id=? AND n=? AND finished_at IS NULL",
                          (now, states.WORKER_CRASHED, f"{detail}; the queue delivers the job again once its "
                           "lease expires", cand.job_id, cand.n))
                c.execute("UPDATE jobs SET state=?, crash_count=crash_count+1, failure_reason=?, updated_at=?,"
                          " worker_id=NULL, worker_pid=NULL, worker_host=NULL, heartbeat_at=NULL WHERE id=?",
                          (states.QUEUED, states.WORKER_CRASHED, now, cand.job_id))
                return states.QUEUED
            d = states.after_crash(failures, crashes, max_crashes, now)
            to = states.transition(state, d.event)
            c.execute("UPDATE attempts SET finished_at=?, failure_reason=?, detail=?"
                      " WHERE job_id=? AND n=? AND finished_at IS NULL",
                      (now, states.WORKER_CRASHED, detail, cand.job_id, cand.n))
            self._move(cand.job_id, to, d, now)
            return to

    # --- operator commands ------------------------------------------------
    def cancel(self, job_id: str, now: Optional[float] = None) -> tuple:
        """Returns (previous state, pid of the running attempt's process group or None, its host,
        the attempt's token: "<job id>:<n>", as in its processes' environment)."""
        with self.immediate() as c:
            now = time.time() if now is None else now
            row = self._one("SELECT state, attempt_count, worker_host, backend FROM jobs WHERE id=?", (job_id,))
            if row is None:
                raise NotFound(f"no job {job_id or repr(job_id)}")
            state, n, host, backend = row
            if backend != "local":
                raise states.JobStateConflict(
                    f"job {job_id} belongs to a Spooler queue; it cannot be canceled from a spool")
            to = states.transition(state, "cancel")
            pid = None
            if state == states.RUNNING:
                r = self._one("SELECT pid FROM attempts WHERE job_id=? AND n=?", (job_id, n))
                pid = r[0] if r else None
            if state != to:
                c.execute("UPDATE jobs SET state=?, failure_reason=?, updated_at=?, worker_id=NULL,"
                          " worker_pid=NULL, heartbeat_at=NULL WHERE id=?",
                          (to, states.CANCELED_REASON, now, job_id))
        return state, pid, host, f"{job_id}:{n}"

    def close_canceled_attempt(self, job_id: str, n: int, now: Optional[float] = None) -> None:
        """After cancel killed a running attempt: close attempt ``n`` (the one the
        cancel found running) if its worker has not (e.g. it is gone). By number,
        not "the latest": a retry and a new claim may come while the kill waits."""
        with self.immediate() as c:
            now = time.time() if now is None else now
            c.execute("UPDATE attempts SET finished_at=?, failure_reason=COALESCE(failure_reason, ?)"
                      " WHERE job_id=? AND n=? AND finished_at IS NULL", (now, states.CANCELED_REASON, job_id, n))

    def retry(self, job_id: str, force: bool = False, now: Optional[float] = None) -> str:
        """Requeue now. A forced retry also starts fresh failure and crash budgets."""
        with self.immediate() as c:
            now = time.time() if now is None else now
            row = self._one("SELECT state, backend FROM jobs WHERE id=?", (job_id,))
            if row is None:
                raise NotFound(f"no job {job_id or repr(job_id)}")
            state, backend = row
            if backend != "local":
                raise states.JobStateConflict(
                    f"job {job_id} belongs to a Spooler queue; redrive its failure queue instead")
            to = states.transition(state, "retry_force" if force else "retry")
            if force:
                c.execute("UPDATE jobs SET state=?, run_after=?, updated_at=?, failure_count=0, crash_count=0,"
                          " failure_reason=NULL WHERE id=?", (to, now, now, job_id))
            else:  # the job's reason is its latest outcome's; its attempts keep theirs
                c.execute("UPDATE jobs SET state=?, run_after=?, updated_at=?, failure_reason=NULL WHERE id=?",
                          (to, now, now, job_id))
            return to

    # --- cluster back-end history ----------------------------------------
    def begin_remote(self, worker: WorkerIdentity, job_id: str, source: str, command: list,
                     cwd: Optional[str], priority: int, max_retries: int, timeout_s: Optional[float],
                     now: Optional[float] = None) -> Claim:
        """Record (on this machine) an attempt of a job leased from a Spooler queue."""
        orphans: list = []
        with self.immediate() as c:
            now = time.time() if now is None else now
            row = self._one("SELECT attempt_count FROM jobs WHERE id=?", (job_id,))
            if row is None:
                c.execute(
                    "INSERT INTO jobs(id, backend, source, command, cwd, priority, state, max_retries,"
                    " timeout_s, created_at, updated_at, run_after) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (job_id, "spooler", source, json.dumps(command), cwd, priority, states.QUEUED,
                     max_retries, timeout_s, now, now, now))
                count = 0
            else:
                count = row[0]
                # an attempt of ours left open: its worker died and the lease expired
                for (pn, ppid) in list(c.execute(
                        "SELECT n, pid FROM attempts WHERE job_id=? AND finished_at IS NULL", (job_id,))):
                    orphans.append((ppid, f"{job_id}:{pn}"))
                c.execute("UPDATE attempts SET finished_at=?, failure_reason=?, detail=? WHERE job_id=?"
                          " AND finished_at IS NULL", (now, states.WORKER_CRASHED,
                                                       "no result recorded here; the lease expired and the"
                                                       " queue redelivered the job", job_id))
            n = count + 1
            out, err = self._out_paths(job_id, n)
            c.execute(
                "UPDATE jobs SET state='running', attempt_count=?, worker_id=?, worker_pid=?, worker_host=?,"
                " heartbeat_at=?, heartbeat_interval_s=?, updated_at=? WHERE id=?",
                (n, worker.worker_id, worker.pid, worker.host, now, worker.heartbeat_interval_s, now, job_id))
            c.execute(
                "INSERT INTO attempts(job_id, n, worker_id, worker_pid, worker_host, started_at, stdout, stderr)"
                " VALUES (?,?,?,?,?,?,?,?)", (job_id, n, worker.worker_id, worker.pid, worker.host, now, out, err))
        if orphans:
            from spooler.jobs import executor
            for pgid, token in orphans:
                executor.kill_orphans(pgid or None, token)
        return Claim(job_id, n, command, cwd, timeout_s, out, err, worker.worker_id)

    def owns(self, claim: Claim) -> bool:
        """Whether ``claim``'s attempt is still its worker's running one (not reaped,
        not taken over by a later attempt)."""
        row = self._one("SELECT state, worker_id, attempt_count FROM jobs WHERE id=?", (claim.job_id,))
        return row == (states.RUNNING, claim.worker_id, claim.n)

    def finish_remote(self, claim: Claim, reason: Optional[str], exit_code: Optional[int], state: str,
                      retry_count: int, detail: str = "", now: Optional[float] = None) -> bool:
        """The queue decided (ack / nack / failure queue); mirror it locally, only
        while the attempt is still its worker's running one (checked in the same
        transaction: a reap that closed it meanwhile stands). -> whether written."""
        with self.immediate() as c:
            now = time.time() if now is None else now
            if not self.owns(claim):
                return False
            c.execute("UPDATE attempts SET exit_code=?, finished_at=?, failure_reason=?, detail=?"
                      " WHERE job_id=? AND n=?", (exit_code, now, reason, detail or None, claim.job_id, claim.n))
            c.execute("UPDATE jobs SET state=?, failure_reason=?, failure_count=?, updated_at=?, worker_id=NULL,"
                      " worker_pid=NULL, worker_host=NULL, heartbeat_at=NULL WHERE id=?",
                      (state, reason, retry_count + (1 if reason else 0), now, claim.job_id))
        return True

    # --- reads ------------------------------------------------------------
    _JOB_COLS = ("seq, id, idem_key, backend, source, command, cwd, priority, state, max_retries, max_crashes,"
                 " timeout_s, failure_count, crash_count, attempt_count, failure_reason, created_at,"
                 " updated_at, run_after, worker_id, worker_pid, worker_host, heartbeat_at, heartbeat_interval_s")
    _ATT_COLS = ("job_id, n, worker_id, worker_pid, worker_host, pid, started_at, finished_at, exit_code,"
                 " failure_reason, detail, stdout, stderr")

    def _job_dict(self, row: tuple, attempts: list) -> dict:
        names = [s.strip() for s in self._JOB_COLS.split(",")]
        r = dict(zip(names, row))
        d = {
            "id": r["id"], "state": r["state"], "priority": r["priority"],
            "command": json.loads(r["command"]), "cwd": r["cwd"], "key": r["idem_key"],
            "backend": r["backend"], "source": r["source"],
            "max_retries": r["max_retries"], "max_crashes": r["max_crashes"], "timeout_s": r["timeout_s"],
            "failure_count": r["failure_count"], "crash_count": r["crash_count"],
            "failure_reason": r["failure_reason"],
            "created_at": r["created_at"], "updated_at": r["updated_at"],
            "run_after": r["run_after"] if r["state"] == states.QUEUED else None,
            "worker": ({"id": r["worker_id"], "pid": r["worker_pid"], "host": r["worker_host"],
                        "heartbeat_at": r["heartbeat_at"], "heartbeat_interval_s": r["heartbeat_interval_s"]}
                       if r["worker_id"] else None),
            "attempts": attempts,
        }
        return d

    @staticmethod
    def _att_dict(row: tuple) -> dict:
        (job_id, n, wid, wpid, whost, pid, started, finished, code, reason, detail, out, err) = row
        return {"n": n, "worker_id": wid, "worker_pid": wpid, "host": whost, "pid": pid,
                "started_at": started, "finished_at": finished, "exit_code": code,
                "failure_reason": reason, "detail": detail, "stdout": out, "stderr": err}

    def get(self, job_id: str) -> dict:
        row = self._one(f"SELECT {self._JOB_COLS} FROM jobs WHERE id=?", (job_id,))
        if row is None:
            raise NotFound(f"no job {job_id or repr(job_id)}")
        atts = [self._att_dict(r) for r in self.conn.execute(
            f"SELECT {self._ATT_COLS} FROM attempts WHERE job_id=? ORDER BY n", (job_id,))]
        return self._job_dict(row, atts)

    def list(self, state: Optional[str] = None, limit: int = knobs.LIST_LIMIT_DEFAULT) -> list:
        with self.read():
            where, params = ("WHERE state=?", (state,)) if state else ("", ())
            rows = list(self.conn.execute(
                f"SELECT {self._JOB_COLS} FROM jobs {where} ORDER BY seq LIMIT ?", params + (limit,)))
            ids = {r[1] for r in rows}
            by_job: dict = {}
            att_sql = f"SELECT {self._ATT_COLS} FROM attempts ORDER BY job_id, n"
            if state:
                att_sql = (f"SELECT {self._ATT_COLS} FROM attempts WHERE job_id IN"
                           f" (SELECT id FROM jobs WHERE state=?) ORDER BY job_id, n")
            for a in self.conn.execute(att_sql, (state,) if state else ()):
                if a[0] in ids:
                    by_job.setdefault(a[0], []).append(self._att_dict(a))
        return [self._job_dict(r, by_job.get(r[1], [])) for r in rows]

    @contextmanager
    def read(self):
        """A consistent snapshot for multi-statement reads."""
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            self.conn.execute("COMMIT")

    def counts(self, backend: Optional[str] = "local") -> dict:
        out = {s: 0 for s in states.STATES}
        sql = "SELECT state, COUNT(*) FROM jobs" + (" WHERE backend=?" if backend else "") + " GROUP BY state"
        for s, n in self.conn.execute(sql, (backend,) if backend else ()):
            out[s] = n
        return out

    def next_eligible_at(self) -> Optional[float]:
        row = self._one("SELECT MIN(run_after) FROM jobs WHERE backend='local' AND state='queued'")
        return row[0] if row else None

    def attempt(self, job_id: str, n: Optional[int] = None) -> dict:
        job = self.get(job_id)
        if not job["attempts"]:
            raise NotFound(f"job {job_id} has no attempts yet")
        if n is None:
            return job["attempts"][-1]
        for a in job["attempts"]:
            if a["n"] == n:
                return a
        raise NotFound(f"job {job_id} has no attempt {n} (it has {len(job['attempts'])})")
