"""Numbers, not pictures: per-expert quantization error tables from a checkpoint."""

from .compare import CompareError, CompareResult, compare, reference_detail
from .inspect import InspectResult, inspect_checkpoint, write_report
from .metrics import METRICS, block_scales, error_metrics, grid_mismatch, scale_exponents
from .paths import PATHS, choose_path
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
                     "CompareError",
                     "CompareResult",
                     "ErrorTables",
                     "ExpertDetail",
                     "InspectResult",
                     "block_scales",
                     "candidate_errors",
                     "choose_path",
                     "compare",
                     "error_metrics",
                     "expert_detail",
                     "grid_mismatch",
                     "inspect_checkpoint",
                     "reference_detail",
                     "reference_errors",
                     "scale_exponents",
                     "stored_vs_recipes",
                     "write_report",
]
