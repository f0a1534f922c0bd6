"""QAT recipes: which format fake-quantizes the weights and which the activations.

Written as one switch: ``bf16`` (nothing), ``mxfp4`` (weights), ``mxfp4+mxfp8`` (MXFP4 weights,
MXFP8 E4M3 activations), ``nvfp4``; each part may carry a profile (``mxfp4:floor+mxfp8_e4m3``).
A bare ``mxfp8`` in the activation slot means ``mxfp8_e4m3``.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.formats import Recipe, parse_recipe

_ALIASES = {"mxfp8": "mxfp8_e4m3"}


@dataclass(frozen=True)
class QATRecipe:
    weight: Recipe | None
    act: Recipe | None

    def __post_init__(self) -> None:
        if self.act is not None and self.act.fmt == "nvfp4":
            # NVFP4 activations need a per-tensor amax that changes every step; QAT here keeps
            # activation fake quantization to the MX formats whose scales are block-local.
            raise ValueError("activation fake quantization supports the MX formats only")

    @property
    def is_bf16(self) -> bool:
        return self.weight is None and self.act is None

    def __str__(self) -> str:
        if self.is_bf16:
            return "bf16"
        parts = [str(self.weight) if self.weight else "bf16"]
        if self.act:
            parts.append(str(self.act))
        return "+".join(parts)


def _part(text: str, profile: str | None) -> Recipe:
    fmt, sep, prof = text.partition(":")
    fmt = _ALIASES.get(fmt, fmt)
    return parse_recipe(f"{fmt}:{prof}" if sep else fmt, None if sep else profile)


def parse_qat_recipe(text: str | QATRecipe, profile: str | None = None) -> QATRecipe:
    """``"mxfp4+mxfp8"`` -> weights mxfp4:rceil, activations mxfp8_e4m3:rceil.

    ``profile`` applies to the weight part when it names none (the CLI's ``--profile``).
    """
    if isinstance(text, QATRecipe):
        return text
    text = text.strip().lower()
    if text in ("bf16", "none", ""):
        return QATRecipe(None, None)
    w, sep, a = text.partition("+")
    weight = None if w == "bf16" else _part(w, profile)
    act = _part(a, None) if sep else None
    return QATRecipe(weight, act)
