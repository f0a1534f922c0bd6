"""One recipe grammar at every edge: the parser and TrainConfig (the trainer's command line and
the launcher carry TrainConfig: tests/train/test_args.py, tests/launch/test_launch_spec.py).
Expected values are written out from the grammar, not taken from the code."""

from __future__ import annotations

import pytest

from workbench.formats.recipe import QATRecipe, Recipe, RecipeError, parse_qat_recipe
from workbench.train.config import tiny

GOOD = {  # text -> (weight fmt, weight profile, act fmt, act profile)
    "mxfp4": ("mxfp4", "rceil", None, None),
    "mxfp8": ("mxfp8_e4m3", "rceil", None, None),
    "mxfp8_e5m2:floor": ("mxfp8_e5m2", "floor", None, None),
    "nvfp4": ("nvfp4", "torchao", None, None),
    "nvfp4:te": ("nvfp4", "te", None, None),
    "mxfp4+mxfp8": ("mxfp4", "rceil", "mxfp8_e4m3", "rceil"),
    "nvfp4+mxfp8": ("nvfp4", "torchao", "mxfp8_e4m3", "rceil"),
    "mxfp4:floor+mxfp8:even": ("mxfp4", "floor", "mxfp8_e4m3", "even"),
    "bf16+mxfp8": (None, None, "mxfp8_e4m3", "rceil"),
    "MXFP4": ("mxfp4", "rceil", None, None),
}
BAD = ["mxfp44", "mxfp5", "mxfp4+", "mxfp4+mxfp8+mxfp8", "mxfp4:nosuch", "mxfp4+nvfp4",
       "nvfp4:rceil", "fp8", ":rceil"]


def _parts(r: QATRecipe):
    w, a = r.weight, r.act
    return (w and w.fmt, w and w.profile, a and a.fmt, a and a.profile)


@pytest.mark.parametrize("text", sorted(GOOD))
def test_grammar_and_aliases(text):
    r = parse_qat_recipe(text)
    assert _parts(r) == GOOD[text]
    assert parse_qat_recipe(str(r)) == r  # str() round-trips through the parser


@pytest.mark.parametrize("text", ["bf16", "none", "BF16", ""])
def test_baseline_spellings(text):
    assert parse_qat_recipe(text) == QATRecipe(None, None)


@pytest.mark.parametrize("text", BAD)
def test_bad_recipe_is_one_line_listing_what_is_accepted(text):
    with pytest.raises(RecipeError) as e:
        parse_qat_recipe(text)
    msg = str(e.value)
    assert "\n" not in msg
    assert "accepted" in msg or "choose one of" in msg
    assert isinstance(e.value, ValueError)


def test_mxfp4_colon_empty_profile_is_the_default():
    # "mxfp4:" names no profile: the format's default, not an error.
    assert parse_qat_recipe("mxfp4:").weight == Recipe("mxfp4", "rceil")


def test_profile_argument_applies_to_weights_only():
    r = parse_qat_recipe("mxfp4+mxfp8", "floor")
    assert (r.weight.profile, r.act.profile) == ("floor", "rceil")
    with pytest.raises(RecipeError):
        parse_qat_recipe("bf16", "floor")
    with pytest.raises(RecipeError):
        parse_qat_recipe("mxfp4:even", "floor")


@pytest.mark.parametrize("text, weight_fmt", [("nvfp4+mxfp8", "nvfp4"), ("mxfp8", "mxfp8_e4m3"),
                                              ("mxfp4:floor+mxfp8", "mxfp4"), ("none", None),
                                              ("bf16+mxfp8", None)])
def test_train_config_accepts_every_qat_recipe(tmp_path, text, weight_fmt):
    cfg = tiny(str(tmp_path), recipe=text)
    assert cfg.qat_recipe == parse_qat_recipe(text)
    assert cfg.weight_format == weight_fmt
    assert cfg.stats_every == (0 if text == "none" else cfg.val_every)


def test_train_config_rejects_a_bad_recipe_naming_the_field(tmp_path):
    with pytest.raises(RecipeError, match=r"TrainConfig\.recipe 'mxfp44'"):
        tiny(str(tmp_path), recipe="mxfp44")
    with pytest.raises(ValueError, match="compressed-tensors"):
        tiny(str(tmp_path), recipe="bf16+mxfp8", export="compressed-tensors")


def test_old_run_folders_recorded_plain_strings(tmp_path):
    # config.json of earlier runs records "recipe": "mxfp4"; the field keeps the text given, so
    # the resume comparison of recorded and current configs still matches.
    cfg = tiny(str(tmp_path), recipe="mxfp4")
    assert cfg.to_dict()["recipe"] == "mxfp4"
    assert tiny(str(tmp_path), recipe=parse_qat_recipe("mxfp4")).recipe == "mxfp4:rceil"


def test_torch_free_table_agrees_with_the_format_specs():
    from workbench.formats.constants import FORMATS
    from workbench.recipe import FORMAT_PROFILES

    assert FORMAT_PROFILES == {k: (s.profiles, s.default_profile) for k, s in FORMATS.items()}
