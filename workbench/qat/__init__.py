"""QAT: straight-through fake quantization, the grouped fake-quant GEMM, prepare/convert."""

from .grouped import QATExpertGemms, grouped_mm
from .prepare import PrepareReport, convert, pack_master, prepare, prepared_report, unprepare
from .recipe import QATRecipe, parse_qat_recipe
from .state import QATState
from .ste import (
    FakeQuantHook,
    expert_amax,
    fake_quant_reference,
    fake_quant_ste,
    register_fake_quant_hook,
)

__all__ = [
    "FakeQuantHook",
    "PrepareReport",
    "QATExpertGemms",
    "QATRecipe",
    "QATState",
    "convert",
    "expert_amax",
    "fake_quant_reference",
    "fake_quant_ste",
    "grouped_mm",
    "pack_master",
    "parse_qat_recipe",
    "prepare",
    "prepared_report",
    "register_fake_quant_hook",
    "unprepare",
]
