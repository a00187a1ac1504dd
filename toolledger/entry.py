"""The ``toolledger`` console script (and ``python -m toolledger``).

A Ctrl-C while the command line loads is "aborted", exit 130, one line, as one while a command
runs is: it was Python's traceback, from the script's own import (a cold review)."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from toolledger.cli import main as run
    except KeyboardInterrupt:
        if "--json" in sys.argv[1:]:
            sys.stderr.write('{"error": "aborted", "exit_code": 130}\n')
        else:
            sys.stderr.write("toolledger: error: aborted\n")
        sys.exit(130)
    run()
