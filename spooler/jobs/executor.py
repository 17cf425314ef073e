"""Run one attempt: spawn in a new session, stdout/stderr straight to files,
enforce the timeout by killing the whole process group.

The command is a session and process-group leader (``start_new_session=True``),
so the group id and the session id are its pid. A kill reaches everything it
forked: the group, and every process still in its session, which catches a
descendant that moved to a group of its own (``setpgid``: GNU ``timeout``, a
job-control shell). Only a descendant that calls setsid() itself escapes.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional

from spooler.jobs import knobs, states

POLL_S = 0.1   # how often a running attempt checks for timeout / stop requests
PID_RECORD_AFTER_S = 0.05   # on_spawn (record the pid for cancel / the reaper) once it runs this long


@dataclass(frozen=True)
class Result:
    reason: Optional[str]      # None: exit 0
    exit_code: Optional[int]   # None: never started; negative: killed by that signal
    detail: str = ""
    pid: Optional[int] = None


def _live(pgid: Optional[int]):
    """The pids of live (non-zombie) processes of the attempt whose leader's pid is
    ``pgid``: in its group, or in its session (a descendant that moved to a group
    of its own); any process with None. Read from /proc."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            rest = stat[stat.rfind(b")") + 2:].split()  # rest[0] = state, rest[2] = pgrp, rest[3] = session
            if len(rest) > 3 and rest[0] != b"Z" and (pgid is None or int(rest[2]) == pgid
                                                       or int(rest[3]) == pgid):
                yield int(name)
        except (OSError, ValueError):
            continue


def _group_members(pgid: int) -> Optional[int]:
    """How many live (non-zombie) processes are in the group or its session; None
    without /proc."""
    if not os.path.isdir("/proc"):
        return None
    return sum(1 for _ in _live(pgid))


ATTEMPT_ENV = "SPOOLCTL_ATTEMPT_TOKEN"   # "<job id>:<attempt n>" in every attempt's environment


ENVIRON_REREADS = 25      # a group member whose environment reads empty is read again,
ENVIRON_REREAD_S = 0.004  # this often: it may be inside execve (about 0.1 s at most per member)


def _environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def _carriers(pgid: Optional[int], token: str):
    """The pids of live processes (of group ``pgid``, or any with None) whose
    environment holds ``SPOOLCTL_ATTEMPT_TOKEN=token``. Needs /proc.

    A process inside execve has no environment to show for a moment (the new
    image's is not mapped yet): ``sleep 100 & exit 0`` can be caught there. A
    member of ``pgid`` that reads empty is read again, a bounded number of
    times, before it counts as not carrying the token. (Not on the machine-wide
    scan: kernel threads read empty for good.)"""
    needle = f"{ATTEMPT_ENV}={token}".encode()
    for pid in _live(pgid):
        try:
            env = _environ(pid)
            for _ in range(ENVIRON_REREADS if pgid is not None else 0):
                if env:
                    break
                time.sleep(ENVIRON_REREAD_S)
                env = _environ(pid)
            if needle in env.split(b"\0"):
                yield pid
        except OSError:
            continue


def kill_orphans(pgid: Optional[int], token: str) -> int:
    """SIGKILL the members of ``pgid`` that carry ``SPOOLCTL_ATTEMPT_TOKEN=token``;
    with ``pgid`` None (the worker died before it wrote the command's pid), every
    process on the machine that carries it.

    Used by the reaper on the attempt of a dead worker: the group id alone could
    have been reused since, the token in the environment cannot (it names the job
    and the attempt, and the command's descendants inherit it). Best effort: a
    process that replaced its environment is not found. Returns how many."""
    if not os.path.isdir("/proc"):
        return 0
    killed = 0
    for pid in _carriers(pgid, token):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            continue
    return killed


def group_carries(pgid: int, token: str) -> Optional[bool]:
    """Whether a live member of ``pgid`` carries ``SPOOLCTL_ATTEMPT_TOKEN=token``:
    that the group is still the attempt's and not a later one that reused its id.
    None where there is no /proc to tell."""
    if not os.path.isdir("/proc"):
        return None
    return next(_carriers(pgid, token), None) is not None


def group_alive(pgid: int) -> bool:
    """Whether a live process of the group, or of its session, remains."""
    members = _group_members(pgid)
    if members is not None:
        return members > 0
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(pgid: int, sig: int) -> bool:
    """Signal the group, and each process of its session outside it (``_live``).
    False when nothing of it could be signalled: gone, or every member someone
    else's (a setuid program the command ran, for a worker not root)."""
    try:
        os.killpg(pgid, sig)
        done = True
    except (ProcessLookupError, PermissionError):
        done = False
    if os.path.isdir("/proc"):
        for pid in _live(pgid):
            try:
                if os.getpgid(pid) != pgid:  # (the group's members had it from killpg)
                    os.kill(pid, sig)
                    done = True
            except (ProcessLookupError, PermissionError):
                continue
    return done


