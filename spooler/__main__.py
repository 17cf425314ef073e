import sys

from spooler.cli import main

sys.exit(main())
