"""``python -m spooler.jobs``: spoolctl under the module's name.

It is ``spoolctl`` itself (``spooler.cli.main``): the same commands, global
options, exit codes and JSON errors. The module form is also one of the
worker markers the reaper recognises (docs/jobs.md).
"""
import sys

from spooler.cli import main

if __name__ == "__main__":
    sys.exit(main())
