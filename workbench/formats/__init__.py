"""Reference codecs for block-scaled formats (MXFP4, MXFP8, NVFP4): the spec, in plain torch.

Imports only torch. Each library's behaviour is a named profile (see docs/formats.md).
"""

from .api import QuantizedTensor, dequantize, fake_quantize, quantize
from .constants import FORMATS, FormatSpec, format_spec
from .recipe import QATRecipe, Recipe, RecipeError, parse_qat_recipe, parse_recipe

__all__ = [
    "FORMATS",
    "FormatSpec",
    "QATRecipe",
    "QuantizedTensor",
    "Recipe",
    "RecipeError",
    "dequantize",
    "fake_quantize",
    "format_spec",
    "parse_qat_recipe",
    "parse_recipe",
    "quantize",
]
