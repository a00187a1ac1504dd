"""Everything that runs after something went wrong. Never executes a tool."""

from toolledger.recovery.reconcile import reconcile_unknown
from toolledger.recovery.sweep import SweepSummary, sweep
from toolledger.recovery.transcript import RepairReport, repair_file, repair_transcript

__all__ = [
    "RepairReport",
    "SweepSummary",
    "reconcile_unknown",
    "repair_file",
    "repair_transcript",
    "sweep",
]
