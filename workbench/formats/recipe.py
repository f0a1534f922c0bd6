"""Recipes (FORMAT[:PROFILE], W[:PROFILE][+A[:PROFILE]]): the torch-free grammar in
``workbench.recipe``, re-exported here for the codec API."""

from workbench.recipe import (
    ALIASES,
    BASELINES,
    GRAMMAR,
    QATRecipe,
    Recipe,
    RecipeError,
    accepted,
    parse_qat_recipe,
    parse_recipe,
)

__all__ = ["ALIASES", "BASELINES", "GRAMMAR", "QATRecipe", "Recipe", "RecipeError", "accepted",
           "parse_qat_recipe", "parse_recipe"]
