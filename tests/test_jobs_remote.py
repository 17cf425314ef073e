"""The cluster back-end: submit --queue / worker --queue against a real spooler-node.

Uses the ``node`` fixture of tests/conftest.py (a running single node)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from jobs_helpers import REPO, pid_gone, spool, wait_until  # noqa: F401

pytestmark = pytest.mark.integration  # each test runs against a real spooler-node

if not os.path.exists(os.path.join(REPO, "node", "main.py")):
    pytest.skip("spooler-node (node/main.py) is not there yet", allow_module_level=True)

from spooler.http import HttpClient  # noqa: E402
from spooler.jobs import remote  # noqa: E402


def g(node):
    return ("--server", node.http_url, "--key", node.admin_key)


def queue_job(spool, node, queue: str, script: str, **settings):
    """A queue with these settings and one job on it (``sh -c script``) -> (client, job id)."""
    c = HttpClient(node.http_url, node.admin_key)
    c.put_queue(queue, **settings)
    msg_id = spool.run("submit", "--queue", queue, "--", "sh", "-c", script,
                       global_args=g(node)).stdout.decode().strip()
    return c, msg_id


def stop(w):
    """SIGTERM to a worker, and SIGKILL if it has not ended 30 s later (also when
    the test failed): every worker a test starts ends by its pid. -> its stdout."""
    w.send_signal(signal.SIGTERM)
    try:
        return w.communicate(timeout=30)[0]
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()


def test_submit_and_run_through_a_queue(spool, node):
    r = spool.run("submit", "--queue", "jobs", "--", "sh", "-c", "echo hello from $SPOOLCTL_JOB_ID",
                  global_args=g(node))
    msg_id = r.stdout.decode().strip()
    assert msg_id and len(r.stdout.split()) == 1
    summary = spool.json("worker", "--queue", "jobs", "--drain", global_args=g(node))
    assert summary["succeeded"] == 1 and summary["backend"] == "spooler"
    job = spool.job(msg_id)      # the worker's machine keeps the record and the output
    assert job["state"] == "succeeded" and job["backend"] == "spooler" and job["source"].endswith("/jobs")
    assert job["attempts"][0]["host"] and os.path.exists(job["attempts"][0]["stdout"])
    assert spool.run("output", msg_id).stdout == f"hello from {msg_id}\n".encode()
    stats = HttpClient(node.http_url, node.admin_key).get_queue("jobs")["stats"]
    assert stats["ackedTotal"] == 1 and stats["visible"] == 0 and stats["leased"] == 0


def test_key_dedups_submission_on_the_queue(spool, node):
    first = spool.json("submit", "--queue", "q1", "--key", "k-1", "--max-crashes", "2", "--", "true",
                       global_args=g(node))
    assert first["max_crashes"] == 2, first
    again = spool.json("submit", "--queue", "q1", "--key", "k-1", "--", "true", global_args=g(node))
    assert again["id"] == first["id"] and again["duplicate"] is True and first["duplicate"] is False
    assert HttpClient(node.http_url, node.admin_key).get_queue("q1")["stats"]["visible"] == 1


def test_a_key_on_a_queue_without_a_dedup_window_is_refused_not_ignored(spool, node):
    """A queue made before without a dedup window would store a repeat as a second
    job: --key there is an invalid_argument error, and nothing is sent."""
    c = HttpClient(node.http_url, node.admin_key)
    c.put_queue("q1n")
    r = spool.run("submit", "--queue", "q1n", "--key", "k-1", "--json", "--", "true", global_args=g(node),
                  check=False)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "invalid_argument", r
    assert c.get_queue("q1n")["stats"]["visible"] == 0


def test_failure_nacks_with_backoff_then_failure_queue_plays_dead(spool, node):
    msg_id = spool.run("submit", "--queue", "q2", "--max-retries", "1", "--", "sh", "-c", "echo bad >&2; exit 4",
                       global_args=g(node)).stdout.decode().strip()
    summary = spool.json("worker", "--queue", "q2", "--drain", global_args=g(node), timeout_s=60)
    assert summary["failed"] == 2 and summary["dead"] == 1
    job = spool.job(msg_id)
    assert job["state"] == "dead" and [a["exit_code"] for a in job["attempts"]] == [4, 4]
    a1, a2 = job["attempts"]
    assert a2["started_at"] - a1["finished_at"] >= 2.0 - 0.1, "nack delay = backoff 2 s"
    c = HttpClient(node.http_url, node.admin_key)
    d = c.receive("q2.failed")
    assert d is not None
    body = json.loads(d.body)
    assert body["command"] == ["sh", "-c", "echo bad >&2; exit 4"]
    res = body["spoolctl_result"]
    assert res["failure_reason"] == "nonzero_exit" and res["exit_code"] == 4
    assert res["host"] and res["stderr"] == a2["stderr"], "the dead message says where the output is"
    assert c.get_queue("q2")["stats"]["visible"] == 0
    # the worker sent its dead message there, then acked the job's own (J9): one copy in
    # the failure queue, not a second bare one that a nack past maxRetries would move there
    failed = c.get_queue("q2.failed")["stats"]
    assert (failed["visible"], failed["leased"], failed["delayed"]) == (0, 1, 0), failed
    q2 = c.get_queue("q2")["stats"]
    assert q2["ackedTotal"] == 1 and q2["failedTotal"] == 0, q2


def test_a_queue_whose_max_retries_is_below_the_jobs_budget_spends_it_and_the_worker_plays_dead(spool, node):
    """J9: the queue moves a message past its own maxRetries with no spoolctl_result,
    so a job submitted with a larger --max-retries gets the queue's: the submit
    says so on stderr, and the worker sends the job to the failure queue with its
    result on the queue's last retry, and records it dead (not queued for good)."""
    c = HttpClient(node.http_url, node.admin_key)
    c.put_queue("q7", maxRetries=1)
    r = spool.run("submit", "--queue", "q7", "--max-retries", "3", "--", "sh", "-c", "exit 5", global_args=g(node))
    msg_id = r.stdout.decode().strip()
    assert msg_id and len(r.stdout.split()) == 1, r.stdout
    assert b"maxRetries 1" in r.stderr and b"at most 1 times, not 3" in r.stderr, r.stderr
    summary = spool.json("worker", "--queue", "q7", "--drain", global_args=g(node), timeout_s=60)
    assert (summary["failed"], summary["dead"]) == (2, 1), summary
    job = spool.job(msg_id)
    assert job["state"] == "dead" and [a["exit_code"] for a in job["attempts"]] == [5, 5], job
    d = c.receive("q7.failed")
    assert d is not None
    res = json.loads(d.body)["spoolctl_result"]
    assert res["exit_code"] == 5 and res["retry_count"] == 1 and "maxRetries (1)" in res["detail"], res
    q7 = c.get_queue("q7")["stats"]
    assert q7["ackedTotal"] == 1 and q7["failedTotal"] == 0, q7


