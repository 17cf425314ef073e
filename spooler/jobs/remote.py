"""The cluster back-end: the same executor, fed from a Spooler queue.

``submit --queue Q`` sends a JSON job message; ``worker --queue Q`` leases it,
renews the lease as its heartbeat, acks on success, nacks with the backoff
delay on a job-owned failure, and moves it to the queue's failure queue (which
plays ``dead``) once the job's ``max_retries`` is spent.

Differences from the local spool, by design:

* A worker crash is a lease expiry, which the queue counts as a retry (the
  server raises the retry count on expiry). There is no separate crash budget:
  the lease timeout decides when the job runs again. The spool's reaper still
  runs (as in any worker on the spool, with the same PID probing): a dead
  worker's command is killed and its row closed, so that the command does not
  run on beside the job's next attempt.
* A message has no priority; ``--priority`` is carried in the body and
  reported, not used for ordering.
* ``--key`` becomes the message dedup key and works within the queue's dedup
  window (set to ``DEDUP_WINDOW_S`` when spoolctl creates the queue).
* Outputs stay on the machine of the worker that ran the attempt; that
  worker's spool records the job (``backend: spooler``) with the attempt's host
  and file paths, and a message moved to the failure queue carries them in
  ``spoolctl_result``.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Optional

import apsw

from spooler import errors
from spooler.jobs import executor, knobs, reaper, states
from spooler.jobs.store import Claim, Store, WorkerIdentity, validate_command, validate_job_options
from spooler.jobs.worker import Progress, Worker

JOB_FORMAT = 1
DEDUP_WINDOW_S = 86400.0


def job_body(command: list, priority: int, max_retries: int, max_crashes: Optional[int],
             timeout_s: Optional[float], key: Optional[str], cwd: Optional[str], now: float) -> dict:
    return {"spoolctl_job": JOB_FORMAT, "command": command, "cwd": cwd, "priority": priority,
            "max_retries": max_retries, "max_crashes": max_crashes, "timeout_s": timeout_s,
            "key": key, "submitted_at": now}


def parse_body(body: bytes) -> dict:
    try:
        job = json.loads(body)
    except ValueError:
        raise errors.InvalidArgument("message body is not JSON") from None
    if not isinstance(job, dict) or job.get("spoolctl_job") != JOB_FORMAT:
        raise errors.InvalidArgument("message is not a spoolctl job (format 1)")
    command, cwd, timeout_s = job.get("command"), job.get("cwd"), job.get("timeout_s")
    if (not isinstance(command, list) or not all(isinstance(a, str) for a in command)
            or not (cwd is None or isinstance(cwd, str))
            or not (timeout_s is None or (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)))):
        raise errors.InvalidArgument("message is not a valid spoolctl job: command must be a list of strings, "
                                     "cwd a string, timeout_s a number")
    try:
        command = validate_command(command)
        validate_job_options(int(job.get("priority") or 0), int(job.get("max_retries", knobs.DEFAULT_MAX_RETRIES)),
                             None, job.get("timeout_s"), None)
    except (TypeError, ValueError, OverflowError) as e:  # a field of the wrong type (a sender not spoolctl)
        raise errors.InvalidArgument(f"message is not a valid spoolctl job: {e}") from None
    job["command"] = command
    return job


def ensure_queue(client, queue: str, max_retries: int = knobs.DEFAULT_MAX_RETRIES,
                 dedup: bool = False) -> dict:
    """The queue document; created (maxRetries = the job's budget) if missing."""
    try:
        return client.get_queue(queue)
    except errors.QueueNotFound:
        settings = {"maxRetries": max_retries}
        if dedup:
            settings["dedupWindowSeconds"] = DEDUP_WINDOW_S
        try:
            return client.put_queue(queue, **settings)
        except errors.InvalidArgument:
            return client.put_queue(queue, maxRetries=max_retries)


def submit(client, queue: str, command: list, priority: int = knobs.DEFAULT_PRIORITY,
           max_retries: int = knobs.DEFAULT_MAX_RETRIES, max_crashes: Optional[int] = None,
           timeout_s: Optional[float] = None, key: Optional[str] = None, cwd: Optional[str] = None) -> dict:
    command = validate_command(command)
    validate_job_options(priority, max_retries, max_crashes, timeout_s, key)
    doc = ensure_queue(client, queue, max_retries, dedup=key is not None)
    if key is not None and not (doc.get("settings") or {}).get("dedupWindowSeconds"):
        # the queue would store a repeat as a new job: "a repeat returns the first id" would be false
        raise errors.InvalidArgument(f"queue {queue} has no dedup window, so --key cannot keep a repeat from "
                                     f"running twice: give the queue one (spoolctl queue update {queue} "
                                     "--dedup-window SECONDS) or submit without --key")
    body = job_body(command, priority, max_retries, max_crashes, timeout_s, key, cwd, time.time())
    r = client.send(queue, json.dumps(body).encode(), dedup_key=key)
    return {"id": r["id"], "duplicate": bool(r.get("duplicate")), "state": states.QUEUED,
            "priority": priority, "command": command, "key": key, "backend": "spooler", "queue": queue,
            "max_retries": max_retries, "max_crashes": max_crashes, "timeout_s": timeout_s,
            "crash_count": 0, "failure_reason": None, "attempts": [],
            # the job gets min(max_retries, this) retries: the queue moves it past its own
            "queue_max_retries": int((doc.get("settings") or {}).get("maxRetries", max_retries))}


def _why_lost(e: errors.SpoolerError) -> str:
    """Why a running job's lease is gone, from a refused renewal: "queue" when its
    queue was deleted (queue_not_found); "settled" when its message was settled by
    no one here, which for a lease this worker still holds means the queue was
    deleted and made again under the name (the message went with the old one), or
    that a redrive moved the message to another queue (it runs again from there);
    "lease" when it expired or predates a primary change (the queue redelivers)."""
    if isinstance(e, errors.QueueNotFound):
        return "queue"
    return "settled" if getattr(e, "reason", None) == "settled" else "lease"


BUSY_RETRY_S = 120.0  # as the local worker's _finish: a result must land, a busy spool is waited out


def _busy_retried(fn, *args):
    """``fn(*args)`` on the spool, tried again while the spool is busy (another
    process holds its write lock), for at most BUSY_RETRY_S: a settled job's record
    is not dropped, nor its slot stopped, for a busy moment."""
    deadline = time.monotonic() + BUSY_RETRY_S
    while True:
        try:
            return fn(*args)
        except apsw.BusyError:
            if time.monotonic() > deadline:
                raise


class RemoteWorker:
    _fail = Worker._fail  # (as run() borrows Worker._install_signals)

    def __init__(self, client_factory, queue: str, spool_dir: str, settings: knobs.Settings,
                 concurrency: int = 1, drain: bool = False, progress=None, server: str = ""):
        if not 1 <= concurrency <= knobs.CONCURRENCY_MAX:
            raise errors.InvalidArgument(f"--concurrency must be in [1, {knobs.CONCURRENCY_MAX}]")
        self.client_factory = client_factory
        self.queue = queue
        self.spool_dir = spool_dir
        self.settings = settings
        self.concurrency = concurrency
        self.drain = drain
        self.progress = Progress(progress)
        self.source = f"{server.rstrip('/')}/v1/queues/{queue}"
        self.identity = WorkerIdentity.current(settings.heartbeat_interval_s)
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._active: dict = {}   # token -> (job id, attempt n) of each running job
        self._lost: dict = {}     # token -> why its attempt is gone: _why_lost's, or "reaped"
        self.stats = {"claimed": 0, "succeeded": 0, "failed": 0, "dead": 0, "stopped": 0, "lease_lost": 0,
                      "reaped": 0, "transient_errors": 0}
        self._hung_watch = reaper.HungWatch(knobs.HUNG_REAP_MULTIPLE * settings.own_reap_threshold_s)
        self.reap_every_s = max(0.05, min(1.0, settings.heartbeat_interval_s / 2))
        self._last_reap = 0.0
        self.errors: list = []
        self.failure_queue = f"{queue}.failed"
        self.renew_every_s = settings.heartbeat_interval_s
        self.queue_max_retries = knobs.DEFAULT_MAX_RETRIES  # the queue's maxRetries (run() reads it)

    def run(self) -> dict:
        client = self.client_factory()
        doc = ensure_queue(client, self.queue)
        st = doc.get("settings") or {}
        self.failure_queue = st.get("failureQueue") or self.failure_queue
        lease_s = float(st.get("leaseTimeoutSeconds") or 30.0)
        # the queue moves a message whose retry count would pass its maxRetries on its
        # own, without a spoolctl_result: a job's budget can be no larger
        self.queue_max_retries = int(st.get("maxRetries", knobs.DEFAULT_MAX_RETRIES))
        self.renew_every_s = max(0.05, min(self.settings.heartbeat_interval_s, lease_s / 3))
        store = Store(self.spool_dir, self.settings.busy_timeout_s)
        try:
            self._reap(store)  # a crashed worker's commands end before this one takes jobs
        finally:
            store.close()
        restore = Worker._install_signals(self)   # same SIGTERM/SIGINT handling
        renew = threading.Thread(target=self._renew_loop, name="renew", daemon=True)
        renew.start()
        beat = threading.Thread(target=self._spool_loop, name="heartbeat", daemon=True)
        beat.start()
        slots = [threading.Thread(target=self._slot_main, daemon=True) for _ in range(self.concurrency)]
        for t in slots:
            t.start()
        try:
            while True:
                alive = [t for t in slots if t.is_alive()]
                if not alive:
                    break
                alive[0].join(timeout=0.5)
                self.progress.show(self.stats["succeeded"], self.stats["failed"], self._left(client))
        finally:
            self.stop_event.set()
            for t in slots:
                t.join()
            self.progress.end()
            restore()
        renew.join(timeout=5.0)
        beat.join(timeout=5.0)
        return {"worker_id": self.identity.worker_id, "pid": self.identity.pid, "backend": "spooler",
                "queue": self.queue, **self.stats, "errors": self.errors[:10]}

    def _read_settings(self, client) -> None:
        """The queue's maxRetries and failure queue as they are now (an operator may
        have changed them since the worker started), read before a job's failure is
        settled; the last figures read stand when the server does not answer.
        queue_not_found is raised: the caller's record ends as for a deleted queue."""
        try:
            st = client.get_queue(self.queue).get("settings") or {}
        except errors.QueueNotFound:
            raise
        except errors.SpoolerError:
            return
        self.queue_max_retries = int(st.get("maxRetries", self.queue_max_retries))
        self.failure_queue = st.get("failureQueue") or f"{self.queue}.failed"

    def _left(self, client) -> int:
        if self.progress.stream is None:
            return 0
        try:
            s = client.get_queue(self.queue).get("stats") or {}
            return int(s.get("visible", 0)) + int(s.get("delayed", 0)) + int(s.get("leased", 0))
        except errors.SpoolerError:
            return 0

    def _bump(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _reap(self, store: Store) -> None:
        """The spool's reaper (as a local worker runs it): jobs of workers found
        dead, cluster jobs included, have their commands killed and rows closed."""
        self._last_reap = time.monotonic()
        try:
            for r in reaper.reap_pass(store, self.settings.reap_threshold_override_s, watch=self._hung_watch):
                if r.new_state is not None:
                    self._bump("reaped")
        except apsw.BusyError:
            pass  # the next beat tries again

    def _renew_loop(self) -> None:
        """Every renewal interval, each running job's lease is renewed; one refused
        as stale (or whose queue is gone) is marked lost, and its command stopped.
        Any other failure (an answer that cannot be read) stops the worker, saying
        why: running on without renewals, its leases would expire under its jobs."""
        try:
            self._renew_each()
        except Exception as e:  # noqa: BLE001
            self._fail("renewing leases", e)

    def _renew_each(self) -> None:
        client = self.client_factory()
        while not self.stop_event.wait(self.renew_every_s):
            with self._lock:
                tokens = list(self._active)
            for tok in tokens:
                try:
                    client.renew(tok)
                except (errors.StaleLease, errors.QueueNotFound) as e:
                    with self._lock:
                        if tok in self._active:  # (its slot may have settled it meanwhile: nothing to mark)
                            self._lost[tok] = _why_lost(e)
                except errors.SpoolerError:
                    pass   # unreachable for now: try again next beat, the lease may still hold

    def _spool_loop(self) -> None:
        """Every renewal interval, in a thread of its own (renewals to a server slow
        to answer must not hold it back): the spool's rows of this worker's running
        jobs are touched (their heartbeat, which other workers' reapers read), an
        attempt found no longer this worker's (reaped while it looked hung) is
        marked, and every reap interval the spool is reaped. A heartbeat that fails
        with anything but a busy spool stops the worker, as a local one's does."""
        store = Store(self.spool_dir, self.settings.busy_timeout_s)
        try:
            while not self.stop_event.wait(self.renew_every_s):
                with self._lock:
                    owned = {pair: tok for tok, pair in self._active.items()}
                if owned:
                    try:
                        gone = store.heartbeat(self.identity, set(owned))
                    except apsw.BusyError:
                        gone = set()   # next beat; the reap threshold is several beats long
                    with self._lock:
                        for pair in gone:
                            if owned[pair] in self._active:
                                self._lost.setdefault(owned[pair], "reaped")
                if time.monotonic() - self._last_reap >= self.reap_every_s:
                    self._reap(store)
        except Exception as e:  # noqa: BLE001
            self._fail("heartbeat", e)
        finally:
            store.close()

    def _slot_main(self) -> None:
        try:
            self._slot()
        except Exception as e:  # a broken slot must not hang --drain
            self._fail("slot", e)

    def _slot(self) -> None:
        client = self.client_factory()
        store = Store(self.spool_dir, self.settings.busy_timeout_s)
        try:
            while not self.stop_event.is_set():
                try:
                    d = client.receive(self.queue, wait_s=0.5 if self.drain else knobs.REMOTE_RECEIVE_WAIT_S)
                except (errors.Unavailable, errors.OperationUnconfirmed) as e:
                    # an unconfirmed receive may have leased a message we never saw: it
                    # expires and comes back with its retry count raised
                    self._bump("transient_errors")
                    self.stop_event.wait(min(5.0, max(0.2, e.retry_after_s or 1.0)))
                    continue
                except errors.QueueNotFound as e:
                    # deleted under the worker: nothing more will come from it (the other
                    # slots' running jobs end as their leases went, with the queue)
                    with self._lock:
                        first = not self.stop_event.is_set()
                        self.stop_event.set()
                    if first:
                        self.errors.append(f"queue_not_found: {e.message}")
                        print(f"spoolctl worker: queue {self.queue} does not exist (any more); stopping",
                              file=sys.stderr)
                    return
                if d is None:
                    if self.drain and self._drained(client):
                        return
                    continue
                try:
                    self._handle(client, store, d)
                except errors.SpoolerError as e:
                    # the message is not settled: its lease expires and it comes back
                    self._bump("transient_errors")
                    print(f"spoolctl worker: message {d.id}: {e.kind}: {e.message}", file=sys.stderr)
        finally:
            store.close()

    def _drained(self, client) -> bool:
        with self._lock:
            if self._active:
                return False
        s = client.get_queue(self.queue).get("stats") or {}
        return int(s.get("visible", 0)) + int(s.get("delayed", 0)) + int(s.get("leased", 0)) == 0

    def _handle(self, client, store: Store, d) -> None:
        self._bump("claimed")
        try:
            job = parse_body(d.body)
        except errors.SpoolerError as e:
            self._bury(client, d, {"spoolctl_result": {"failure_reason": "invalid_job", "detail": e.message},
                                   "raw": d.body.decode("utf-8", "replace")})
            return
        claim = store.begin_remote(self.identity, d.id, self.source, job["command"], job.get("cwd"),
                                   int(job.get("priority") or 0), int(job["max_retries"]), job.get("timeout_s"))
        with self._lock:
            self._active[d.token] = (d.id, claim.n)
        try:
            env = dict(os.environ, SPOOLCTL_JOB_ID=d.id, SPOOLCTL_ATTEMPT=str(claim.n),
                       SPOOLCTL_RETRY_COUNT=str(d.retry_count))
            env[executor.ATTEMPT_ENV] = f"{d.id}:{claim.n}"
            res = executor.run(claim.command, claim.stdout, claim.stderr, claim.timeout_s, cwd=claim.cwd, env=env,
                               on_spawn=lambda pid: store.record_pid(claim, pid),
                               should_stop=lambda: self._should_stop(d.token))
        finally:
            with self._lock:
                self._active.pop(d.token, None)
                lost = self._lost.pop(d.token, None)
        self._settle(client, store, d, job, claim, res, lost)

    def _should_stop(self, token: str) -> Optional[str]:
        if self.stop_event.is_set():
            return states.WORKER_STOPPED
        with self._lock:
            return states.LEASE_LOST if token in self._lost else None

    def _settle(self, client, store: Store, d, job: dict, claim: Claim, res: executor.Result,
                lost: Optional[str]) -> None:
        """``lost``: why the lease went while the command ran (_why_lost, or
        "reaped"), or None."""
        reason, detail = res.reason, res.detail
        if lost == "reaped" or not _busy_retried(store.owns, claim):
            # Reaped by another worker on the spool while this one looked hung (its
            # command killed by that reaper), or the row taken by another attempt:
            # the row is not ours to write, and the command's end is not the job's
            # failure. A lease that may still hold is given back at once (a nack: a
            # retry counted, as for a stopped worker), not left to expire.
            if lost in (None, "reaped"):
                try:
                    client.nack(d.token)
                except errors.SpoolerError:
                    pass   # gone already: the queue redelivers it as it would
            return
        if lost == "queue":
            self._queue_gone(store, claim, res, d, f"queue {self.queue} was deleted while it ran, "
                                                   "and its messages with it")
            return
        if lost == "settled":
            self._queue_gone(store, claim, res, d, f"its message left queue {self.queue} while it ran without "
                                                   "being settled here (the queue was deleted and made again, or "
                                                   "a redrive moved it to another queue, from which it runs again)")
            return
        if lost or reason == states.LEASE_LOST:
            # someone else may hold it now: do not settle; the queue redelivers it
            self._bump("lease_lost")
            _busy_retried(store.finish_remote, claim, states.LEASE_LOST, res.exit_code, states.QUEUED, d.retry_count,
                                "lease expired while running; the queue will redeliver")
            return
        try:
            if reason is None:
                client.ack(d.token)
                self._bump("succeeded")
                _busy_retried(store.finish_remote, claim, None, res.exit_code, states.SUCCEEDED, d.retry_count, detail)
            elif reason == states.WORKER_STOPPED:
                # A queue has no uncounted give-back of a lease over HTTP: the nack
                # spends a retry, as a crash's lease expiry does (docs/jobs.md)
                self._read_settings(client)
                client.nack(d.token)
                self._bump("stopped")
                if d.retry_count + 1 > self.queue_max_retries:  # the queue moved it: not queued any more
                    _busy_retried(store.finish_remote, claim, reason, res.exit_code, states.DEAD, d.retry_count,
                                        f"{detail}; given back with a nack on the queue's last retry "
                                        f"(maxRetries {self.queue_max_retries}): the queue moved it to "
                                        f"{self.failure_queue}")
                else:
                    _busy_retried(store.finish_remote, claim, reason, res.exit_code, states.QUEUED, d.retry_count,
                                        f"{detail}; given back with a nack, which the queue counts as a retry")
            else:
                self._read_settings(client)
                failures = d.retry_count + 1
                budget = min(int(job["max_retries"]), self.queue_max_retries)
                if failures > budget:
                    if budget < int(job["max_retries"]):
                        detail = (f"{detail}; the queue's maxRetries ({budget}) is below the job's "
                                  f"max_retries ({job['max_retries']})")
                    result = {"failure_reason": reason, "exit_code": res.exit_code, "detail": detail,
                              "host": self.identity.host, "worker_id": self.identity.worker_id,
                              "stdout": claim.stdout, "stderr": claim.stderr, "retry_count": d.retry_count,
                              "finished_at": time.time()}
                    self._bury(client, d, dict(job, spoolctl_result=result))
                    self._bump("failed")
                    _busy_retried(store.finish_remote, claim, reason, res.exit_code, states.DEAD, d.retry_count, detail)
                else:
                    delay_s = states.backoff_s(failures)
                    client.nack(d.token, delay_s=delay_s)
                    self._bump("failed")
                    _busy_retried(store.finish_remote, claim, reason, res.exit_code, states.QUEUED, d.retry_count,
                                        f"{detail}; redelivery in {delay_s:g}s")
        except errors.StaleLease as e:
            self._bump("lease_lost")
            _busy_retried(store.finish_remote, claim, reason or None, res.exit_code,
                                states.SUCCEEDED if reason is None else states.QUEUED, d.retry_count,
                                f"{detail}; settling failed ({e.reason or e.message}): the queue will redeliver")
        except errors.QueueNotFound:
            self._queue_gone(store, claim, res, d, f"queue {self.queue} was deleted while it was being settled, "
                                                   "and its messages with it")

    def _queue_gone(self, store: Store, claim: Claim, res: executor.Result, d, note: str) -> None:
        """The job's message is gone from its queue (``note`` says how: the queue was
        deleted), its lease with it: nothing will deliver this job again, so its
        record ends now, never running or queued for good: succeeded if its command
        did (unacked: there is nothing to ack), else dead with the command's own
        reason (or lease_lost, if it was stopped for this)."""
        detail = f"{res.detail}; {note}" if res.detail else note
        if res.reason is None:
            self._bump("succeeded")
            _busy_retried(store.finish_remote, claim, None, res.exit_code, states.SUCCEEDED, d.retry_count, detail)
        else:
            self._bump("lease_lost")
            _busy_retried(store.finish_remote, claim, res.reason, res.exit_code, states.DEAD, d.retry_count, detail)

    def _bury(self, client, d, body: dict) -> None:
        """Move to the failure queue: send there first, then ack (a crash between the
        two leaves a duplicate in the failure queue, never a lost job)."""
        data, key = json.dumps(body).encode(), f"dead:{d.id}:{d.retry_count}"
        try:
            client.send(self.failure_queue, data, dedup_key=key)
        except errors.QueueNotFound:   # the server makes it on demand only for its own moves
            ensure_queue(client, self.failure_queue)
            client.send(self.failure_queue, data, dedup_key=key)
        client.ack(d.token)
        self._bump("dead")
