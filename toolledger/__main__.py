"""``python -m toolledger`` is ``toolledger``."""

from toolledger.cli import main

main()