def kill_group(pgid: int, proc: Optional[subprocess.Popen] = None, grace_s: float = knobs.TERM_GRACE_S) -> None:
    """SIGTERM the group, wait up to ``grace_s`` for it to go, SIGKILL it, wait. A
    group this worker may not signal is waited for at most ``grace_s`` more, never
    for ever, and never stops the worker."""
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    killed = True
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()   # reap the leader so it does not linger as a zombie
        if not group_alive(pgid):
            break
        time.sleep(0.02)
    else:
        killed = _killpg(pgid, signal.SIGKILL)
    if proc is not None:
        try:
            # SIGKILL cannot be ignored: once it was delivered the leader ends
            proc.wait(None if killed else grace_s)
        except subprocess.TimeoutExpired:
            pass
    # orphaned members are reaped by init; bounded wait for them to disappear
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        if not _killpg(pgid, signal.SIGKILL):
            break
        time.sleep(0.02)


def end_leftovers(pgid: int, grace_s: float = knobs.TERM_GRACE_S) -> bool:
    """The command (the group's leader) has exited and been waited for: stop what
    it left running in its group or its session (``sleep 100 &``, ``env -i cmd
    &``, ``timeout 100 cmd &``), as a timeout or a cancel would, so that no
    attempt outlives its own end (and none runs on past its timeout). A syscall
    and one read of /proc when nothing is left. True if something was stopped.

    Whether the group is still the attempt's needs no token (a member may have
    cleaned its environment): the kernel hands out a process id again only when
    no process, group or session uses it. So while a member of the attempt's
    group or session remains, no new process can have the leader's pid; and a
    group with that id whose leader is alive is a later one's, which is left
    alone."""
    try:
        os.killpg(pgid, 0)
    except PermissionError:
        return False
    except ProcessLookupError:  # the group is empty: what of its session?
        if not _group_members(pgid):
            return False
    try:
        os.kill(pgid, 0)   # the leader was reaped: a process with its pid is another's
        return False
    except PermissionError:
        return False
    except ProcessLookupError:
        pass
    kill_group(pgid, None, grace_s)
    return True


def run(argv: list, stdout_path: str, stderr_path: str, timeout_s: Optional[float] = None,
        cwd: Optional[str] = None, env: Optional[dict] = None,
        on_spawn: Callable[[int], None] = lambda pid: None,
        should_stop: Callable[[], Optional[str]] = lambda: None,
        grace_s: float = knobs.TERM_GRACE_S) -> Result:
    """Run ``argv`` to completion. ``should_stop`` returns a failure reason
    (canceled, worker_stopped, lease_lost) when the worker wants it killed; asked
    once before anything starts too (a worker told to stop after its claim)."""
    stop = should_stop()
    if stop:
        return Result(stop, None, f"not started: {stop}")
    try:  # an output file that cannot be made is this attempt's spawn failure, not the worker's
        os.makedirs(os.path.dirname(stdout_path), exist_ok=True)
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=cwd, env=env,
                                    start_new_session=True, close_fds=True)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        try:
            with open(stderr_path, "ab") as err:
                err.write(f"spoolctl: cannot start {argv[0]!r}: {e}\n".encode())
        except OSError:
            pass
        return Result(states.SPAWN_FAILED, None, f"{type(e).__name__}: {e}")
    pid = proc.pid
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pidfd = _pidfd(pid)
    announced = False
    try:
        # most short commands are done before this: their pid is never written,
        # which saves one fsync'd transaction per job
        first_wait_s = PID_RECORD_AFTER_S
        while True:
            limit_s = first_wait_s if not announced else POLL_S
            wait_s = limit_s if deadline is None else max(0.0, min(limit_s, deadline - time.monotonic()))
            code = _wait(proc, pidfd, wait_s)
            if code is not None:
                break
            if not announced:
                announced = True
                try:
                    on_spawn(pid)
                except BaseException:
                    kill_group(pid, proc, grace_s)
                    raise
            stop = should_stop()
            timed_out = not stop and deadline is not None and time.monotonic() >= deadline
            if stop or timed_out:
                # a command that finished on its own while we decided (should_stop
                # reads the store) has its own result: it was not stopped, and a
                # success must not be run again as a timeout
                code = proc.poll()
                if code is not None:
                    break
                kill_group(pid, proc, grace_s)
                if stop:
                    return Result(stop, proc.returncode, f"stopped: {stop}", pid)
                return Result(states.TIMEOUT, proc.returncode, f"exceeded --timeout {timeout_s:g}s", pid)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    end_leftovers(pid, grace_s)
    if code == 0:
        return Result(None, 0, "", pid)
    detail = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return Result(states.NONZERO_EXIT, code, detail, pid)


def _pidfd(pid: int) -> Optional[int]:
    """A pidfd becomes readable when the process exits: wake on exit, not on a poll tick."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _wait(proc: subprocess.Popen, pidfd: Optional[int], wait_s: float) -> Optional[int]:
    if pidfd is not None:
        ready, _, _ = select.select([pidfd], [], [], wait_s)
        return proc.wait() if ready else proc.poll()
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None

