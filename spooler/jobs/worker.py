"""The local worker: N slot threads claiming from the spool, one heartbeat thread.

Each slot has its own apsw connection. A slot reaps (rate-limited, one slot
at a time) before it claims, so crash recovery needs no daemon: any worker
that is looking for work also looks for jobs orphaned by dead workers.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional, TextIO

import apsw

from spooler.jobs import executor, knobs, reaper, states
from spooler.jobs.store import Claim, Store, WorkerIdentity

CLAIM_LATENCY_SAMPLES_MAX = 100_000
# Signals that stop a worker and that a service manager or a terminal sends to the
# job's processes as well: a job they end while its worker stops did not fail.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL})
# How long a job that died of one of them waits for its worker's own stop
# (signals sent to a whole unit at once arrive in any order).
STOP_SIGNAL_GRACE_S = 0.5


def percentile(samples: list, q: float) -> Optional[float]:
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class Progress:
    """One self-overwriting line on a terminal: attempts succeeded / failed, jobs left."""

    def __init__(self, stream: Optional[TextIO]):
        self.stream = stream
        self.last = ""

    def show(self, done: int, failed: int, left: int) -> None:
        if self.stream is None:
            return
        line = f"spoolctl worker: {done} succeeded, {failed} failed, {left} left"
        if line != self.last:
            self.stream.write("\r\033[K" + line)
            self.stream.flush()
            self.last = line

    def end(self) -> None:
        if self.stream is not None and self.last:
            self.stream.write("\n")
            self.stream.flush()


class Worker:
    def __init__(self, spool_dir: str, settings: knobs.Settings, concurrency: int = 1, drain: bool = False,
                 progress: Optional[TextIO] = None):
        if not 1 <= concurrency <= knobs.CONCURRENCY_MAX:
            from spooler.errors import InvalidArgument
            raise InvalidArgument(f"--concurrency must be in [1, {knobs.CONCURRENCY_MAX}]")
        self.spool_dir = spool_dir
        self.settings = settings
        self.concurrency = concurrency
        self.drain = drain
        self.progress = Progress(progress)
        self.identity = WorkerIdentity.current(settings.heartbeat_interval_s)
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        # by attempt, (job_id, n): one job's two attempts (a canceled one not yet
        # stopped, and its retry) are two entries, and a loss seen for one never
        # stops the other
        self._owned: set = set()
        self._lost: set = set()
        self._reap_lock = threading.Lock()
        self._last_reap = 0.0
        # jobs of workers that probe alive but do not heartbeat: reaped once this worker
        # has watched them stand still for ten of its reap thresholds (reaper.HungWatch)
        self._hung_watch = reaper.HungWatch(knobs.HUNG_REAP_MULTIPLE * self.settings.own_reap_threshold_s)
        self.reap_every_s = max(0.05, min(1.0, settings.heartbeat_interval_s / 2))
        self.stats = {"claimed": 0, "succeeded": 0, "failed": 0, "stopped": 0, "canceled": 0, "reaped": 0,
                      "busy_timeouts": 0}
        self.claim_latencies_s: list = []
        self.errors: list = []

    # --- public -----------------------------------------------------------
    def run(self) -> dict:
        Store(self.spool_dir, self.settings.busy_timeout_s).close()   # create the spool once, up front
        restore = self._install_signals()
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        slots = [threading.Thread(target=self._slot_main, name=f"slot-{i}", daemon=True)
                 for i in range(self.concurrency)]
        for t in slots:
            t.start()
        view = Store(self.spool_dir, self.settings.busy_timeout_s) if self.progress.stream else None
        try:
            while True:
                alive = [t for t in slots if t.is_alive()]
                if not alive:
                    break
                alive[0].join(timeout=0.25)
                if view is not None:
                    self._show_progress(view)
        finally:
            self.stop_event.set()
            for t in slots:
                t.join()
            if view is not None:
                self._show_progress(view)
                view.close()
            self.progress.end()
            restore()
        hb.join(timeout=5.0)
        return self.summary()

    def stop(self) -> None:
        self.stop_event.set()

    def summary(self) -> dict:
        lat = self.claim_latencies_s
        ms = (lambda v: None if v is None else round(v * 1000, 3))
        return {"worker_id": self.identity.worker_id, "pid": self.identity.pid, "backend": "local",
                **self.stats,
                "claim_latency_ms": {"count": len(lat), "p50": ms(percentile(lat, 0.50)),
                                     "p99": ms(percentile(lat, 0.99)), "max": ms(max(lat) if lat else None)},
                "errors": self.errors[:10]}

    # --- internals --------------------------------------------------------
    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            self.stop_event.set()

        for s in old:
            signal.signal(s, handler)

        def restore():
            for s, h in old.items():
                signal.signal(s, h)
        return restore

    def _show_progress(self, view: Store) -> None:
        try:
            c = view.counts()
        except apsw.BusyError:
            return
        self.progress.show(self.stats["succeeded"], self.stats["failed"], c[states.QUEUED] + c[states.RUNNING])

    def _bump(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _heartbeat_loop(self) -> None:
        """A heartbeat that fails for any reason but a busy spool (an I/O
        error, a full disk) stops the worker, as a broken slot does: it says why
        and exits 1, and its attempts end as worker_stopped (requeued, no retry
        spent). Left running without heartbeats it would no longer see its
        attempts canceled or lost, and their heartbeats would look hung."""
        try:
            self._beat()
        except Exception as e:
            self._fail("heartbeat", e)

    def _fail(self, what: str, e: BaseException) -> None:
        """A slot's or background thread's end: recorded, said on stderr, and the
        worker stops (its exit code 1). Shared with the --queue worker."""
        self.errors.append(f"{what}: {type(e).__name__}: {e}")
        self.stop_event.set()
        print(f"spoolctl worker: {what} failed: {type(e).__name__}: {e}", file=sys.stderr)

    def _beat(self) -> None:
        store = Store(self.spool_dir, self.settings.busy_timeout_s)
        try:
            while not self.stop_event.wait(self.settings.heartbeat_interval_s):
                with self._lock:
                    owned = set(self._owned)
                if not owned:
                    continue
                try:
                    lost = store.heartbeat(self.identity, owned)
                except apsw.BusyError:
                    continue   # next beat; the reap threshold is several beats long
                if lost:
                    self._note_lost(lost)
        finally:
            store.close()

    def _note_lost(self, lost: set) -> None:
        """Attempts a heartbeat found no longer ours: each is stopped (_should_stop).
        One that ended since the heartbeat's snapshot is no one's loss, and a later
        attempt of the same job is another pair, so neither is stopped for it."""
        with self._lock:
            self._lost |= lost & self._owned

    def _maybe_reap(self, store: Store) -> None:
        now = time.monotonic()
        if now - self._last_reap < self.reap_every_s or not self._reap_lock.acquire(blocking=False):
            return
        try:
            self._last_reap = now
            for r in reaper.reap_pass(store, self.settings.reap_threshold_override_s, watch=self._hung_watch):
                if r.new_state is not None:
                    self._bump("reaped")
        except apsw.BusyError:
            pass
        finally:
            self._reap_lock.release()

    def _slot_main(self) -> None:
        try:
            self._slot()
        except Exception as e:   # a broken slot must not hang --drain
            self._fail("slot", e)

    def _slot(self) -> None:
        store = Store(self.spool_dir, self.settings.busy_timeout_s)
        try:
            while not self.stop_event.is_set():
                self._maybe_reap(store)
                t0 = time.perf_counter()
                try:
                    claim = store.claim_next(self.identity)
                except apsw.BusyError:
                    self._bump("busy_timeouts")   # the job stays queued; next pass
                    continue
                if claim is not None:
                    with self._lock:
                        if len(self.claim_latencies_s) < CLAIM_LATENCY_SAMPLES_MAX:
                            self.claim_latencies_s.append(time.perf_counter() - t0)
                    self._execute(store, claim)
                    continue
                if self.drain:
                    c = store.counts()
                    if c[states.QUEUED] == 0 and c[states.RUNNING] == 0:
                        return
                wait_s = knobs.IDLE_POLL_S
                nxt = store.next_eligible_at()
                if nxt is not None:
                    wait_s = min(wait_s, max(0.005, nxt - time.time()))
                self.stop_event.wait(wait_s)
        finally:
            store.close()

    def _should_stop(self, attempt: tuple) -> Optional[str]:
        if self.stop_event.is_set():
            return states.WORKER_STOPPED
        with self._lock:
            if attempt in self._lost:
                return states.CANCELED_REASON
        return None

    def _execute(self, store: Store, claim: Claim) -> None:
        self._bump("claimed")
        attempt = (claim.job_id, claim.n)
        with self._lock:
            self._owned.add(attempt)
        try:
            env = dict(os.environ, SPOOLCTL_JOB_ID=claim.job_id, SPOOLCTL_ATTEMPT=str(claim.n))
            env[executor.ATTEMPT_ENV] = f"{claim.job_id}:{claim.n}"
            res = executor.run(claim.command, claim.stdout, claim.stderr, claim.timeout_s, cwd=claim.cwd,
                               env=env, on_spawn=lambda pid: self._record_pid(store, claim, pid),
                               should_stop=lambda: self._should_stop(attempt))
            self._finish(store, claim, res)
        finally:
            with self._lock:
                self._owned.discard(attempt)
                self._lost.discard(attempt)

    def _record_pid(self, store: Store, claim: Claim, pid: int) -> None:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                ours = store.record_pid(claim, pid)
                break
            except apsw.BusyError:
                if time.monotonic() > deadline:
                    raise
        if not ours:  # canceled before its pid was known: nobody else can stop it, we do now
            with self._lock:
                self._lost.add((claim.job_id, claim.n))

    def _finish(self, store: Store, claim: Claim, res: executor.Result) -> None:
        reason = res.reason
        if reason == states.CANCELED_REASON:
            reason = states.WORKER_STOPPED if self.stop_event.is_set() else reason
        elif (reason == states.NONZERO_EXIT and res.exit_code is not None and -res.exit_code in STOP_SIGNALS
              and self.stop_event.wait(STOP_SIGNAL_GRACE_S)):
            # the stop's signal reached the job too (a service manager signals the
            # whole unit, a terminal the whole foreground group), maybe a moment
            # before this worker: not the job's failure
            reason = states.WORKER_STOPPED
        # the result must land: keep retrying a busy lock (bounded) rather than drop it
        deadline = time.monotonic() + 120.0
        while True:
            try:
                new_state, owned = store.finish_attempt_owned(
                    claim, states.CANCELED_REASON if reason == states.LEASE_LOST else reason, res.exit_code,
                    res.detail)
                break
            except apsw.BusyError:
                if time.monotonic() > deadline:
                    raise
        if new_state == states.CANCELED:
            # canceled while it ran, whoever killed it (this worker at its heartbeat, or
            # `spoolctl cancel` itself, when the attempt can look like a non-zero exit here):
            # not the job's failure
            self._bump("canceled")
        elif not owned:
            pass  # reaped while this worker looked dead (it was hung): its end counts for nobody
        elif reason is None and new_state == states.SUCCEEDED:
            self._bump("succeeded")
        elif reason in states.JOB_OWNED:
            self._bump("failed")
        elif reason == states.WORKER_STOPPED:
            self._bump("stopped")