@pytest.mark.parametrize("max_retries", [0, 3])
def test_a_stopped_worker_gives_its_job_back_with_a_nack_that_counts(spool, node, tmp_path, max_retries):
    """J9: SIGTERM stops the running command and nacks its message, a retry spent
    (docs/jobs.md). On the queue's last retry the queue moves the message to its
    failure queue itself, and the worker's record says dead, not queued."""
    c = HttpClient(node.http_url, node.admin_key)
    q = f"q8-{max_retries}"
    c.put_queue(q, maxRetries=max_retries)
    started = tmp_path / "started"
    msg_id = spool.run("submit", "--queue", q, "--max-retries", str(max_retries), "--", "sh", "-c",
                       f"touch {started}; sleep 300", global_args=g(node)).stdout.decode().strip()
    w = spool.start_worker("--queue", q, global_args=g(node))
    try:
        wait_until(started.exists, 20, what="the attempt running")
        w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=30) == 0
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    [a] = spool.job(msg_id)["attempts"]
    assert a["failure_reason"] == "worker_stopped", a
    stats = c.get_queue(q)["stats"]
    if max_retries == 0:
        assert spool.job(msg_id)["state"] == "dead"
        assert stats["failedTotal"] == 1 and stats["visible"] == 0, stats
        assert c.get_queue(f"{q}.failed")["stats"]["visible"] == 1
    else:
        assert spool.job(msg_id)["state"] == "queued"
        d = c.receive(q)
        assert d is not None and d.retry_count == 1 and d.id == msg_id


