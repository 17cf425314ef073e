"""The CLI contract (API.md section 4): submit output, JSON schema, output,
priority, idempotency keys, list/status, capabilities and the test knobs,
the drain progress line."""
from __future__ import annotations

import json
import os
import pty
import shlex
import subprocess

import pytest

from jobs_helpers import cli_inprocess, spool, spoolctl_argv  # noqa: F401
from nodeproc import sh_then
from spooler.jobs import knobs

JOB_KEYS = {"id", "state", "priority", "attempts", "crash_count", "failure_reason"}
ATTEMPT_KEYS = {"exit_code", "stdout", "stderr", "failure_reason"}


def test_plain_submit_prints_only_the_job_id(spool):
    r = spool.run("submit", "--", "echo", "hi")
    out = r.stdout.decode()
    assert out.endswith("\n") and len(out.split()) == 1
    assert spool.job(out.strip())["state"] == "queued"


def test_job_json_has_the_contract_fields(spool):
    job = spool.json("submit", "--priority", "3", "--max-retries", "1", "--",
                     "sh", "-c", "echo o; echo e >&2; exit 2")
    assert JOB_KEYS <= set(job) and job["state"] == "queued" and job["priority"] == 3
    assert job["attempts"] == [] and job["crash_count"] == 0 and job["failure_reason"] is None
    spool.run("submit", "--max-retries", "1", "--", "true")
    r = spool.run("retry", job["id"], "--json")   # queued: retry just clears backoff
    assert json.loads(r.stdout)["state"] == "queued"
    spool.run("worker", "--drain", timeout_s=60)
    [done] = [j for j in spool.json("list")["jobs"] if j["id"] == job["id"]]
    assert done["state"] == "dead" and done["failure_reason"] == "nonzero_exit"
    assert len(done["attempts"]) == 2
    for a in done["attempts"]:
        assert ATTEMPT_KEYS <= set(a)
        assert a["exit_code"] == 2 and a["failure_reason"] == "nonzero_exit"
        assert os.path.isabs(a["stdout"]) and os.path.isabs(a["stderr"])
    assert [a["n"] for a in done["attempts"]] == [1, 2], "attempts oldest first"
    assert done["attempts"][0]["finished_at"] <= done["attempts"][1]["started_at"]


def test_submit_options_after_double_dash_belong_to_the_command(spool):
    job = spool.json("submit", "--", "echo", "--json", "--priority", "9")
    assert job["command"] == ["echo", "--json", "--priority", "9"] and job["priority"] == 0


def test_output_latest_given_attempt_and_stderr(spool, tmp_path):
    marker = tmp_path / "m"
    job_id = spool.submit("sh", "-c", f'echo "out $SPOOLCTL_ATTEMPT"; echo "err $SPOOLCTL_ATTEMPT" >&2;'
                                      f' [ -e {marker} ] || {{ touch {marker}; exit 1; }}')
    spool.run("worker", "--drain", timeout_s=60)
    assert spool.run("output", job_id).stdout == b"out 2\n"
    assert spool.run("output", job_id, "--attempt", "1").stdout == b"out 1\n"
    assert spool.run("output", job_id, "--stderr").stdout == b"err 2\n"
    assert spool.run("output", job_id, "--attempt", "1", "--stderr").stdout == b"err 1\n"
    j = spool.json("output", job_id, "--attempt", "1")
    assert j["content"] == "out 1\n" and j["attempt"] == 1 and j["stream"] == "stdout"
    assert spool.run("output", job_id, "--attempt", "7", check=False).returncode != 0
    for bad in ("0", "-1"):  # out of range (invalid_argument), not "no such attempt" (not_found)
        r = spool.run("output", job_id, "--attempt", bad, "--json", check=False)
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "invalid_argument", r
        assert b"numbered from 1" in r.stderr, r
    r = spool.run("output", job_id, "--attempt", "x", check=False)  # does not parse: a usage error
    assert r.returncode == 2, r


def test_priority_orders_claims(spool, tmp_path):
    log = tmp_path / "order"
    ids = {}
    for name, prio in [("low", -5), ("first-default", 0), ("high", 10), ("second-default", 0), ("mid", 5)]:
        ids[name] = spool.submit_direct("sh", "-c", f"echo {name} >> {log}", priority=prio)
    spool.submit("sh", "-c", f"echo cli-high >> {log}", opts=("--priority", "11"))
    spool.run("worker", "--drain", timeout_s=60)
    assert log.read_text().split() == ["cli-high", "high", "mid", "first-default", "second-default", "low"]


