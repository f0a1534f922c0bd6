"""QAT recipes: which format fake-quantizes the weights and which the activations.

The type and its grammar live in ``workbench.recipe`` (the bottom layer, so the trainer's
config, the launcher and the CLI parse without importing the model); re-exported here.
"""

from __future__ import annotations

from workbench.recipe import QATRecipe, RecipeError, parse_qat_recipe

__all__ = ["QATRecipe", "RecipeError", "parse_qat_recipe"]