def test_a_queue_deleted_while_its_job_runs_stops_the_command_and_the_record_says_so(spool, node, tmp_path):
    """J9: deleting the queue deletes the message and its lease: the worker's next
    renewal is refused (queue_not_found), it kills the command as for a lost
    lease, and the job's record ends dead (nothing will deliver it again), not
    running or queued for good."""
    c = HttpClient(node.http_url, node.admin_key)
    c.put_queue("q9", leaseTimeoutSeconds=30)
    started = tmp_path / "started"
    msg_id = spool.run("submit", "--queue", "q9", "--", "sh", "-c", f"touch {started}; sleep 300; echo done",
                       global_args=g(node)).stdout.decode().strip()
    w = spool.start_worker("--queue", "q9", "--json", global_args=g(node), stdout=subprocess.PIPE)
    try:
        wait_until(started.exists, 20, what="the attempt running")
        c.delete_queue("q9")
        wait_until(lambda: spool.job(msg_id)["state"] != "running", 20, what="the attempt ended")
        # its next receive meets the deleted queue: the worker stops on its own, saying why
        _, err = w.communicate(timeout=30)
        assert w.returncode == 1 and b"queue q9 does not exist (any more); stopping" in err, err
        assert b"Traceback" not in err and b"slot failed" not in err, err
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    job = spool.job(msg_id)
    [a] = job["attempts"]
    assert job["state"] == "dead" and a["failure_reason"] == "lease_lost" and "deleted" in a["detail"], job
    assert spool.run("output", msg_id).stdout == b"", "the command was stopped, not run to its end"


def test_a_queue_deleted_and_made_again_while_its_job_runs_ends_the_record(spool, node, tmp_path):
    """J9: a queue deleted and made again between two renewals answers the next one
    stale_lease/settled (the lease's message went with the old queue), not
    queue_not_found. The job is stopped as for a lost lease, and its record ends
    dead: the new queue will never deliver it, so "queued" would be false."""
    started = tmp_path / "started"
    c, msg_id = queue_job(spool, node, "q10", f"touch {started}; sleep 300; echo done", leaseTimeoutSeconds=30)
    w = spool.start_worker("--queue", "q10", global_args=g(node))
    try:
        wait_until(started.exists, 20, what="the attempt running")
        c.delete_queue("q10")   # both inside one renewal interval (5 s by default)
        c.put_queue("q10", leaseTimeoutSeconds=30)
        wait_until(lambda: spool.job(msg_id)["state"] != "running", 30, what="the attempt ended")
    finally:
        stop(w)
    job = spool.job(msg_id)
    [a] = job["attempts"]
    assert job["state"] == "dead" and a["failure_reason"] == "lease_lost" and "deleted" in a["detail"], job
    assert spool.run("output", msg_id).stdout == b"", "the command was stopped, not run to its end"
    assert c.get_queue("q10")["stats"]["visible"] == 0


def test_a_change_of_the_queues_max_retries_holds_for_a_worker_already_running(spool, node, tmp_path):
    """J9: the worker reads the queue's maxRetries again before it settles a failure.
    Lowered to 0 while the job runs, the first failure is the last: the worker moves
    the job to the failure queue with its result and records it dead. With the
    figure read only at the start it would nack, and the queue would move the message
    itself, with no result, leaving the record queued."""
    c = HttpClient(node.http_url, node.admin_key)
    c.put_queue("q11", maxRetries=5)
    started, go = tmp_path / "started", tmp_path / "go"
    msg_id = spool.run("submit", "--queue", "q11", "--max-retries", "5", "--", "sh", "-c",
                       f"touch {started}; while [ ! -e {go} ]; do sleep 0.05; done; exit 4",
                       global_args=g(node)).stdout.decode().strip()
    w = spool.start_worker("--queue", "q11", global_args=g(node))
    try:
        wait_until(started.exists, 20, what="the attempt running")
        c.put_queue("q11", maxRetries=0)
        go.touch()
        wait_until(lambda: spool.job(msg_id)["state"] != "running", 30, what="the attempt ended")
    finally:
        stop(w)
    job = spool.job(msg_id)
    assert job["state"] == "dead" and [a["exit_code"] for a in job["attempts"]] == [4], job
    d = c.receive("q11.failed")
    assert d is not None and json.loads(d.body)["spoolctl_result"]["exit_code"] == 4, d
    assert "maxRetries (0)" in json.loads(d.body)["spoolctl_result"]["detail"]


