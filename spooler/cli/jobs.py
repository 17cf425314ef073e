"""spoolctl job-runner commands: submit, worker, status, list, output, retry, cancel, capabilities.

Local back-end by default (the spool directory ``--spool``); ``submit`` and
``worker`` use a Spooler queue instead when given ``--queue Q`` (server from
the global ``--server``, API key from the global ``--key``).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from spooler.cli import add_json, emit, int_arg, number_arg, server_client, warn
from spooler.errors import InvalidArgument, NotFound
from spooler.jobs import knobs, states


# --- helpers ----------------------------------------------------------------

def _settings(args, **kw) -> knobs.Settings:
    return knobs.load(busy_timeout_s=getattr(args, "busy_timeout", None), **kw)


def _spool_named(args) -> None:
    if not args.spool:
        raise InvalidArgument("--spool (or SPOOLCTL_DIR) is empty: name the spool directory")


def _store(args, settings=None, create: bool = False):
    """``create``: only submit and worker make a spool; the other commands find
    a missing one ``not_found``."""
    from spooler.jobs.store import Store

    _spool_named(args)
    settings = settings or _settings(args)
    return Store(args.spool, settings.busy_timeout_s, create=create)


def _fmt_time(t) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def _shell_word(arg: str) -> str:
    """One argument as bash would read it back, always on one line: plain shell
    quoting, or ANSI-C quoting ($'...') when it holds control characters such
    as a newline, which would otherwise split a job's line in two."""
    if not any(map(_breaks_a_line, arg)):
        return shlex.quote(arg)
    out = []
    for ch in arg:
        o = ord(ch)
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif _breaks_a_line(ch):  # \u: bash writes it back as UTF-8
            out.append(f"\\x{o:02x}" if o < 0x80 else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def _breaks_a_line(ch: str) -> bool:
    """A control character (C0, DEL, C1) or a Unicode line or paragraph separator."""
    o = ord(ch)
    return o < 32 or 127 <= o < 160 or ch in "\u2028\u2029"


def shown_command(argv: list) -> str:
    return " ".join(map(_shell_word, argv))


def _job_text(job: dict) -> str:
    lines = [f"job {job['id']}: {job['state']}",
             f"  command:     {shown_command(job['command'])}",
             f"  priority:    {job['priority']}",
             f"  failures:    {job['failure_count']} (dead after {job['max_retries'] + 1}: "
             f"max_retries {job['max_retries']})",
             f"  crashes:     {job['crash_count']} of max_crashes "
             f"{'unbounded' if job['max_crashes'] is None else job['max_crashes']}"]
    if job["failure_reason"]:
        lines.append(f"  failure:     {job['failure_reason']}")
    if job["state"] == states.QUEUED and job["run_after"] and job["run_after"] > time.time():
        lines.append(f"  eligible at: {_fmt_time(job['run_after'])}")
    if job["worker"]:
        w = job["worker"]
        lines.append(f"  worker:      {w['id']} (heartbeat {_fmt_time(w['heartbeat_at'])})")
    for a in job["attempts"]:
        code = "-" if a["exit_code"] is None else a["exit_code"]  # (none: cancelled, crashed, not started)
        lines.append(f"  attempt {a['n']}: exit {code} {a['failure_reason'] or ''}"
                     f" started {_fmt_time(a['started_at'])} on {a['host']}".rstrip())
        lines.append(f"    stdout {a['stdout']}")
        lines.append(f"    stderr {a['stderr']}")
    return "\n".join(lines)


def _command_argv(args) -> list:
    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise InvalidArgument("usage: spoolctl submit [options] -- CMD [ARG...]")
    return cmd


def _stderr_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


# --- commands ---------------------------------------------------------------

def _cwd() -> str:
    """The directory a job runs in: the one it is submitted from."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise InvalidArgument("the working directory no longer exists (it was removed): a job runs in the "
                              "directory it is submitted from; cd to one that exists") from None


def cmd_submit(args) -> int:
    command = _command_argv(args)
    cwd = _cwd()  # first: the default spool (./.spoolctl) is found through it
    if args.queue is not None:  # (--queue "" is a malformed name, not the local spool)
        from spooler.jobs import remote

        knobs.load()   # validate the knobs everywhere, for one consistent rule
        job = remote.submit(server_client(args), args.queue, command, args.priority,
                            args.max_retries, args.max_crashes, args.timeout, args.idem_key, cwd)
        if job["queue_max_retries"] < job["max_retries"]:
            warn(f"queue {args.queue} has maxRetries {job['queue_max_retries']}, so this job is retried at most "
                 f"{job['queue_max_retries']} times, not {job['max_retries']}")
        emit(args, job, job["id"])
        return 0
    store = _store(args, create=True)
    try:
        job_id, dup = store.submit(command, args.priority, args.max_retries, args.max_crashes, args.timeout,
                                   args.idem_key, cwd=cwd)
        if args.json:
            emit(args, dict(store.get(job_id), duplicate=dup))
        else:
            print(job_id)
    finally:
        store.close()
    return 0


# a --queue worker's calls (renewals among them) wait at most this long, whatever
# --request-timeout says: one hung renewal holds up the others behind it
WORKER_REQUEST_TIMEOUT_S = 30.0


def cmd_worker(args) -> int:
    _spool_named(args)
    settings = _settings(args, heartbeat_interval_s=args.heartbeat_interval)
    progress = sys.stderr if (args.drain and _stderr_tty()) else None
    if args.queue is not None:
        from spooler.jobs.remote import RemoteWorker

        server_client(args)  # its settings checked before any slot starts
        w = RemoteWorker(lambda: server_client(args, cap=WORKER_REQUEST_TIMEOUT_S), args.queue, args.spool, settings,
                         args.concurrency, args.drain, progress, server=args.server)
    else:
        from spooler.jobs.worker import Worker

        w = Worker(args.spool, settings, args.concurrency, args.drain, progress)
    summary = w.run()
    if args.json:
        emit(args, summary)
    return 1 if summary.get("errors") else 0


def cmd_status(args) -> int:
    store = _store(args)
    try:
        if args.job is not None:  # (an empty id, from an unset variable, is no job: not the counts)
            job = store.get(args.job)
            emit(args, job, _job_text(job))
        else:
            counts = store.counts(backend=None)
            emit(args, {"spool": store.spool_dir, "counts": counts, "total": sum(counts.values())},
                 "  ".join(f"{s} {n}" for s, n in counts.items()))
    finally:
        store.close()
    return 0


def cmd_list(args) -> int:
    if not 1 <= args.limit <= knobs.LIST_LIMIT_MAX:
        raise InvalidArgument(f"--limit must be in [1, {knobs.LIST_LIMIT_MAX}]")
    store = _store(args)
    try:
        jobs = store.list(args.state, args.limit + 1)  # one more: whether the limit left any out
    finally:
        store.close()
    truncated = len(jobs) > args.limit
    del jobs[args.limit:]
    if truncated:  # never silent: stdout keeps its shape, the note goes to stderr
        print(f"spoolctl: listed the first {args.limit} jobs (oldest first) and left out the rest; "
              f"pass --limit to see more", file=sys.stderr)
    # API.md: state, attempts, crash count, failure_reason (the reason only when there is one)
    text = "\n".join(f"{j['id']}  {j['state']:<9} p={j['priority']:<4} attempts={len(j['attempts'])}"
                     f" crashes={j['crash_count']}"
                     + (f" failure={j['failure_reason']}" if j["failure_reason"] else "")
                     + f"  {shown_command(j['command'])}" for j in jobs)
    emit(args, {"jobs": jobs, "truncated": truncated}, text)
    return 0


def cmd_output(args) -> int:
    if args.attempt is not None and args.attempt < 1:  # out of range, as --max-retries 1001 is
        raise InvalidArgument(f"--attempt {args.attempt}: attempts are numbered from 1")
    store = _store(args)
    try:
        att = store.attempt(args.job, args.attempt)
    finally:
        store.close()
    stream = "stderr" if args.stderr else "stdout"
    path = att[stream]
    if args.json:
        try:
            with open(path, "rb") as f:
                data = f.read(knobs.OUTPUT_JSON_BYTES_MAX + 1)
            exists = True
        except FileNotFoundError:
            data, exists = b"", False
        emit(args, {"id": args.job, "attempt": att["n"], "stream": stream, "path": path, "exists": exists,
                    "content": data[:knobs.OUTPUT_JSON_BYTES_MAX].decode("utf-8", "replace"),
                    "truncated": len(data) > knobs.OUTPUT_JSON_BYTES_MAX})
        return 0
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        if att.get("finished_at") is None or att.get("exit_code") is None:
            return 0   # its command is only being started, or never ran: nothing written
        # a finished attempt's file was deleted, or the spool moved (paths are absolute)
        raise NotFound(f"the {stream} file of attempt {att['n']} is missing: {path}") from None
    with f:
        out = sys.stdout.buffer
        while True:
            chunk = f.read(1 << 16)
            if not chunk:
                break
            out.write(chunk)
        out.flush()
    return 0


def cmd_retry(args) -> int:
    store = _store(args)
    try:
        store.retry(args.job, force=args.force)
        job = store.get(args.job)
    finally:
        store.close()
    emit(args, job, job["id"])
    return 0


def cmd_cancel(args) -> int:
    from spooler.jobs import executor

    store = _store(args)
    try:
        prev, pid, host, token = store.cancel(args.job)
        if prev == states.RUNNING:
            import socket

            if host in (None, socket.gethostname()):
                # the owning worker notices at its next heartbeat too; killing here
                # stops it now. The group is the job's (pid = pgid, new session) only
                # while a member carries the attempt's token: after a crash or a
                # reboot the id may be another program's group, which is left alone
                # (a stray process of the attempt is still found by its token).
                # No pid yet (the worker died before it wrote it, or the command
                # is in its first moments): every process carrying the token.
                if pid and executor.group_carries(pid, token) is not False:
                    executor.kill_group(pid, None)
                else:
                    executor.kill_orphans(None, token)
            store.close_canceled_attempt(args.job, int(token.rpartition(":")[2]))
        job = store.get(args.job)
    finally:
        store.close()
    emit(args, job, job["id"])
    return 0


def cmd_capabilities(args) -> int:
    emit(args, knobs.capabilities(), None)
    return 0


# --- registration -------------------------------------------------------------

def register(sub) -> None:
    p = add_json(sub.add_parser("submit", help="queue a job: submit [options] -- CMD [ARG...]"))
    p.add_argument("--key", dest="idem_key", default=None,
                   help="idempotency key: a repeat returns the first job's id (prevents duplicate "
                        "submission, not duplicate execution)")
    p.add_argument("--priority", type=int_arg, default=knobs.DEFAULT_PRIORITY, help="higher runs first (default 0)")
    p.add_argument("--max-retries", type=int_arg, default=knobs.DEFAULT_MAX_RETRIES,
                   help="job-owned failures retried before dead (default 3)")
    p.add_argument("--max-crashes", type=int_arg, default=knobs.DEFAULT_MAX_CRASHES,
                   help="worker crashes survived before dead (default unbounded)")
    p.add_argument("--timeout", type=number_arg, default=None, help="seconds; then the process group is killed")
    p.add_argument("--queue", default=None, help="submit to this Spooler queue (at --server) instead of the spool")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    p.set_defaults(func=cmd_submit)

    p = add_json(sub.add_parser("worker", help="claim and run jobs"))
    p.add_argument("--concurrency", type=int_arg, default=knobs.DEFAULT_CONCURRENCY,
                   help=f"jobs at once (1..{knobs.CONCURRENCY_MAX})")
    p.add_argument("--drain", action="store_true", help="exit once nothing is queued or running")
    p.add_argument("--queue", default=None, help="run jobs from this Spooler queue (at --server)")
    p.add_argument("--heartbeat-interval", type=number_arg, default=None,
                   help=f"seconds between heartbeats (default {knobs.DEFAULT_HEARTBEAT_INTERVAL_S:g})")
    p.add_argument("--busy-timeout", type=number_arg, default=None,
                   help=f"seconds to wait for the spool's write lock (default {knobs.DEFAULT_BUSY_TIMEOUT_S:g}; "
                        f"env {knobs.ENV_BUSY_TIMEOUT})")
    p.set_defaults(func=cmd_worker)

    p = add_json(sub.add_parser("status", help="one job, or counts by state"))
    p.add_argument("job", nargs="?")
    p.set_defaults(func=cmd_status)

    p = add_json(sub.add_parser("list", help="jobs, oldest first"))
    p.add_argument("--state", choices=states.STATES)
    p.add_argument("--limit", type=int_arg, default=knobs.LIST_LIMIT_DEFAULT)
    p.set_defaults(func=cmd_list)

    p = add_json(sub.add_parser("output", help="stdout (or stderr) of the latest or a given attempt"))
    p.add_argument("job")
    p.add_argument("--attempt", type=int_arg, default=None, help="1-based attempt number")
    p.add_argument("--stderr", action="store_true")
    p.set_defaults(func=cmd_output)

    p = add_json(sub.add_parser("retry", help="requeue now (a succeeded job runs again); --force for a dead job, and to start the retry and crash budgets afresh"))
    p.add_argument("job")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_retry)

    p = add_json(sub.add_parser("cancel", help="cancel a queued job or stop a running one"))
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)

    p = add_json(sub.add_parser("capabilities", help="version, defaults, limits, test knobs"))
    p.set_defaults(func=cmd_capabilities)
