"""Numbers, not pictures: per-expert quantization error tables from a checkpoint.

Which path computes a table is a plan (``plan(question, ck, recipes_or_reference)``, printable,
passed as ``plan=``); compiled graphs carry from call to call in a ``Session`` the caller owns.
"""

from .compare import CompareError, CompareResult, compare, reference_detail
from .inspect import InspectResult, inspect_checkpoint, write_report
from .metrics import METRICS, block_scales, error_metrics, grid_mismatch, scale_exponents
from .plans import PATHS, AnalysisPlan, Route, plan
from .session import Session
from .tables import (
                     ErrorTables,
                     ExpertDetail,
                     candidate_errors,
                     expert_detail,
                     reference_errors,
                     stored_vs_recipes,
)

__all__ = [
                     "METRICS",
                     "PATHS",
                     "AnalysisPlan",
                     "CompareError",
                     "CompareResult",
                     "ErrorTables",
                     "ExpertDetail",
                     "InspectResult",
                     "Route",
                     "Session",
                     "block_scales",
                     "candidate_errors",
                     "compare",
                     "error_metrics",
                     "expert_detail",
                     "grid_mismatch",
                     "inspect_checkpoint",
                     "plan",
                     "reference_detail",
                     "reference_errors",
                     "scale_exponents",
                     "stored_vs_recipes",
                     "write_report",
]