def test_worker_crash_is_a_lease_expiry_that_counts_as_a_retry(spool, node, tmp_path):
    c = HttpClient(node.http_url, node.admin_key)
    c.put_queue("q3", leaseTimeoutSeconds=1.0, maxRetries=3)
    first = tmp_path / "first.pid"
    script = (f'if [ "$SPOOLCTL_RETRY_COUNT" = 0 ]; then echo $$ > {first}; sleep 300; fi;'
              f' echo retry $SPOOLCTL_RETRY_COUNT')
    msg_id = spool.run("submit", "--queue", "q3", "--", "sh", "-c", script, global_args=g(node)).stdout.decode().strip()
    w1 = spool.start_worker("--queue", "q3", global_args=g(node))
    wait_until(lambda: first.exists() and first.read_text().strip(), 20, what="first attempt running")
    orphan = int(first.read_text())
    wait_until(lambda: spool.job(msg_id)["attempts"][0]["pid"], 10, what="attempt pid recorded")
    w1.send_signal(signal.SIGKILL)
    w1.wait(timeout=10)
    summary = spool.json("worker", "--queue", "q3", "--drain", global_args=g(node), timeout_s=60)
    assert summary["succeeded"] == 1
    job = spool.job(msg_id)
    assert job["state"] == "succeeded"
    assert job["attempts"][0]["failure_reason"] == "worker_crashed"
    assert spool.run("output", msg_id).stdout == b"retry 1\n", "the expiry raised the retry count"
    wait_until(lambda: pid_gone(orphan), 5, what="orphaned first attempt killed")


def test_a_crashed_workers_command_is_killed_by_the_next_worker_on_its_spool(spool, node, tmp_path):
    """J2 with --queue: a worker SIGKILLed mid-job leaves its command running. The
    next worker on the same spool reaps it as a local worker would (a stale
    heartbeat, a dead PID): the command is killed before that worker takes any
    job, and the row is closed (queued: the queue delivers the job again once its
    lease expires), not left running for good. The lease here outlasts the test,
    so the message never comes back to kill it another way."""
    first = tmp_path / "first.pid"
    c, msg_id = queue_job(spool, node, "q12", f"echo $$ > {first}; sleep 300", leaseTimeoutSeconds=600)
    w1 = spool.start_worker("--queue", "q12", global_args=g(node))
    try:
        wait_until(lambda: first.exists() and first.read_text().strip(), 20, what="the attempt running")
        orphan = int(first.read_text())
        wait_until(lambda: spool.job(msg_id)["attempts"][0]["pid"], 10, what="the attempt's pid recorded")
    finally:
        w1.kill()
        w1.wait(timeout=10)
    assert not pid_gone(orphan), "the command outlives its worker's SIGKILL (its own session)"
    # stale past the next worker's threshold before it starts, and a second job
    # waiting, which tells whether the first one's command was still there when it ran
    stale = lambda: time.time() - (spool.job(msg_id)["worker"] or {}).get("heartbeat_at", 0) > 1.0  # noqa: E731
    wait_until(stale, 10, what="the dead worker's row stale")
    second = spool.run("submit", "--queue", "q12", "--", "sh", "-c",
                       # (a killed process not yet reaped by its new parent is a zombie: gone)
                       f"s=$(cut -d' ' -f3 /proc/{orphan}/stat 2>/dev/null); "
                       f"if [ -n \"$s\" ] && [ \"$s\" != Z ]; then echo alive; else echo gone; fi",
                       global_args=g(node)).stdout.decode().strip()
    w2 = spool.start_worker("--queue", "q12", "--json", global_args=g(node), stdout=subprocess.PIPE,
                            env={"SPOOLCTL_TEST_REAP_THRESHOLD": "0.5"})
    try:
        wait_until(lambda: pid_gone(orphan), 20, what="the dead worker's command killed by the reaper")
        wait_until(lambda: spool.job(msg_id)["state"] == "queued", 10, what="the row closed")
        wait_until(lambda: spool.job(second)["state"] == "succeeded", 20, what="the second job run")
    finally:
        out = stop(w2)
    assert spool.run("output", second).stdout == b"gone\n", "the orphan was killed before the next job ran"
    job = spool.job(msg_id)
    [a] = job["attempts"]
    assert a["failure_reason"] == "worker_crashed" and "lease expires" in a["detail"], a
    assert job["crash_count"] == 1, job
    assert json.loads(out)["reaped"] == 1
    assert c.get_queue("q12")["stats"]["leased"] == 1, "the queue still holds the dead worker's lease"


