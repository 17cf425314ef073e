"""spoolctl: Spooler's command-line tool and a daemonless job runner.

Shape: ``spoolctl [--spool DIR] [--server URL] [--key KEY] COMMAND [--json] ...``.
Each command module registers its subcommands with ``register(subparsers)``;
a subcommand sets ``func`` (called with the parsed args, returns an exit code).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import traceback

from spooler import __version__
from spooler.errors import SpoolerError


def emit(args, obj, text=None) -> None:
    """Print ``obj`` as JSON under --json, else ``text`` (or obj as JSON)."""
    if getattr(args, "json", False) or text is None:
        print(json.dumps(obj, indent=None if getattr(args, "json", False) else 2, sort_keys=True))
    else:
        if text:
            print(text)


def warn(text: str) -> None:
    """A warning on stderr (main() points a closed stderr at /dev/null), never a failure."""
    try:
        print(f"spoolctl: warning: {text}", file=sys.stderr)
    except (OSError, ValueError):
        pass


def add_json(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error under --json is also a JSON error on
    stdout (exit status 2, as for any usage error)."""

    json_errors = False

    def error(self, message):
        if _Parser.json_errors:
            try:
                print(json.dumps({"error": {"kind": "invalid_argument", "message": message}}), file=sys.stdout)
                sys.stdout.flush()
            except (OSError, ValueError, AttributeError):  # (closed, or started without a stdout)
                _stdout_gone()  # stderr still says it, below
        super().error(message)


class OutputFailed(Exception):
    """Standard output could not be written (a full disk, a closed terminal, ...).
    Not the spool's fault, and not a reason to think the command did nothing: a
    submit has queued its job by the time its id is printed."""

    kind = "output_failed"


class _GuardedOut:
    """sys.stdout (or its .buffer) while a command runs: a failed write or flush is
    an OutputFailed, told apart from the spool's own OSErrors (environment_error).
    A reader that went away (BrokenPipeError) stays what it is."""

    def __init__(self, f):
        self._f = f  # None: the process was started with its stdout closed

    def _guard(self, fn):
        if self._f is None:
            raise OutputFailed("standard output is closed")
        try:
            return fn()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputFailed(f"{type(e).__name__}: {e}") from e

    def write(self, data):
        return self._guard(lambda: self._f.write(data))

    def flush(self):
        if self._f is not None:  # (nothing written: nothing to fail, e.g. a worker without --json)
            return self._guard(lambda: self._f.flush())

    def isatty(self) -> bool:
        return self._f is not None and self._f.isatty()

    @property
    def buffer(self):
        return _GuardedOut(getattr(self._f, "buffer", None))

    def __getattr__(self, name):
        return getattr(self._f, name)


def _stdout_gone() -> None:
    """Nothing more can go to stdout: point its descriptor at /dev/null, so that
    the interpreter's flush at exit has nothing left to fail on."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(fd, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    finally:
        os.close(fd)


_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def int_arg(text: str) -> int:
    """An argparse type for whole numbers written in ASCII digits (Python's int()
    would also take "1_000" and other scripts' digits)."""
    if not _INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(text)


def number_arg(text: str) -> float:
    """An argparse type for a number in plain ASCII notation (see int_arg)."""
    if not _NUMBER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    return float(text)


def seconds_arg(text: str) -> float:
    """An argparse type for seconds: a finite number, not negative."""
    try:
        v = number_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"seconds must be finite and not negative: {text!r}")
    return v


TIMEOUT_MAX_S = 3600.0


def server_client(args, cap=None):
    """The HTTP client of a command that talks to the server (--server, --key,
    --request-timeout). A --request-timeout out of range is invalid_argument, as
    any number out of its range is. ``cap``: the most a caller may wait (a
    worker's renewals must not wait longer than a lease lasts)."""
    from spooler.errors import InvalidArgument
    from spooler.http import HttpClient

    t = args.request_timeout
    if t is None:  # (read here, not at parse time: a command that never asks a server ignores it)
        env = os.environ.get("SPOOLCTL_REQUEST_TIMEOUT") or "30"
        try:
            t = seconds_arg(env)
        except argparse.ArgumentTypeError:
            raise InvalidArgument(f"SPOOLCTL_REQUEST_TIMEOUT is not a number of seconds: {env[:40]!r}") from None
    if not 0 < t <= TIMEOUT_MAX_S:
        raise InvalidArgument(f"--request-timeout (SPOOLCTL_REQUEST_TIMEOUT) must be more than 0 and at most "
                              f"{TIMEOUT_MAX_S:g} seconds")
    if cap is not None:
        t = min(t, cap)
    return HttpClient(args.server, args.key, timeout_s=t)


def build_parser() -> argparse.ArgumentParser:
    from spooler.cli import jobs, spool

    p = _Parser(prog="spoolctl", description="Spooler client and job runner")
    p.add_argument("--version", action="version", version=f"spoolctl {__version__}")
    p.add_argument("--spool", default=os.environ.get("SPOOLCTL_DIR") or "./.spoolctl",
                   help="job runner spool directory (env SPOOLCTL_DIR, default ./.spoolctl)")
    p.add_argument("--server", default=os.environ.get("SPOOLER_URL") or "http://127.0.0.1:8080",
                   help="Spooler HTTP URL (env SPOOLER_URL)")
    p.add_argument("--key", default=os.environ.get("SPOOLER_KEY", ""),
                   help="Spooler API key (env SPOOLER_KEY)")
    p.add_argument("--request-timeout", dest="request_timeout", type=seconds_arg, default=None,
                   help="seconds to wait for the server's answer to each request, past a receive's --wait "
                        "(env SPOOLCTL_REQUEST_TIMEOUT, default 30): a node that is stopped or hung is given "
                        "up on then")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    spool.register(sub)
    jobs.register(sub)
    return p


