"""``python -m worker`` is ``toolledger``."""

from worker.cli import main

main()