def test_idempotency_key_returns_the_first_id(spool, tmp_path):
    first = spool.submit("echo", "one", opts=("--key", "nightly-2026-11-30"))
    again = spool.json("submit", "--key", "nightly-2026-11-30", "--", "echo", "two")
    assert again["id"] == first and again["duplicate"] is True
    other = spool.submit("echo", "one", opts=("--key", "other"))
    assert other != first
    assert len(spool.json("list")["jobs"]) == 2
    spool.run("worker", "--drain", timeout_s=60)
    # still deduplicated after the first one ran: the key is about submission
    assert spool.submit("echo", "three", opts=("--key", "nightly-2026-11-30")) == first
    assert spool.run("output", first).stdout == b"one\n"


def test_list_filters_by_state_and_status_counts(spool):
    a = spool.submit("true")
    b = spool.submit("true")
    spool.run("cancel", b)
    assert [j["id"] for j in spool.json("list", "--state", "canceled")["jobs"]] == [b]
    assert [j["id"] for j in spool.json("list", "--state", "queued")["jobs"]] == [a]
    st = spool.json("status")
    assert st["counts"]["queued"] == 1 and st["counts"]["canceled"] == 1 and st["total"] == 2


def test_a_list_cut_short_by_its_limit_says_so(spool):
    """limits.md: `list` shows at most --limit jobs (10,000 by default), oldest
    first; when the limit leaves jobs out, the JSON says so and stderr tells
    the reader (plain output stays one job per line)."""
    ids = [spool.submit_direct("true") for _ in range(3)]
    cut = spool.run("list", "--json", "--limit", "2")
    got = json.loads(cut.stdout)
    assert [j["id"] for j in got["jobs"]] == ids[:2] and got["truncated"] is True
    assert b"--limit" in cut.stderr
    plain = spool.run("list", "--limit", "2")
    assert len(plain.stdout.decode().splitlines()) == 2 and b"left out" in plain.stderr
    whole = spool.run("list", "--json", "--limit", "3")      # the control: nothing left out
    assert json.loads(whole.stdout)["truncated"] is False and whole.stderr == b""
    assert len(json.loads(whole.stdout)["jobs"]) == 3


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("as_json", [False, True])
def test_a_submit_whose_output_cannot_be_written_says_so_and_its_job_stands(spool, as_json):
    """jobs.md: when stdout cannot be written, the error is output_failed, on
    stderr only (no JSON written back to the stdout that failed, no traceback),
    and what the command did stands: the submit's job is queued, so the message
    must not call the spool unusable (a script would submit it again)."""
    spool.submit_direct("true")  # the spool exists (the control below reads it)
    with open("/dev/full", "wb") as full:
        cmd = [*spoolctl_argv(), "--spool", spool.path, "submit", *(["--json"] if as_json else []), "--", "true"]
        r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, cwd=spool.cwd, env=spool.env, timeout=60)
    assert r.returncode == 1, r.stderr
    assert b"output_failed" in r.stderr and b"spool_unusable" not in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr, r.stderr
    assert spool.json("status")["counts"]["queued"] == 2  # its job was queued all the same
    ok = spool.run("list", "--json")  # the control: the same spool, a stdout that works
    assert len(json.loads(ok.stdout)["jobs"]) == 2 and ok.stderr == b""


@pytest.mark.parametrize("as_json", [False, True])
def test_a_spoolctl_started_with_its_stdout_closed_still_says_what_happened(spool, as_json):
    """The same with no stdout at all (started with descriptor 1 closed): an
    error is still told on stderr, with no traceback, and a submit's job stands
    (output_failed)."""
    spool.submit_direct("true")
    j = ["--json"] if as_json else []

    def closed(*args):
        return subprocess.run(sh_then("exec 1>&-", [*spoolctl_argv(), "--spool", spool.path, *args]),
                              stderr=subprocess.PIPE, cwd=spool.cwd, env=spool.env, timeout=60)
    r = closed("status", *j, "nosuch")
    assert r.returncode == 1 and b"not_found" in r.stderr and b"Traceback" not in r.stderr, r.stderr
    r = closed("submit", *j, "--", "true")
    assert r.returncode == 1 and b"output_failed" in r.stderr and b"Traceback" not in r.stderr, r.stderr
    assert spool.json("status")["counts"]["queued"] == 2
    r = closed("status", *j, "--bogus")  # a usage error: exit 2, said on stderr
    assert r.returncode == 2 and b"--bogus" in r.stderr and b"Traceback" not in r.stderr, r.stderr
    if not as_json:  # a command that writes nothing to stdout has nothing to fail on
        r = closed("worker", "--drain")
        assert r.returncode == 0 and r.stderr == b"", r.stderr
        assert spool.json("status")["counts"]["succeeded"] == 2