def test_a_hung_cluster_worker_is_reaped_and_on_waking_gives_its_lease_back_counting_nothing(spool, node, tmp_path):
    """J2 with --queue, a worker alive but hung (SIGSTOPped): another worker on the
    spool watches its rows' heartbeat stand still for ten reap thresholds (0.3 s
    here) and reaps it as hung, killing its command. Woken, the hung worker finds
    the row no longer its own: it leaves the reaper's record as it is (not the job's
    failure), gives its lease, which still had minutes to run, back with a nack (the
    job runs again now, not when the lease expires), and counts the attempt nowhere."""
    first = tmp_path / "first.pid"
    c, msg_id = queue_job(spool, node, "q14", f"echo $$ > {first}; sleep 300", leaseTimeoutSeconds=600)
    w1 = spool.start_worker("--queue", "q14", "--json", global_args=g(node), stdout=subprocess.PIPE)
    w2 = None
    try:
        wait_until(lambda: first.exists() and first.read_text().strip(), 20, what="the attempt running")
        orphan = int(first.read_text())
        wait_until(lambda: spool.job(msg_id)["attempts"][0]["pid"], 10, what="the attempt's pid recorded")
        spool.freeze_outside_write_lock(w1)  # (frozen inside a transaction, nobody could reap it)
        w2 = spool.start_worker("--queue", "q14-other", global_args=g(node),
                                env={"SPOOLCTL_TEST_REAP_THRESHOLD": "0.3"})
        wait_until(lambda: pid_gone(orphan), 30, what="the hung worker's command killed by the reaper")
        wait_until(lambda: spool.job(msg_id)["state"] == "queued", 10, what="the row closed")
        stop(w2)
        w1.send_signal(signal.SIGCONT)
        # given back at once (not after the lease's ten minutes): w1 takes it again
        wait_until(lambda: len(spool.job(msg_id)["attempts"]) == 2, 20, what="the job running again")
    finally:
        if w2 is not None and w2.poll() is None:
            stop(w2)
        w1.send_signal(signal.SIGCONT)
        out = stop(w1)
    summary = json.loads(out)
    assert (summary["claimed"], summary["failed"], summary["succeeded"], summary["lease_lost"],
            summary["stopped"]) == (2, 0, 0, 0, 1), summary  # (the second attempt: stopped by the test)
    a1, a2 = spool.job(msg_id)["attempts"]
    assert a1["failure_reason"] == "worker_crashed" and "hung" in a1["detail"], a1
    assert a2["failure_reason"] == "worker_stopped", a2
    d = c.receive("q14")
    assert d is not None and d.id == msg_id and d.retry_count == 2, d  # the give-back's nack, the stop's


