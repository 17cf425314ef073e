"""``python -m spooler.jobs``: the job-runner commands of spoolctl on their own.

Same global options and commands as ``spoolctl`` for the job runner; useful
where only the job runner is installed. ``spoolctl`` remains the entry point.
"""
import argparse
import json
import os
import sys

from spooler import __version__
from spooler.errors import SpoolerError


def main(argv=None) -> int:
    from spooler.cli import jobs

    p = argparse.ArgumentParser(prog="spoolctl", description="spoolctl job runner")
    p.add_argument("--version", action="version", version=f"spoolctl {__version__}")
    p.add_argument("--spool", default=os.environ.get("SPOOLCTL_DIR", "./.spoolctl"))
    p.add_argument("--server", default=os.environ.get("SPOOLER_URL", "http://127.0.0.1:8080"))
    p.add_argument("--key", default=os.environ.get("SPOOLER_KEY", ""))
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    jobs.register(sub)
    args = p.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpoolerError as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": e.to_dict()}))
        print(f"spoolctl: {e.kind}: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