@pytest.mark.parametrize("named", [True, False])
def test_a_submit_from_a_removed_directory_is_invalid_argument_not_a_broken_spool(spool, tmp_path, named):
    """jobs.md: a job runs in the directory it is submitted from; when that
    directory was removed, the submit is invalid_argument naming it, not
    spool_unusable, and nothing is queued: with --spool named, and with the
    default spool (./.spoolctl, found through that same directory)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    where = ["--spool", spool.path] if named else []
    p = subprocess.run(sh_then(f"rmdir -- {shlex.quote(str(gone))}",
                               [*spoolctl_argv(), *where, "submit", "--json", "--", "true"]),
                       cwd=gone, env=spool.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    out, err = p.stdout, p.stderr
    assert p.returncode == 1, err
    e = json.loads(out)["error"]
    assert e["kind"] == "invalid_argument" and "working directory" in e["message"], e
    assert not os.path.exists(os.path.join(spool.path, "spool.db"))  # nothing made, nothing queued


def test_an_empty_command_or_job_id_is_refused_not_queued_or_counted(spool):
    """jobs.md: a submit whose program name is empty is a usage error (exit 2),
    never queued to fail every attempt; an empty job id is not_found, not the
    spool's counts (a script's `status "$JOB"` with JOB unset)."""
    spool.submit_direct("true")  # the spool exists
    r = spool.run("submit", "--json", "--", "", "x", check=False)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["kind"] == "invalid_argument", r
    assert spool.json("status")["counts"]["queued"] == 1
    for command in ("status", "cancel", "output", "retry"):
        e = spool.run(command, "--json", "", check=False)
        assert e.returncode == 1 and json.loads(e.stdout)["error"]["kind"] == "not_found", (command, e)
    spool.submit("true", "")  # the control: an empty argument after the program is the command's own
    assert spool.json("status")["counts"]["queued"] == 2


def test_plain_list_shows_attempts_crash_count_and_failure_reason(spool):
    """API.md: status and list show the state, attempts, crash count and failure_reason."""
    ok = spool.submit("true")
    bad = spool.submit("false", opts=("--max-retries", "0"))
    spool.run("worker", "--drain")
    lines = {ln.split()[0]: ln for ln in spool.run("list").stdout.decode().splitlines()}
    assert "attempts=1 crashes=0" in lines[ok] and "failure=" not in lines[ok], lines[ok]
    assert "dead" in lines[bad] and "crashes=0" in lines[bad], lines[bad]
    assert f"failure={spool.json('status', bad)['failure_reason']}" in lines[bad], lines[bad]


def test_the_global_key_before_submit_is_the_api_key_and_only_warned_about(spool):
    """API.md: global options (``--spool``, ``--server``, ``--key``) come before the
    command, so ``spoolctl --key K submit`` is well formed: the job is queued (the
    plain output is its id alone) and stderr says that this --key is the server's
    API key, not an idempotency key (which goes after the command)."""
    a = spool.submit("true", opts=("--key", "k1"))
    r = spool.run("submit", "--", "true", global_args=("--server", "http://127.0.0.1:9", "--key", "k1"))
    b = r.stdout.decode().strip()
    assert r.returncode == 0 and b and b != a and len(r.stdout.split()) == 1, r
    assert b"idempotency key goes after it" in r.stderr, r
    assert spool.json("status")["total"] == 2
    assert spool.submit("true", opts=("--key", "k1")) == a


@pytest.mark.parametrize("argv", [["submit"], ["submit", "--"], ["submit", "--json", "--"]])
def test_submit_without_a_command_is_a_usage_error(spool, argv):
    """README: usage errors exit 2; under --json the error is one JSON line on
    stdout. A submit that names no command is one, and queues nothing."""
    spool.submit("true")
    r = spool.run(*argv, check=False)
    assert r.returncode == 2, r
    if "--json" in argv:
        assert json.loads(r.stdout)["error"]["kind"] == "invalid_argument", r
    assert spool.json("status")["total"] == 1


def test_the_module_form_is_spoolctl_itself(spool):
    """``python -m spooler.jobs`` (docs/jobs.md) answers as spoolctl does: a usage
    error is exit 2 with a JSON error under --json, a bad spool is spool_unusable."""
    import sys
    argv = [sys.executable, "-m", "spooler.jobs", "--spool", spool.path]
    r = subprocess.run(argv + ["submit", "--json", "--"], capture_output=True, timeout=60)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["kind"] == "invalid_argument", r
    not_a_dir = os.path.join(spool.path, "file")
    os.makedirs(spool.path, exist_ok=True)
    open(not_a_dir, "w").close()
    r = subprocess.run([sys.executable, "-m", "spooler.jobs", "--spool", not_a_dir, "submit", "--json", "--", "true"],
                       capture_output=True, timeout=60)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "spool_unusable", r
    assert b"Traceback" not in r.stderr, r


def test_unknown_job_is_an_error_with_json_error_body(spool):
    r = spool.run("status", "nope", "--json", check=False)
    assert r.returncode == 1
    assert json.loads(r.stdout)["error"]["kind"] == "not_found"


def test_every_command_takes_json(spool):
    job_id = spool.json("submit", "--", "true")["id"]
    assert spool.json("worker", "--drain")["succeeded"] == 1
    assert spool.json("status", job_id)["state"] == "succeeded"
    assert "counts" in spool.json("status")
    assert spool.json("list")["jobs"][0]["id"] == job_id
    assert spool.json("output", job_id)["content"] == ""
    assert spool.json("retry", job_id, "--force")["state"] == "queued"
    assert spool.json("cancel", job_id)["state"] == "canceled"
    assert spool.json("capabilities")["name"] == "spoolctl"


def test_capabilities_publishes_defaults_limits_and_knob_bounds(spool):
    caps = spool.json("capabilities", env={"SPOOLCTL_TEST_HEARTBEAT_INTERVAL": "",
                                           "SPOOLCTL_TEST_REAP_THRESHOLD": ""})
    assert caps["version"]
    d = caps["defaults"]
    assert d["heartbeat_interval_s"] == 5.0 and d["reap_threshold_s"] == 30.0 and d["busy_timeout_s"] == 5.0
    assert d["term_grace_s"] == 5.0  # the seed's "wait up to 5 seconds" between SIGTERM and SIGKILL
    assert d["max_retries"] == 3 and d["max_crashes"] is None
    lim = caps["limits"]
    assert (lim["concurrency_min"], lim["concurrency_max"]) == (1, knobs.CONCURRENCY_MAX)
    assert lim["timeout_s_above"] == 0 and lim["idempotency_key_bytes_min"] == 1
    assert lim["max_retries_min"] == lim["max_crashes_min"] == 0
    # each published bound is the one enforced
    assert spool.run("submit", "--timeout", "0", "--", "true", check=False).returncode == 1
    assert spool.run("worker", "--concurrency", str(lim["concurrency_min"] - 1), check=False).returncode == 1
    assert spool.run("submit", "--max-retries", str(lim["max_retries_min"] - 1), "--", "true",
                     check=False).returncode == 1
    k = caps["test_knobs"]
    assert set(k) == {"SPOOLCTL_TEST_HEARTBEAT_INTERVAL", "SPOOLCTL_TEST_REAP_THRESHOLD"}
    for name, spec in k.items():
        assert (spec["min"], spec["max"]) == knobs.TEST_KNOB_BOUNDS[name] and spec["value"] is None
    assert spool.json("capabilities")["test_knobs"]["SPOOLCTL_TEST_REAP_THRESHOLD"]["value"] == 1.0


@pytest.mark.parametrize("name,value", [("SPOOLCTL_TEST_HEARTBEAT_INTERVAL", "0.001"),
                                        ("SPOOLCTL_TEST_HEARTBEAT_INTERVAL", "soon"),
                                        ("SPOOLCTL_TEST_REAP_THRESHOLD", "99999"),
                                        ("SPOOLCTL_TEST_REAP_THRESHOLD", "-1")])
def test_test_knob_outside_its_bounds_is_a_clear_error(spool, name, value):
    for args in (["capabilities", "--json"], ["worker", "--drain"], ["list"], ["submit", "--", "true"]):
        rc, out, err = cli_inprocess(["--spool", spool.path, *args], env={name: value})
        assert rc != 0
        assert name in err and "invalid_argument" in err
        assert "bounds" in err or "not a number" in err


def test_test_knob_error_from_the_real_command(spool):
    r = spool.run("worker", "--drain", env={"SPOOLCTL_TEST_REAP_THRESHOLD": "0.01"}, check=False)
    assert r.returncode == 1
    assert b"SPOOLCTL_TEST_REAP_THRESHOLD" in r.stderr and b"[0.1, 3600]" in r.stderr


@pytest.mark.parametrize("option,value,rc", [("--max-retries", "-1", 1), ("--max-retries", "1001", 1),
                                             ("--max-crashes", "-1", 1), ("--priority", "1000001", 1),
                                             ("--priority", "abc", 2), ("--max-crashes", "x", 2),
                                             ("--priority", "1e3", 2)])
def test_a_value_that_does_not_parse_is_a_usage_error_and_one_out_of_range_is_invalid_argument(spool, option,
                                                                                            value, rc):
    """docs/jobs.md: exit code 2 for a usage error (the value is not a number of
    the option's kind), 1 with invalid_argument for a number out of its range."""
    r = spool.run("submit", option, value, "--json", "--", "true", check=False)
    assert r.returncode == rc, r
    if rc == 1:
        assert json.loads(r.stdout)["error"]["kind"] == "invalid_argument", r


@pytest.mark.parametrize("argv", [["submit", "--priority", "10000000", "--", "true"],
                                  ["submit", "--timeout", "0", "--", "true"],
                                  ["submit", "--max-retries", "-1", "--", "true"],
                                  ["submit", "--max-crashes", "x", "--", "true"],
                                  ["submit", "--"],
                                  ["worker", "--concurrency", "0"],
                                  ["worker", "--concurrency", "65"],
                                  ["list", "--state", "bogus"],
                                  ["submit", "--priority", "1_000", "--", "true"],
                                  ["submit", "--priority", "\uff15", "--", "true"],  # a full-width 5
                                  ["submit", "--timeout", "1_0", "--", "true"],
                                  ["submit", "--max-retries", "\u0663", "--", "true"]])  # an Arabic-Indic 3
def test_bad_option_values_are_refused(spool, argv):
    from spooler.jobs.store import Store
    Store(spool.path).close()  # an empty spool, to show that nothing lands in it
    rc, out, err = cli_inprocess(["--spool", spool.path, *argv])
    assert rc != 0 and err
    rc, out, err = cli_inprocess(["--spool", spool.path, "list", "--json"])
    assert rc == 0 and json.loads(out)["jobs"] == []


def test_spool_dir_from_env(spool, tmp_path):
    d = tmp_path / "envspool"
    r = subprocess.run([*spoolctl_argv(), "submit", "--", "true"], env={**spool.env, "SPOOLCTL_DIR": str(d)},
                       capture_output=True, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 0 and (d / "spool.db").exists()


def test_drain_progress_line_only_on_a_tty(spool):
    for _ in range(3):
        spool.submit_direct("true")
    w = spool.start_worker("--drain")            # stderr is a pipe: no progress line
    out, err = w.communicate(timeout=60)
    assert w.returncode == 0 and b"left" not in err
    for _ in range(2):
        spool.submit_direct("true")
    master, slave = pty.openpty()
    try:
        w = spool.start_worker("--drain", stderr=slave)
        os.close(slave)
        slave = None
        assert w.wait(timeout=60) == 0
        buf = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
        assert b"2 succeeded, 0 failed, 0 left" in buf
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)


# --- found by an outside audit (2026-11-30) ---------------------------------------

def test_a_missing_or_empty_spool_is_an_error_not_an_empty_spool(spool, tmp_path):
    missing = str(tmp_path / "typo")
    for cmd in (["status"], ["list"], ["output", "abc"], ["retry", "abc"], ["cancel", "abc"]):
        r = subprocess.run([*spoolctl_argv(), "--spool", missing, *cmd, "--json"], env=spool.env,
                           capture_output=True, cwd=str(tmp_path), timeout=60)
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "not_found", (cmd, r)
        assert not os.path.exists(missing), cmd  # and nothing was made there
    for cmd in (["status"], ["worker", "--drain"], ["submit", "--", "true"]):
        r = subprocess.run([*spoolctl_argv(), "--spool", "", *cmd[:1], "--json", *cmd[1:]], env=spool.env,
                           capture_output=True, cwd=str(tmp_path), timeout=60)
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "invalid_argument", (cmd, r)
    assert not (tmp_path / "spool.db").exists()
    # SPOOLCTL_DIR set but empty is as if unset: the default ./.spoolctl
    r = subprocess.run([*spoolctl_argv(), "submit", "--", "true"], env={**spool.env, "SPOOLCTL_DIR": ""},
                       capture_output=True, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 0 and (tmp_path / ".spoolctl" / "spool.db").exists(), r
    assert not (tmp_path / "spool.db").exists()


def test_environment_failures_are_clear_errors_without_a_traceback(spool, tmp_path):
    import apsw
    afile = tmp_path / "a-file"
    afile.write_bytes(b"not a directory")
    for cmd in (["submit", "--json", "--", "true"], ["status", "--json"], ["list", "--json"]):
        # (every command alike: status and list said not_found, "no spool there")
        r = subprocess.run([*spoolctl_argv(), "--spool", str(afile), *cmd],
                           env=spool.env, capture_output=True, cwd=str(tmp_path), timeout=60)
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "spool_unusable", (cmd, r)
        assert b"Traceback" not in r.stderr and r.stderr.count(b"\n") == 1, r.stderr
    assert afile.read_bytes() == b"not a directory"

    job = spool.submit("true")
    db = apsw.Connection(os.path.join(spool.path, "spool.db"))
    try:
        db.execute("BEGIN EXCLUSIVE")  # the spool's write lock, held by someone else
        r = spool.run("retry", job, "--json", env={"SPOOLCTL_BUSY_TIMEOUT": "0.2"}, check=False)
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "unavailable", r
        assert b"Traceback" not in r.stderr, r.stderr
        db.execute("ROLLBACK")
    finally:
        db.close()

    r = spool.run("submit", "--key", os.fsdecode(b"\xff"), "--json", "--", "true", check=False)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["kind"] == "invalid_argument", r
    assert b"Traceback" not in r.stderr, r.stderr
    assert len(spool.json("list")["jobs"]) == 1  # nothing else was stored


def test_retry_clears_the_jobs_failure_reason_and_keeps_the_attempts(spool):
    job = spool.submit("false", opts=("--max-retries", "0"))
    spool.run("worker", "--drain")
    assert spool.job(job)["state"] == "dead" and spool.job(job)["failure_reason"] == "nonzero_exit"
    j = spool.json("retry", job, "--force")
    assert j["state"] == "queued" and j["failure_reason"] is None, j
    assert j["attempts"][0]["failure_reason"] == "nonzero_exit"


def test_output_of_a_finished_attempt_whose_file_is_gone_is_an_error(spool):
    job = spool.submit("sh", "-c", "echo hi")
    spool.run("worker", "--drain")
    assert spool.run("output", job).stdout == b"hi\n"
    os.remove(spool.job(job)["attempts"][0]["stdout"])
    r = spool.run("output", job, check=False)
    assert r.returncode == 1 and b"not_found" in r.stderr and r.stdout == b"", r


def test_plain_list_and_status_show_each_command_on_one_line_as_bash_reads_it(spool):
    a = spool.submit("printf", "%s", "two\nlines", "it's\t", "next\u2028line")
    b = spool.submit("echo", "plain words")
    lines = spool.run("list").stdout.decode().splitlines()
    assert len(lines) == 2, lines
    shown = {line.split()[0]: line.split("  ")[-1] for line in lines}
    assert shown[a] == "printf %s $'two\\nlines' $'it\\'s\\t' $'next\\u2028line'"
    assert shown[b] == "echo 'plain words'"
    # bash reads the shown command back as the same arguments
    argv = subprocess.run(["bash", "-c", "for x in " + shown[a] + "; do printf '%s\\0' \"$x\"; done"],
                          capture_output=True, check=True,  # bash writes \u escapes in the locale's encoding
                          env={**os.environ, "LC_ALL": "C.UTF-8"}).stdout.split(b"\0")[:-1]
    assert argv == [b"printf", b"%s", b"two\nlines", b"it's\t", "next\u2028line".encode()]
    status = spool.run("status", a).stdout.decode()
    assert "  command:     printf %s $'two\\nlines' $'it\\'s\\t' $'next\\u2028line'\n" in status


def test_plain_status_of_an_attempt_without_an_exit_code_says_so_in_words_not_none():
    """An attempt that ended with no exit code (cancelled, crashed, never started)
    reads `exit -` in plain `status`, not Python's `None`."""
    from spooler.cli.jobs import _job_text
    attempt = {"n": 1, "exit_code": None, "failure_reason": "canceled", "started_at": 0.0, "host": "h",
               "stdout": "o", "stderr": "e"}
    job = {"id": "j1", "state": "canceled", "priority": 0, "command": ["sleep", "9"], "cwd": "/",
           "failure_reason": "canceled", "run_after": None, "worker": None, "attempts": [attempt],
           "crash_count": 0, "failure_count": 0, "max_retries": 3, "max_crashes": None, "timeout_s": None,
           "submitted_at": 0.0, "key": None}
    text = _job_text(job)
    assert "attempt 1: exit - canceled" in text and "None" not in text.split("attempt 1:")[1].split("\n")[0]
    done = _job_text({**job, "attempts": [{**attempt, "exit_code": 3, "failure_reason": "nonzero_exit"}]})
    assert "attempt 1: exit 3 nonzero_exit" in done


def test_a_forced_retry_of_a_running_job_says_what_was_refused():
    from spooler.jobs import states
    with pytest.raises(states.JobStateConflict) as e:
        states.transition(states.RUNNING, "retry_force")
    assert str(e.value) == "cannot retry, even with --force, a job that is running"
    with pytest.raises(states.JobStateConflict) as e:
        states.transition(states.DEAD, "retry")
    assert str(e.value) == "cannot retry a job that is dead (use --force)"


@pytest.mark.parametrize("command", [["status", "--json"], ["submit", "--json", "--", "true"]])
def test_a_spool_of_a_newer_schema_is_refused_and_left_as_it_is(spool, command):
    """A spool stamped with a schema newer than this spoolctl's was quietly stamped
    back to this one's by any command, a plain status too. It is spool_unusable
    (exit 1) now, and its stamp and its jobs stay as they were."""
    import apsw

    job_id = spool.submit_direct("true")
    db = os.path.join(spool.path, "spool.db")
    c = apsw.Connection(db)
    c.execute("PRAGMA user_version=2")
    c.close()
    r = spool.run(*command, check=False)
    assert r.returncode == 1, r
    e = json.loads(r.stdout)["error"]
    assert e["kind"] == "spool_unusable" and "newer" in e["message"], e
    c = apsw.Connection(db)
    try:
        assert c.execute("PRAGMA user_version").fetchall()[0][0] == 2
        assert [x[0] for x in c.execute("SELECT id FROM jobs")] == [job_id]
    finally:
        c.close()


def test_a_worker_gives_a_timed_out_job_its_grace_to_clean_up(spool, tmp_path):
    """The worker's own timeout kill (not only the executor's, whose test passes a
    grace of its own): SIGTERM, then up to knobs.TERM_GRACE_S before SIGKILL, so a
    command that cleans up on SIGTERM (0.3 s here) finishes and exits with its own
    code. With no grace it was SIGKILLed (exit -9) and printed nothing."""
    import sys
    prog = ("import signal, sys, time\n"
            "def term(*_):\n"
            "    time.sleep(0.3)\n"
            "    print('cleaned', flush=True)\n"
            "    sys.exit(3)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "print('ready', flush=True)\n"
            "time.sleep(300)\n")
    job_id = spool.submit(sys.executable, "-c", prog, opts=("--timeout", "2", "--max-retries", "0"))
    spool.run("worker", "--drain", timeout_s=60)
    job = spool.job(job_id)
    [a] = job["attempts"]
    assert job["state"] == "dead" and a["failure_reason"] == "timeout", job
    assert a["exit_code"] == 3, f"exit {a['exit_code']}: not the command's own exit after its cleanup"
    assert spool.run("output", job_id).stdout == b"ready\ncleaned\n"
