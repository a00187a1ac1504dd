"""``python -m toolledger`` is ``toolledger``."""

from toolledger.entry import main

main()
