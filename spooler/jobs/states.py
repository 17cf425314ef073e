"""The job lifecycle as one table, and the pure decisions taken at its edges.

No IO and no clock here: callers pass ``now`` and counts, and get back the
event to apply. Anything not in ``TRANSITIONS`` is refused and leaves the job
unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from spooler.errors import SpoolerError
from spooler.jobs import knobs

QUEUED, RUNNING, SUCCEEDED, DEAD, CANCELED = "queued", "running", "succeeded", "dead", "canceled"
STATES = (QUEUED, RUNNING, SUCCEEDED, DEAD, CANCELED)
TERMINAL = frozenset({SUCCEEDED, DEAD, CANCELED})

# failure_reason vocabulary (attempts and jobs)
NONZERO_EXIT = "nonzero_exit"      # job-owned: counts against --max-retries
TIMEOUT = "timeout"                # job-owned
SPAWN_FAILED = "spawn_failed"      # job-owned
WORKER_CRASHED = "worker_crashed"  # counts against --max-crashes
CANCELED_REASON = "canceled"       # operator
WORKER_STOPPED = "worker_stopped"  # the worker was told to stop (SIGTERM/SIGINT): counts nowhere
LEASE_LOST = "lease_lost"          # cluster back-end: the lease expired under a live worker
FAILURE_REASONS = (NONZERO_EXIT, TIMEOUT, SPAWN_FAILED, WORKER_CRASHED, CANCELED_REASON,
                   WORKER_STOPPED, LEASE_LOST)
JOB_OWNED = frozenset({NONZERO_EXIT, TIMEOUT, SPAWN_FAILED})

# (event, from_state) -> to_state
TRANSITIONS = {
    ("claim", QUEUED): RUNNING,
    ("succeed", RUNNING): SUCCEEDED,
    ("fail_retry", RUNNING): QUEUED,
    ("fail_dead", RUNNING): DEAD,
    ("crash_requeue", RUNNING): QUEUED,
    ("crash_dead", RUNNING): DEAD,
    ("interrupt", RUNNING): QUEUED,
    ("cancel", QUEUED): CANCELED,
    ("cancel", RUNNING): CANCELED,
    ("cancel", CANCELED): CANCELED,      # idempotent
    ("retry", QUEUED): QUEUED,           # clears a pending backoff
    ("retry", CANCELED): QUEUED,
    ("retry", SUCCEEDED): QUEUED,        # run it again: the contract asks --force for dead jobs only
    ("retry_force", QUEUED): QUEUED,
    ("retry_force", CANCELED): QUEUED,
    ("retry_force", DEAD): QUEUED,
    ("retry_force", SUCCEEDED): QUEUED,
}


class JobStateConflict(SpoolerError):
    """The job is in a state where the command does not apply (e.g. retry of a dead
    job without --force). An extension kind of the job runner."""

    kind, http_status = "failed_precondition", 409


class SpoolUnusable(SpoolerError):
    """The spool directory or its database cannot be used: not a directory,
    read-only, corrupt, the disk full. An extension kind of the job runner."""

    kind = "spool_unusable"


def transition(state: str, event: str) -> str:
    to = TRANSITIONS.get((event, state))
    if to is None:
        hint = " (use --force)" if event == "retry" and state == DEAD else ""
        what = "retry, even with --force," if event == "retry_force" else event.replace("_", " ")
        raise JobStateConflict(f"cannot {what} a job that is {state}{hint}")
    return to


def backoff_s(failures: int) -> float:
    """Delay before the next attempt after the ``failures``-th job-owned failure:
    2, 4, 8, 16, 32, 60, 60, ... seconds."""
    if failures < 1:
        return 0.0
    if failures > 16:  # avoid huge powers; long past the cap anyway
        return knobs.BACKOFF_CAP_S
    return min(knobs.BACKOFF_CAP_S, knobs.BACKOFF_BASE_S * 2 ** (failures - 1))


@dataclass(frozen=True)
class Decision:
    event: str
    failure_count: int
    crash_count: int
    run_after: Optional[float]   # when queued again: not eligible before this
    failure_reason: Optional[str]


def after_attempt(reason: Optional[str], failure_count: int, crash_count: int, max_retries: int,
                  now: float) -> Decision:
    """What a finished attempt does to its job. ``reason`` None means exit 0."""
    if reason is None:
        return Decision("succeed", failure_count, crash_count, None, None)
    if reason in JOB_OWNED:
        failures = failure_count + 1
        if failures > max_retries:
            return Decision("fail_dead", failures, crash_count, None, reason)
        return Decision("fail_retry", failures, crash_count, now + backoff_s(failures), reason)
    if reason == WORKER_STOPPED:
        return Decision("interrupt", failure_count, crash_count, now, reason)
    raise ValueError(f"not an attempt outcome: {reason}")


def after_crash(failure_count: int, crash_count: int, max_crashes: Optional[int], now: float) -> Decision:
    """A reaped job: requeued at once (the job did nothing wrong), dead past --max-crashes."""
    crashes = crash_count + 1
    if max_crashes is not None and crashes > max_crashes:
        return Decision("crash_dead", failure_count, crashes, None, WORKER_CRASHED)
    return Decision("crash_requeue", failure_count, crashes, now, WORKER_CRASHED)