def environment_error(e: Exception):
    """A failure of the machine rather than of spoolctl, as the error it is (None
    for anything else): the spool's lock held too long, a spool that cannot be
    used (not a directory, read-only, corrupt, disk full), text that is not UTF-8."""
    from spooler.errors import InvalidArgument, Unavailable
    from spooler.jobs.states import SpoolUnusable

    apsw = sys.modules.get("apsw")
    if apsw is not None and isinstance(e, apsw.BusyError):
        return Unavailable("the spool is locked by another process for longer than the busy timeout "
                           "(--busy-timeout, SPOOLCTL_BUSY_TIMEOUT); try again")
    if apsw is not None and isinstance(e, apsw.Error):
        return SpoolUnusable(f"the spool's database cannot be used: {type(e).__name__}: {e}")
    if isinstance(e, UnicodeError):
        return InvalidArgument(f"text that is not valid UTF-8 (an argument, a key, the working directory): {e}")
    if isinstance(e, OSError):
        return SpoolUnusable(f"{type(e).__name__}: {e}")
    return None


def main(argv=None) -> int:
    if sys.stderr is None:
        # started with stderr closed: what would go there goes nowhere (print(file=None)
        # would write it to stdout, among the bodies, ids and JSON a script reads)
        sys.stderr = open(os.devnull, "w")
    argv = sys.argv[1:] if argv is None else list(argv)
    ours = argv[:argv.index("--")] if "--" in argv else argv  # not a job's own command line
    _Parser.json_errors = "--json" in ours
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "json_before_action", False):  # spoolctl queue --json list
        args.json = True
    if args.command == "submit" and list(args.cmd or [])[:2] in ([], ["--"]):  # (a usage error: exit 2)
        parser.error("submit needs a command: spoolctl submit [options] -- CMD [ARG...]")
    if args.command == "submit" and (args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)[:1] == [""]:
        # an empty program name can never be started: refused here rather than
        # queued to fail every attempt as spawn_failed
        parser.error("submit's command is empty: its first word names the program to run")
    if args.command == "submit" and not args.queue and args.idem_key is None and "submit" in ours \
            and any(a == "--key" or a.startswith("--key=") for a in ours[:ours.index("submit")]):
        # the global --key is the server's API key (API.md: global options come
        # before the command), unused by a local submit: say so, in case an
        # idempotency key was meant (it goes after the command)
        warn("--key before the command is the server's API key (used with --queue), not an "
             "idempotency key; an idempotency key goes after it: spoolctl submit --key K -- CMD")
    as_json = getattr(args, "json", False)
    real_stdout, sys.stdout = sys.stdout, _GuardedOut(sys.stdout)
    try:
        return _run(args, as_json)
    finally:
        sys.stdout = real_stdout


def _json_error(err: dict, received=None) -> None:
    """An error's JSON on stdout, under --json; if stdout cannot take it either,
    stderr (written next) is where it is said. ``received``: a message the
    command received before it failed (``receive --ack`` whose ack failed), given
    beside the error so that it is not lost with it."""
    try:
        print(json.dumps({"error": err} if received is None else {"error": err, "received": received}),
              file=sys.stdout)
        sys.stdout.flush()
    except (OutputFailed, OSError):
        _stdout_gone()


def _run(args, as_json: bool) -> int:
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
    except OutputFailed as e:
        # stdout is what failed: the error goes to stderr alone. What the command
        # did stands (a submit's job is queued), so it must not read as a failed spool.
        _stdout_gone()
        done = ""
        if args.command == "submit":
            done = " (its job is queued: see `spoolctl list` before submitting it again)"
        elif args.command == "receive" and getattr(args, "ack", False):
            done = (" (what it received is acked: it is not delivered again)" if as_json else
                    " (what it received is not acked: it is delivered again once its lease expires)")
        print(f"spoolctl: {OutputFailed.kind}: could not write to standard output ({e}); what the command "
              f"did stands{done}", file=sys.stderr)
        return 1
    except SpoolerError as e:
        if as_json:
            _json_error(e.to_dict(), getattr(e, "received", None))
        reason = f" ({e.reason})" if e.reason and not e.message.endswith(e.reason) else ""
        print(f"spoolctl: {e.kind}: {e.message}{reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`spoolctl ... | head`): nothing more to say to it, and
        # nothing left in the buffer for the interpreter to fail on at exit
        _stdout_gone()
        return 1
    except Exception as e:  # noqa: BLE001 - the machine's, or a bug of ours: one error, in the promised shape
        known = environment_error(e)
        if known is None:
            traceback.print_exc()
            known = SpoolerError(f"{type(e).__name__}: {e}")  # kind internal
        if as_json:
            _json_error(known.to_dict())
        if known.kind != "internal":
            print(f"spoolctl: {known.kind}: {known.message}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