def test_a_live_cluster_worker_keeps_its_rows_fresh_and_is_never_reaped(spool, node, tmp_path):
    """The other side of the above: a --queue worker touches its running rows every
    renewal. A reaper finds a live worker's PID alive, but it also reaps a worker
    whose heartbeat stands still for ten thresholds as hung: without the touches,
    every long cluster job would be killed that way. Here a reaper whose hung
    watch is one second long passes over the running job twice, more than that
    apart, and leaves it alone; the job finishes under its worker."""
    from spooler.jobs import reaper
    from spooler.jobs.store import Store
    started, go = tmp_path / "started", tmp_path / "go"
    c, msg_id = queue_job(spool, node, "q13", f"touch {started}; while [ ! -e {go} ]; do sleep 0.05; done; echo ok",
                          leaseTimeoutSeconds=30)
    w1 = spool.start_worker("--queue", "q13", global_args=g(node))
    try:
        wait_until(started.exists, 20, what="the attempt running")
        store = Store(spool.path)
        try:
            first = store.get(msg_id)["worker"]["heartbeat_at"]
            wait_until(lambda: store.get(msg_id)["worker"]["heartbeat_at"] > first, 10, what="the row's heartbeat touched")
            watch = reaper.HungWatch(1.0)
            t0 = time.monotonic()
            passes = [reaper.reap_pass(store, 0.3, watch=watch)]
            wait_until(lambda: time.monotonic() - t0 > 1.5, 5, what="the hung watch's length gone by")
            passes.append(reaper.reap_pass(store, 0.3, watch=watch))
        finally:
            store.close()
        assert all(r.new_state is None for p in passes for r in p), passes
        assert spool.job(msg_id)["state"] == "running"
        go.touch()
        wait_until(lambda: spool.job(msg_id)["state"] == "succeeded", 20, what="the job finished")
    finally:
        stop(w1)
    assert spool.run("output", msg_id).stdout == b"ok\n"


def test_invalid_message_is_moved_to_the_failure_queue(spool, node):
    c = HttpClient(node.http_url, node.admin_key)
    remote.ensure_queue(c, "q4")
    c.send("q4", b"not a job")
    summary = spool.json("worker", "--queue", "q4", "--drain", global_args=g(node))
    assert summary["dead"] == 1
    body = json.loads(c.receive("q4.failed").body)
    assert body["spoolctl_result"]["failure_reason"] == "invalid_job" and body["raw"] == "not a job"


@pytest.mark.parametrize("job", [
    {"spoolctl_job": 1, "command": ["true"], "timeout_s": "5"},
    {"spoolctl_job": 1, "command": "true"},
    {"spoolctl_job": 1, "command": [["true"]]},
    {"spoolctl_job": 1, "command": ["true"], "max_retries": "x"},
    {"spoolctl_job": 1, "command": ["true"], "cwd": 7},
], ids=["timeout-string", "command-string", "command-nested", "retries-word", "cwd-number"])
def test_a_job_with_fields_of_the_wrong_type_goes_to_the_failure_queue(spool, node, job):
    """A message from a sender that is not spoolctl, with a field of the wrong
    type, is an invalid job (buried), not an exception that stops the worker."""
    c = HttpClient(node.http_url, node.admin_key)
    remote.ensure_queue(c, "q4t")
    c.send("q4t", json.dumps(job).encode())
    summary = spool.json("worker", "--queue", "q4t", "--drain", global_args=g(node))
    assert summary["dead"] == 1 and not summary.get("errors"), summary
    body = json.loads(c.receive("q4t.failed").body)
    assert body["spoolctl_result"]["failure_reason"] == "invalid_job"


@pytest.mark.parametrize("heartbeat_s", ["0.1", "5"])
def test_a_job_longer_than_its_lease_succeeds_by_renewal(spool, node, heartbeat_s):
    """J9: the worker renews the lease while the command runs, so a job three times
    longer than the queue's 1 s lease runs once: one delivery, retry count 0, no
    lease expiry. (A redelivery would run at once, so a missing renewal shows up
    as a second attempt with retry count 1 in about 3 s, not as a slow test.)
    With the default 5 s heartbeat, longer than the lease, the renewals come at a
    third of the lease timeout instead."""
    c = HttpClient(node.http_url, node.admin_key)
    q = f"q5-{heartbeat_s.replace('.', '')}"
    c.put_queue(q, leaseTimeoutSeconds=1.0, maxRetries=3)
    script = 'if [ "$SPOOLCTL_RETRY_COUNT" = 0 ]; then sleep 3; fi; echo retry $SPOOLCTL_RETRY_COUNT'
    msg_id = spool.run("submit", "--queue", q, "--", "sh", "-c", script, global_args=g(node)).stdout.decode().strip()
    summary = spool.json("worker", "--queue", q, "--drain", global_args=g(node), timeout_s=30,
                         env={"SPOOLCTL_TEST_HEARTBEAT_INTERVAL": heartbeat_s})
    assert (summary["claimed"], summary["succeeded"], summary["lease_lost"]) == (1, 1, 0), summary
    job = spool.job(msg_id)
    assert job["state"] == "succeeded" and len(job["attempts"]) == 1
    [a] = job["attempts"]
    assert a["failure_reason"] is None and a["exit_code"] == 0
    assert a["finished_at"] - a["started_at"] >= 3.0 - 0.1, "the command outlived the lease timeout"
    assert spool.run("output", msg_id).stdout == b"retry 0\n"
    stats = c.get_queue(q)["stats"]
    assert stats["leaseExpiredTotal"] == 0 and stats["ackedTotal"] == 1, stats
    assert stats["visible"] == stats["leased"] == stats["delayed"] == 0


