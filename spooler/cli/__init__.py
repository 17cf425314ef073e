"""spoolctl: Spooler's command-line tool and a daemonless job runner.

Shape: ``spoolctl [--spool DIR] [--server URL] [--key KEY] COMMAND [--json] ...``.
Each command module registers its subcommands with ``register(subparsers)``;
a subcommand sets ``func`` (called with the parsed args, returns an exit code).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from spooler import __version__
from spooler.errors import SpoolerError


def emit(args, obj, text=None) -> None:
    """Print ``obj`` as JSON under --json, else ``text`` (or obj as JSON)."""
    if getattr(args, "json", False) or text is None:
        print(json.dumps(obj, indent=None if getattr(args, "json", False) else 2, sort_keys=True))
    else:
        if text:
            print(text)


def add_json(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def build_parser() -> argparse.ArgumentParser:
    from spooler.cli import jobs, spool

    p = argparse.ArgumentParser(prog="spoolctl", description="Spooler client and job runner")
    p.add_argument("--version", action="version", version=f"spoolctl {__version__}")
    p.add_argument("--spool", default=os.environ.get("SPOOLCTL_DIR", "./.spoolctl"),
                   help="job runner spool directory (env SPOOLCTL_DIR, default ./.spoolctl)")
    p.add_argument("--server", default=os.environ.get("SPOOLER_URL", "http://127.0.0.1:8080"),
                   help="Spooler HTTP URL (env SPOOLER_URL)")
    p.add_argument("--key", default=os.environ.get("SPOOLER_KEY", ""),
                   help="Spooler API key (env SPOOLER_KEY)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    spool.register(sub)
    jobs.register(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except SpoolerError as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": e.to_dict()}), file=sys.stdout)
        print(f"spoolctl: {e.kind}: {e.message}" + (f" ({e.reason})" if e.reason else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
