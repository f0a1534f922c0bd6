"""Recipes: a format plus the profile (library behaviour) that encodes it, written FORMAT[:PROFILE]."""

from __future__ import annotations

from dataclasses import dataclass

from .constants import format_spec


@dataclass(frozen=True)
class Recipe:
    fmt: str
    profile: str

    def __post_init__(self) -> None:
        spec = format_spec(self.fmt)
        if self.profile not in spec.profiles:
            raise ValueError(
                f"format {self.fmt!r} has no profile {self.profile!r}; "
                f"choose one of {list(spec.profiles)}"
            )

    def __str__(self) -> str:
        return f"{self.fmt}:{self.profile}"


def parse_recipe(text: str | Recipe, profile: str | None = None) -> Recipe:
    """``"mxfp4"`` -> Recipe("mxfp4", "rceil"); ``"nvfp4:te"`` -> Recipe("nvfp4", "te")."""
    if isinstance(text, Recipe):
        return text
    fmt, sep, prof = text.strip().partition(":")
    if sep and profile is not None and prof != profile:
        raise ValueError(f"recipe {text!r} names profile {prof!r} but profile={profile!r} was passed")
    prof = prof if sep else profile
    return Recipe(fmt, prof if prof else format_spec(fmt).default_profile)