def test_a_renewal_refused_as_stale_kills_the_command(spool, node, tmp_path):
    """J9: a node restart is a primary change, after which every older lease
    answers stale_lease. The worker's next renewal is refused, and it kills the
    command at once (the queue's 30 s lease has not run out, so nothing else
    would stop it), records the attempt as lease_lost without settling it, and
    runs the job again when the queue redelivers it."""
    c = HttpClient(node.http_url, node.admin_key)
    c.put_queue("q6", maxRetries=3)    # default 30 s lease: only the refused renewal can stop the command
    first = tmp_path / "first.pid"
    script = f'if [ ! -e {first} ]; then echo $$ > {first}; sleep 300; fi; echo again'
    msg_id = spool.run("submit", "--queue", "q6", "--", "sh", "-c", script, global_args=g(node)).stdout.decode().strip()
    w = spool.start_worker("--queue", "q6", "--drain", "--json", global_args=g(node))
    wait_until(lambda: first.exists() and first.read_text().strip(), 20, what="first attempt running")
    command = int(first.read_text())
    wait_until(lambda: spool.job(msg_id)["attempts"][0]["pid"], 10, what="attempt pid recorded")
    epoch = node.epoch
    node.restart()
    assert node.epoch > epoch, "the restart began a new epoch"
    wait_until(lambda: pid_gone(command), 10, what="the command killed after its renewal was refused as stale")
    out, err = w.communicate(timeout=30)      # --drain: it runs the redelivered job, then exits
    assert w.returncode == 0, err
    summary = json.loads(out)
    assert (summary["lease_lost"], summary["succeeded"], summary["claimed"]) == (1, 1, 2), summary
    job = spool.job(msg_id)
    assert job["state"] == "succeeded"
    a1, a2 = job["attempts"]
    assert a1["failure_reason"] == "lease_lost" and a1["exit_code"] is not None and a1["exit_code"] < 0, a1
    assert a2["failure_reason"] is None and a2["exit_code"] == 0
    assert spool.run("output", msg_id, "--attempt", "2").stdout == b"again\n"


@pytest.mark.parametrize("script, state, reason", [("exit 0", "succeeded", None), ("exit 3", "dead", "nonzero_exit")])
def test_a_queue_deleted_just_as_its_job_is_settled_ends_the_record_by_the_commands_outcome(tmp_path, script,
                                                                                            state, reason):
    """J9: the ack (or nack) meets queue_not_found: the message is gone with its
    queue, so nothing will run the job again. Its record ends by what the command
    did (succeeded, or dead with the command's own reason), never running,
    queued, or succeeded with a failure reason."""
    from spooler import errors
    from spooler.http import Delivery
    from spooler.jobs import knobs
    from spooler.jobs.store import Store

    body = json.dumps(remote.job_body(["sh", "-c", script], 0, 3, None, None, None, str(tmp_path), 0.0)).encode()

    class Gone:
        given = False

        def get_queue(self, q):
            return {"name": q, "settings": {"leaseTimeoutSeconds": 30, "maxRetries": 3, "failureQueue": q + ".failed"},
                    "stats": {"visible": 0, "delayed": 0, "leased": 0}}

        def receive(self, q, wait_s):
            if Gone.given:
                return None
            Gone.given = True
            return Delivery(id="m1", body=body, token="t1", retry_count=0, expires_at="2026-12-03T00:00:30Z")

        def renew(self, token):
            return "2026-12-03T00:00:30Z"

        def ack(self, token):
            raise errors.QueueNotFound("queue jq does not exist")

        def nack(self, token, delay_s=0.0):
            raise errors.QueueNotFound("queue jq does not exist")

    spool_dir = str(tmp_path / "spool")
    w = remote.RemoteWorker(Gone, "jq", spool_dir, knobs.load(env={}), drain=True)
    summary = w.run()
    st = Store(spool_dir, 5.0)
    try:
        job = st.get("m1")
    finally:
        st.close()
    [a] = job["attempts"]
    assert (job["state"], a["failure_reason"]) == (state, reason), job
    assert "was deleted" in a["detail"] and not a["detail"].startswith(";"), a
    assert summary["succeeded" if state == "succeeded" else "lease_lost"] == 1, summary
    assert not w._lost, w._lost


