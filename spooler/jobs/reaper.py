"""Crash recovery without a daemon: workers reap as they claim.

A running job whose heartbeat is older than its reap threshold is a candidate.
Its worker's PID is then checked (the order matters and is the contract):

* ``os.kill(pid, 0)`` raises ProcessLookupError -> dead
* ``os.kill(pid, 0)`` raises PermissionError    -> inconclusive, treated as alive
* it succeeds -> the process exists; if it started at another time than the
  worker did (the start time is part of the worker id), or its command line does
  not carry the spoolctl marker, the PID was recycled by another process -> dead.
  The start time is what catches a PID taken over by another spoolctl process,
  such as a new worker in a restarted container.

The marker: an argv element containing ``spoolctl`` (the console script), or
``-m`` followed by ``spooler`` / ``spooler.<anything>`` (``python -m spooler``).
A worker recorded under another host name is never judged (its PIDs are not
ours to probe): inconclusive, left alone.

Only then does :meth:`Store.reap` requeue it, in its own BEGIN IMMEDIATE that
re-checks staleness and ownership.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional

from spooler.jobs import executor
from spooler.jobs.store import Store, process_start, start_of

DEAD, ALIVE, RECYCLED, INCONCLUSIVE = "dead", "alive", "recycled", "inconclusive"
HUNG = "hung"  # alive with the marker, but its heartbeat stood still for the hung watch: reaped


def is_spoolctl_argv(argv: list) -> bool:
    for i, a in enumerate(argv):
        if "spoolctl" in a:
            return True
        if a == "-m" and i + 1 < len(argv):
            mod = argv[i + 1]
            if mod == "spooler" or mod.startswith("spooler."):
                return True
        if a.startswith("-m") and (a[2:] == "spooler" or a[2:].startswith("spooler.")):
            return True
    return False


def read_cmdline(pid: int) -> Optional[list]:
    """argv of ``pid``; None if it cannot be read (gone, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
        return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            return None
    except OSError:
        return None
    try:  # no /proc (macOS, BSD): ask ps
        out = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True,
                             timeout=5.0)
        return out.stdout.split() if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def liveness(pid: Optional[int], host: Optional[str] = None, *, my_host: Optional[str] = None,
             kill: Callable = os.kill, cmdline: Callable = read_cmdline, start: Optional[int] = None,
             started: Callable = process_start) -> str:
    """DEAD / RECYCLED mean reapable; ALIVE / INCONCLUSIVE mean leave it alone.
    ``start``: when the worker's process started (None: not recorded)."""
    my_host = socket.gethostname() if my_host is None else my_host
    if host is not None and host != my_host:
        return INCONCLUSIVE
    if not pid or pid <= 0:
        return DEAD
    try:
        kill(pid, 0)
    except ProcessLookupError:
        return DEAD
    except PermissionError:
        return INCONCLUSIVE
    if start is not None:
        now_start = started(pid)
        if now_start is not None and now_start != start:
            return RECYCLED
    argv = cmdline(pid)
    if argv is None:
        # vanished between the two checks (dead), or unreadable (inconclusive)
        try:
            kill(pid, 0)
        except ProcessLookupError:
            return DEAD
        except PermissionError:
            return INCONCLUSIVE
        return INCONCLUSIVE
    return ALIVE if is_spoolctl_argv(argv) else RECYCLED


@dataclass
class ReapResult:
    job_id: str
    verdict: str          # liveness verdict
    new_state: Optional[str]   # None: not touched (alive, or re-check failed)


class HungWatch:
    """What one reaping worker has seen of stale jobs whose workers probe alive:
    when it first saw each heartbeat, on its own monotonic clock (which stops while
    the machine sleeps: a laptop's suspend makes nobody hung). A heartbeat that has
    stood still for ``after_s`` of that clock marks its worker hung."""

    def __init__(self, after_s: float, clock: Callable[[], float] = time.monotonic):
        self.after_s, self.clock = after_s, clock
        self.first_seen: dict = {}   # (worker id, job id, attempt, heartbeat_at) -> clock()
        self._seen: set = set()

    def hung(self, cand) -> bool:
        key = (cand.worker_id, cand.job_id, cand.n, cand.heartbeat_at)
        self._seen.add(key)
        first = self.first_seen.setdefault(key, self.clock())
        return self.clock() - first >= self.after_s

    def end_pass(self) -> None:
        """Forget what this pass did not see again (it heartbeated, or ended)."""
        self.first_seen = {k: v for k, v in self.first_seen.items() if k in self._seen}
        self._seen = set()


