"""Recipes, parsed once at every edge (CLI, TrainConfig, LaunchSpec, notebooks).

A codec recipe is a format plus the profile (library behaviour) that encodes it, written
``FORMAT[:PROFILE]``. A QAT recipe pairs a weight recipe with an optional activation recipe,
written ``W[:PROFILE][+A[:PROFILE]]``. Aliases: ``mxfp8`` = ``mxfp8_e4m3``; a bare format takes
its default profile (``nvfp4`` = ``nvfp4:torchao``); ``bf16`` / ``none`` = no quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

# Imports nothing from workbench or torch: the launcher and the trainer's config parse recipes
# without loading torch. workbench.formats.constants builds its FormatSpecs from these names.
MX_PROFILES = (
    "rceil",
    "floor",
    "ceil",
    "even",
    "torchao-rceil",
    "compressed-tensors",
    "modelopt-export",
    "triton-kernels",
    "triton-kernels-main",
    "transformers",
)
# compressed-tensors and ModelOpt write no MXFP8 E5M2, transformers only MXFP4
# (mx_profiles.PROFILES says who writes what).
MX_E5M2_PROFILES = tuple(p for p in MX_PROFILES
                         if p not in ("compressed-tensors", "modelopt-export", "transformers"))
MX_E4M3_PROFILES = tuple(p for p in MX_PROFILES if p != "transformers")
NVFP4_PROFILES = ("torchao", "te", "modelopt-export", "compressed-tensors")

# format -> (profiles, default profile); FORMATS in workbench.formats.constants carries the same.
FORMAT_PROFILES: dict[str, tuple[tuple[str, ...], str]] = {
    "mxfp4": (MX_PROFILES, "rceil"),
    "mxfp8_e4m3": (MX_E4M3_PROFILES, "rceil"),
    "mxfp8_e5m2": (MX_E5M2_PROFILES, "rceil"),
    "nvfp4": (NVFP4_PROFILES, "torchao"),
}

ALIASES = {"mxfp8": "mxfp8_e4m3"}
BASELINES = ("bf16", "none")  # the spellings of "no quantization"
GRAMMAR = "W[:PROFILE][+A[:PROFILE]]"


class RecipeError(ValueError):
    """A recipe string that does not parse; the message is one line and lists what is accepted."""


def _formats_text() -> str:
    alias = ", ".join(f"{a} = {b}" for a, b in ALIASES.items())
    return f"formats {', '.join(sorted(FORMAT_PROFILES))} (alias {alias})"


def accepted() -> str:
    """One line: the grammar, the formats and aliases, the baseline spellings."""
    return (f"accepted: {GRAMMAR} with {_formats_text()}, e.g. mxfp4, "
            f"nvfp4:te, mxfp4+mxfp8, nvfp4+mxfp8; or {' / '.join(BASELINES)} for none")


@dataclass(frozen=True)
class Recipe:
    fmt: str
    profile: str

    def __post_init__(self) -> None:
        if self.fmt not in FORMAT_PROFILES:
            raise RecipeError(f"unknown format {self.fmt!r}; {accepted()}")
        profiles = FORMAT_PROFILES[self.fmt][0]
        if self.profile not in profiles:
            raise RecipeError(
                f"format {self.fmt!r} has no profile {self.profile!r}; "
                f"choose one of {list(profiles)}"
            )

    def __str__(self) -> str:
        return f"{self.fmt}:{self.profile}"


def _codec_accepted() -> str:
    return f"accepted: FORMAT[:PROFILE] with {_formats_text()}"


def _parse_part(text: str, profile: str | None, tail: str) -> Recipe:
    fmt, sep, prof = text.strip().lower().partition(":")
    fmt = ALIASES.get(fmt, fmt)
    if sep and profile is not None and prof != profile:
        raise RecipeError(f"recipe {text!r} names profile {prof!r} but profile={profile!r} "
                          "was passed")
    if fmt not in FORMAT_PROFILES:
        raise RecipeError(f"unknown format {fmt!r} in recipe {text!r}; {tail}")
    prof = prof if sep else profile
    return Recipe(fmt, prof if prof else FORMAT_PROFILES[fmt][1])


def parse_recipe(text: str | Recipe, profile: str | None = None) -> Recipe:
    """``"mxfp4"`` -> Recipe("mxfp4", "rceil"); ``"nvfp4:te"`` -> Recipe("nvfp4", "te");
    ``"mxfp8"`` -> Recipe("mxfp8_e4m3", "rceil")."""
    if isinstance(text, Recipe):
        return text
    if not isinstance(text, str):
        raise RecipeError(f"a recipe is a string like 'mxfp4:rceil', got {text!r}; "
                          f"{_codec_accepted()}")
    return _parse_part(text, profile, _codec_accepted())


@dataclass(frozen=True)
class QATRecipe:
    """Which recipe fake-quantizes the weights and which the activations (None: left BF16)."""

    weight: Recipe | None
    act: Recipe | None

    def __post_init__(self) -> None:
        if self.act is not None and self.act.fmt == "nvfp4":
            # NVFP4 activations need a per-tensor amax that changes every step; QAT here keeps
            # activation fake quantization to the MX formats whose scales are block-local.
            raise RecipeError("activation fake quantization supports the MX formats only; "
                              f"{accepted()}")

    @property
    def is_bf16(self) -> bool:
        return self.weight is None and self.act is None

    def __str__(self) -> str:
        """Canonical text; ``parse_qat_recipe(str(r)) == r``."""
        if self.is_bf16:
            return "bf16"
        parts = [str(self.weight) if self.weight else "bf16"]
        if self.act:
            parts.append(str(self.act))
        return "+".join(parts)

    def to_json(self) -> str:
        return str(self)


def parse_qat_recipe(text: str | QATRecipe, profile: str | None = None) -> QATRecipe:
    """``"mxfp4+mxfp8"`` -> weights mxfp4:rceil, activations mxfp8_e4m3:rceil.

    ``profile`` applies to the weight part when it names none (the trainer's old ``--profile``).
    Raises ``RecipeError`` (one line, listing what is accepted) for anything else.
    """
    if isinstance(text, QATRecipe):
        if profile is not None:
            raise RecipeError(f"recipe {text} is already parsed; profile={profile!r} is extra")
        return text
    if not isinstance(text, str):
        raise RecipeError(f"a recipe is a string like 'mxfp4+mxfp8', got {text!r}; {accepted()}")
    low = text.strip().lower()
    if low in (*BASELINES, ""):
        if profile is not None:
            raise RecipeError(f"profile {profile!r} applies to a quantized recipe; recipe "
                              f"{text!r} has none")
        return QATRecipe(None, None)
    w, sep, a = low.partition("+")
    if sep and not a:
        raise RecipeError(f"recipe {text!r} has an empty activation part; {accepted()}")
    if w in BASELINES:
        if profile is not None:
            raise RecipeError(f"profile {profile!r} applies to the weight format; recipe "
                              f"{text!r} quantizes no weights")
        weight = None
    else:
        weight = _parse_part(w, profile, accepted())
    if "+" in a:
        raise RecipeError(f"recipe {text!r} has more than one '+'; {accepted()}")
    act = _parse_part(a, None, accepted()) if sep else None
    return QATRecipe(weight, act)
