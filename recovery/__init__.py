"""Everything that runs after something went wrong. Never executes a tool."""

from recovery.reconcile import reconcile_unknown
from recovery.sweep import SweepSummary, sweep
from recovery.transcript import RepairReport, repair_file, repair_transcript

__all__ = [
    "RepairReport",
    "SweepSummary",
    "reconcile_unknown",
    "repair_file",
    "repair_transcript",
    "sweep",
]
