"""The harnesses: chaos, the benchmarks, and the helpers they share with the tests
(processes, the probe tool). Needs the ``harness`` extra (``bench`` for the peers)."""
