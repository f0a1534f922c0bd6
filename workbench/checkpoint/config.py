"""`quantization_config` parsing into typed, frozen dataclasses.

Sources, in this order: `config.json`'s `quantization_config` (or `text_config.quantization_config`
for multimodal wrappers), then `hf_quant_config.json` (ModelOpt). Each storage scheme maps to a
workbench *codec* name used by the layout adapters:

| source | codec |
|---|---|
| compressed-tensors `mxfp4-pack-quantized` | `mxfp4` |
| compressed-tensors `nvfp4-pack-quantized` | `nvfp4-ct` (global scale stored encode-direction) |
| compressed-tensors `mxfp8-quantized` | `mxfp8_e4m3` |
| compressed-tensors `pack-quantized` (INT, e.g. Kimi K2 W4A16 group 32) | `int4` |
| compressed-tensors `float-quantized` (FP8, tensor/channel/block scale) | `fp8` |
| gpt-oss `quant_method: mxfp4` | `mxfp4` |
| ModelOpt `quant_algo` NVFP4 / MXFP4 / MXFP8 | `nvfp4` / `mxfp4` / `mxfp8_e4m3` |
| DeepSeek `quant_method: fp8` + `weight_block_size` | `fp8-block` |
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..scope import Pattern
from .errors import ConfigError, UnknownFormatError
from .registry import CODECS as CODEC_RECORDS
from .safe_io import CONFIG_CAP, checkpoint_root, present, short
from .safe_io import read_json as _read_json

CT_FORMATS = {  # compressed_tensors.config.CompressionFormat values (0.20.1)
    "mxfp4-pack-quantized": "mxfp4",
    "nvfp4-pack-quantized": "nvfp4-ct",
    "mxfp8-quantized": "mxfp8_e4m3",
    "pack-quantized": "int4",
    "float-quantized": "fp8",
}
CT_UNQUANTIZED = {"dense"}
MODELOPT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "MXFP4": "mxfp4",
                  "MXFP8": "mxfp8_e4m3"}
CODECS = tuple(CODEC_RECORDS)


@dataclass(frozen=True)
class WeightArgs:
    """The subset of a compressed-tensors `weights` block the reader needs."""

    num_bits: int
    type: str  # "int" | "float"
    strategy: str | None = None  # "group" | "tensor_group" | "channel" | "tensor" | "block"
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    symmetric: bool = True


@dataclass(frozen=True)
class ConfigGroup:
    """One compressed-tensors config group (or the single implied group of other methods)."""

    name: str
    targets: tuple[str, ...]
    codec: str | None  # None: this group does not store quantized weights
    weights: WeightArgs | None = None
    format: str | None = None  # the group's own storage format string, if any

    def __post_init__(self):
        if self.codec is not None and self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; expected one of {CODECS}")


@dataclass(frozen=True)
class QuantConfig:
    """Parsed quantization metadata of a checkpoint (method "dense" when there is none).

    `pattern_style` says how `groups[*].targets` and `ignore` are matched (see workbench.scope):
    "ct" (compressed-tensors), "hf" (transformers' modules_to_not_convert), "glob" (ModelOpt).
    """

    method: str  # "compressed-tensors" | "mxfp4" | "modelopt" | "fp8" | "dense"
    source: Path | None
    format: str | None = None
    groups: tuple[ConfigGroup, ...] = ()
    ignore: tuple[str, ...] = ()
    pattern_style: str = "ct"
    weight_block_size: tuple[int, int] | None = None
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.method not in ("compressed-tensors", "mxfp4", "modelopt", "fp8", "dense"):
            raise ValueError(f"unknown method {self.method!r}")
        if self.pattern_style not in ("ct", "hf", "glob"):
            raise ValueError(f"unknown pattern_style {self.pattern_style!r}")

    @property
    def codecs(self) -> set[str]:
        return {g.codec for g in self.groups if g.codec is not None}


def read_json(path: Path, root: Path | None = None) -> Any:
    """A JSON file of the checkpoint: regular, inside `root`, size-capped (see safe_io)."""
    return _read_json(path, checkpoint_root(path.parent) if root is None else root)


def find_quant_config(model_config: dict, config_path: Path) -> dict | None:
    q = model_config.get("quantization_config")
    if q is None and isinstance(model_config.get("text_config"), dict):
        q = model_config["text_config"].get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise ConfigError("quantization_config is not a JSON object", path=config_path)
    return q


def load_quant_config(folder: Path, remote=None) -> tuple[dict, QuantConfig]:
    """(model config dict, parsed QuantConfig) for a checkpoint folder, or for the remote
    folder ``remote`` (a `remote.RemoteFolder`; ``folder`` is then its root)."""
    folder = Path(folder) if remote is None else folder
    root = checkpoint_root(folder) if remote is None else None

    def load(name: str) -> tuple[Any, Any]:
        """(path, parsed JSON or MISSING)."""
        path = folder / name
        if remote is not None:
            doc, found = remote.read_json(name, CONFIG_CAP, what="JSON file")
            return path, doc if found else _MISSING
        return path, read_json(path, root) if present(path) else _MISSING

    cfg_path, model_config = load("config.json")
    if model_config is _MISSING:
        model_config = {}
    if not isinstance(model_config, dict):
        raise ConfigError("config.json is not a JSON object", path=cfg_path)
    q = find_quant_config(model_config, cfg_path)
    if q is None:
        hf_path, doc = load("hf_quant_config.json")
        if doc is not _MISSING:
            if not isinstance(doc, dict) or not isinstance(doc.get("quantization"), dict):
                raise ConfigError("hf_quant_config.json has no 'quantization' object",
                                  path=hf_path)
            return model_config, parse_modelopt(doc["quantization"], hf_path)
        return model_config, QuantConfig(method="dense", source=None)
    return model_config, parse_quant_config(q, cfg_path)


_MISSING = object()


def parse_quant_config(q: dict, path: Path) -> QuantConfig:
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return parse_compressed_tensors(q, path)
    if method == "mxfp4":
        return parse_gpt_oss(q, path)
    if method == "modelopt":
        return parse_modelopt(q, path)
    if method == "fp8":
        return parse_fp8_block(q, path)
    raise UnknownFormatError(f"unknown quant_method {short(method)} (known: compressed-tensors, "
                             "mxfp4, modelopt, fp8)", path=path)


def _str_list(v: Any, what: str, path: Path, style: str | None = None) -> tuple[str, ...]:
    """A list of strings; with `style`, each must also be a valid pattern of that style (an
    invalid regex is the config's fault and is reported here, not as re.error later)."""
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ConfigError(f"{what} must be a list of strings, got {short(v)}", path=path)
    if style is not None:
        for i, text in enumerate(v):
            try:
                Pattern(text, style)
            except (ValueError, re.error, RecursionError, OverflowError) as e:
                raise ConfigError(f"{what}[{i}] = {short(text)} is not a valid pattern: "
                                  f"{short(str(e), 120)}", path=path) from None
    return tuple(v)


def _opt_str(v: Any, what: str, path: Path) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ConfigError(f"{what} must be a string, got {short(v)}", path=path)
    return v


def _pos_int(v: Any, what: str, path: Path) -> int:
    # type() is int: bools, floats (0.5, Infinity) and strings ("abc", "32") are all refused
    if type(v) is not int or v <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {short(v)}", path=path)
    return v


def _weight_args(w: dict, path: Path, group: str) -> WeightArgs:
    at = f"config_groups.{group}.weights"
    if "num_bits" not in w:
        raise ConfigError(f"{at} has no 'num_bits'", path=path)
    num_bits = _pos_int(w["num_bits"], f"{at}.num_bits", path)
    typ = _opt_str(w.get("type", "int"), f"{at}.type", path)
    strategy = _opt_str(w.get("strategy"), f"{at}.strategy", path)
    gs = w.get("group_size")
    group_size = None if gs is None else _pos_int(gs, f"{at}.group_size", path)
    bs = w.get("block_structure")
    block = None
    if bs is not None:
        if not isinstance(bs, list) or len(bs) != 2:
            raise ConfigError(f"{at}.block_structure must be [rows, cols], got {short(bs)}",
                              path=path)
        block = (_pos_int(bs[0], f"{at}.block_structure[0]", path),
                 _pos_int(bs[1], f"{at}.block_structure[1]", path))
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise ConfigError(f"{at}.symmetric must be true or false, got {short(sym)}", path=path)
    return WeightArgs(num_bits=num_bits, type=typ or "int", strategy=strategy,
                      group_size=group_size, block_structure=block, symmetric=sym)


def _ct_codec(fmt: str, wa: WeightArgs | None, path: Path, group: str) -> str | None:
    if fmt in CT_UNQUANTIZED or wa is None:
        return None
    if fmt not in CT_FORMATS:
        raise UnknownFormatError(f"compressed-tensors format {fmt!r} (group {group!r}) is not "
                                 f"supported; supported: {sorted(CT_FORMATS)}", path=path)
    codec = CT_FORMATS[fmt]
    want = CODEC_RECORDS[codec].bits
    if (wa.num_bits, wa.type) != want:
        raise ConfigError(f"group {group!r}: format {fmt!r} needs {want[1]}{want[0]} weights, "
                          f"config says {wa.type}{wa.num_bits}", path=path)
    if codec == "int4" and (wa.strategy != "group" or not wa.group_size or not wa.symmetric):
        raise UnknownFormatError(f"group {group!r}: only symmetric group-wise pack-quantized "
                                 "INT4 is supported", path=path)
    return codec


def parse_compressed_tensors(q: dict, path: Path) -> QuantConfig:
    fmt = _opt_str(q.get("format"), "quantization_config.format", path)
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        # frozen / calibration checkpoints hold BF16 weights next to scales: not a storage format
        raise UnknownFormatError(f"quantization_status {short(status)}: only 'compressed' checkpoints "
                                 "are read", path=path)
    groups_raw = q.get("config_groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise ConfigError("compressed-tensors config has no 'config_groups'", path=path)
    groups = []
    for gname, g in groups_raw.items():
        if not isinstance(g, dict):
            raise ConfigError(f"config group {gname!r} is not an object", path=path)
        targets = _str_list(g.get("targets"), f"config_groups.{gname}.targets", path, "ct")
        w = g.get("weights")
        if w is not None and not isinstance(w, dict):
            raise ConfigError(f"config_groups.{gname}.weights must be an object, got "
                              f"{short(w)}", path=path)
        wa = _weight_args(w, path, gname) if isinstance(w, dict) else None
        gfmt = _opt_str(g.get("format"), f"config_groups.{gname}.format", path) or fmt
        if gfmt is None or gfmt == "mixed-precision":
            raise ConfigError(f"group {gname!r} has no storage format", path=path)
        groups.append(ConfigGroup(gname, targets, _ct_codec(gfmt, wa, path, gname), wa, gfmt))
    return QuantConfig("compressed-tensors", path, fmt, tuple(groups),
                       _str_list(q.get("ignore"), "ignore", path, "ct"), "ct", raw=q)


def parse_gpt_oss(q: dict, path: Path) -> QuantConfig:
    # transformers' Mxfp4 quantizer converts the experts modules (fused gate_up/down) only
    group = ConfigGroup("experts", ("re:.*\\.experts$",), "mxfp4", None, "mxfp4")
    return QuantConfig("mxfp4", path, "mxfp4", (group,),
                       _str_list(q.get("modules_to_not_convert"), "modules_to_not_convert", path,
                                 "hf"), "hf", raw=q)


def parse_modelopt(q: dict, path: Path) -> QuantConfig:
    """ModelOpt: `hf_quant_config.json` says `exclude_modules`; the copy it writes into
    config.json (`convert_hf_quant_config_format`) says `ignore` and adds `config_groups`
    targets. Both hold shell globs (`model.layers.*.self_attn*`)."""
    algo = q.get("quant_algo")
    algo = algo.upper() if isinstance(algo, str) else algo  # config.json copies are lower case
    if not isinstance(algo, str) or algo not in MODELOPT_ALGOS:
        raise UnknownFormatError(f"ModelOpt quant_algo {short(algo)} is not supported; supported: "
                                 f"{sorted(MODELOPT_ALGOS)}", path=path)
    targets: tuple[str, ...] = ()
    groups_raw = q.get("config_groups")
    if isinstance(groups_raw, dict):
        for gname, g in groups_raw.items():
            if isinstance(g, dict):
                targets += _str_list(g.get("targets"), f"config_groups.{gname}.targets", path,
                                     "ct")
    group = ConfigGroup("modelopt", targets or ("Linear",), MODELOPT_ALGOS[algo], None, algo)
    key = "exclude_modules" if "exclude_modules" in q else "ignore"
    return QuantConfig("modelopt", path, algo, (group,), _str_list(q.get(key), key, path, "glob"),
                       "glob", raw=q)


def parse_fp8_block(q: dict, path: Path) -> QuantConfig:
    bs = q.get("weight_block_size")
    if (not isinstance(bs, list) or len(bs) != 2
            or not all(type(b) is int and b > 0 for b in bs)):
        raise ConfigError(f"fp8 quant_method needs weight_block_size [r, c] of positive "
                          f"integers, got {short(bs)}", path=path)
    if q.get("fmt", "e4m3") != "e4m3":
        raise UnknownFormatError(f"fp8 fmt {short(q.get('fmt'))} is not supported (only e4m3)",
                                 path=path)
    group = ConfigGroup("fp8", ("Linear",), "fp8-block", None, "fp8")
    return QuantConfig("fp8", path, "fp8", (group,),
                       _str_list(q.get("modules_to_not_convert"), "modules_to_not_convert", path,
                                 "hf"), "hf", weight_block_size=(bs[0], bs[1]), raw=q)