class _FakeQueueClient:
    """A stand-in for HttpClient: one job message, a renew that fails as an answer
    that cannot be read would (a proxy's page for a 200), acks and nacks counted."""

    def __init__(self, script: str):
        self.job = json.dumps(remote.job_body(["sh", "-c", script], 0, 3, None, None, None, None, 0.0)).encode()
        self.renews, self.settled, self.given = 0, [], False

    def get_queue(self, name):
        return {"settings": {"leaseTimeoutSeconds": 0.3, "maxRetries": 3}, "stats": {}}

    def receive(self, queue, wait_s=0.0):
        if self.given:
            time.sleep(min(wait_s, 0.05))
            return None
        self.given = True
        from spooler.http import Delivery
        return Delivery("m1", self.job, "tok", 0, "2099-01-01T00:00:00Z", queue)

    def renew(self, token):
        self.renews += 1
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    def ack(self, token):
        self.settled.append("ack")

    def nack(self, token, delay_s=0.0):
        self.settled.append("nack")


def test_a_renewal_that_fails_oddly_stops_the_worker_instead_of_leaving_its_leases_to_expire(tmp_path):
    """A renewal that raises anything but a contract error (an answer that cannot be
    read) ended the renewal thread silently: the worker ran on, its leases expiring
    under its jobs. Now it stops, saying why, and gives its running job back."""
    from spooler.jobs import knobs
    fake = _FakeQueueClient("sleep 30")
    w = remote.RemoteWorker(lambda: fake, "q", str(tmp_path / "spool"),
                            knobs.Settings(heartbeat_interval_s=0.1))
    done = []
    t = threading.Thread(target=lambda: done.append(w.run()), daemon=True)
    t.start()
    t.join(timeout=60)
    assert done, "the worker did not stop"
    summary = done[0]
    assert fake.renews >= 1 and any("renewing leases" in e and "ValueError" in e for e in summary["errors"]), summary
    assert summary["stopped"] == 1 and fake.settled == ["nack"], (summary, fake.settled)


def test_a_job_moved_to_the_failure_queue_is_acked_only_once_it_is_there(tmp_path):
    """J9, "send there, then ack": a send to the failure queue that fails leaves
    the job's own message unacked (its lease expires and the queue delivers it
    again), never acked with no copy in the failure queue; a send that succeeds
    is followed by the ack. (The end-to-end tests see the same end state in
    either order.)"""
    from spooler import errors
    from spooler.http import Delivery
    from spooler.jobs import knobs

    class Client:
        def __init__(self, send_fails: bool):
            self.calls, self.send_fails = [], send_fails

        def send(self, queue, data, dedup_key=None):
            self.calls.append(("send", queue))
            if self.send_fails:
                raise errors.Unavailable("the server went away")

        def ack(self, token):
            self.calls.append(("ack", token))

    w = remote.RemoteWorker(lambda: None, "q", str(tmp_path / "spool"), knobs.Settings())
    d = Delivery("m1", b"{}", "tok", 2, "2099-01-01T00:00:00Z", "q")
    ok = Client(send_fails=False)
    w._bury(ok, d, {"command": ["false"]})
    assert ok.calls == [("send", "q.failed"), ("ack", "tok")]
    failing = Client(send_fails=True)
    with pytest.raises(errors.Unavailable):
        w._bury(failing, d, {"command": ["false"]})
    assert failing.calls == [("send", "q.failed")], "acked although the job never reached the failure queue"