def reap_pass(store: Store, threshold_override_s: Optional[float] = None, now: Optional[float] = None,
              limit: int = 100, *, kill: Callable = os.kill, cmdline: Callable = read_cmdline,
              my_host: Optional[str] = None, watch: Optional[HungWatch] = None) -> list:
    """Scan for stale running jobs, confirm their workers are dead, reap them.

    Each worker is judged once per pass. The scan goes on past a page of jobs
    whose workers look alive (a frozen worker, one on another host), at most
    ``REAP_PAGES_MAX`` pages, so that they cannot hide a dead worker's job
    behind them for ever. ``watch``: the calling worker's HungWatch; a job whose
    worker probes alive is then reaped once the watch has seen its heartbeat
    stand still long enough (seed 000: a truly hung worker is eventually reaped)."""
    results = []
    now_s = time.time() if now is None else now
    verdicts: dict = {}
    for _ in range(REAP_PAGES_MAX):
        spared = [w for w, v in verdicts.items() if v in (ALIVE, INCONCLUSIVE)]
        page = store.reap_candidates(now_s, threshold_override_s, limit, skip_workers=spared)
        if not page:
            break
        judged_before = len(verdicts)
        reaped = [_reap_one(store, cand, verdicts, now, now_s, threshold_override_s, my_host, kill, cmdline, watch)
                  for cand in page]
        results += reaped
        if len(verdicts) == judged_before and all(r.new_state is None for r in reaped):
            break  # nothing new judged, nothing reaped: the next page would be this one
    if watch is not None:
        watch.end_pass()
    return results


REAP_PAGES_MAX = 10


def _reap_one(store, cand, verdicts, now, now_s, threshold_override_s, my_host, kill, cmdline,
              watch=None) -> "ReapResult":
    verdict = verdicts.get(cand.worker_id)
    if verdict is None:
        verdict = verdicts[cand.worker_id] = liveness(cand.worker_pid, cand.worker_host, my_host=my_host,
                                                      kill=kill, cmdline=cmdline, start=start_of(cand.worker_id))
    never_beat = cand.backend != "local" and cand.heartbeat_at == cand.started_at
    if (verdict == ALIVE and watch is not None and (cand.heartbeat_at or 0.0) <= now_s and not never_beat
            and watch.hung(cand)):
        # (a heartbeat "in the future", after a clock step back, is never judged hung;
        # nor a cluster row never touched since its start: spoolctl before 0.4.18 did
        # not heartbeat those, and its live worker would be taken for a hung one)
        verdict = HUNG
    if verdict in (ALIVE, INCONCLUSIVE):
        return ReapResult(cand.job_id, verdict, None)
    age = now_s - (cand.heartbeat_at or 0.0)
    detail = (f"worker pid {cand.worker_pid} on {cand.worker_host} is {verdict}; "
              f"last heartbeat {age:.1f}s ago")
    # the clock inside reap() is read again: the candidate scan and the liveness
    # probe took time, and the re-check must use the time of the transaction.
    # The dead worker's command may still run (it has its own session). Stop it
    # BEFORE the requeue commits, so no new attempt can start while it runs, and
    # only once reap() has checked again, under the spool's write lock, that the
    # worker is still stale (a hung worker that woke and heartbeated keeps its
    # command); only processes carrying this attempt's token are touched. A
    # command whose pid was never written (its worker died within
    # PID_RECORD_AFTER_S of the spawn) is looked for by the token alone.
    new_state = store.reap(cand, detail, None if now is None else now, threshold_override_s,
                           before=lambda: executor.kill_orphans(cand.pgid or None, f"{cand.job_id}:{cand.n}"))
    return ReapResult(cand.job_id, verdict, new_state)
