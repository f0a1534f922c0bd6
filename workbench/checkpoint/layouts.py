"""Layout adapters: group stored tensors into logical weights and check them against the config.

Each layout names its companions by suffix on the weight's stored name (`base`); the suffixes,
dtypes, block widths and decoders live in one record per layout and per codec (registry.py):

| layout | data | scale | global scale | other |
|---|---|---|---|---|
| compressed-tensors | `base_packed` (FP4/INT4) or `base` (FP8) | `base_scale` | `base_global_scale` | `base_shape` (INT4) |
| gpt-oss | `base_blocks` `[E, N, K/32, 16]` | `base_scales` | | |
| modelopt | `base` | `base_scale` | `base_scale_2` | |
| fp8-block (DeepSeek) | `base` | `base_scale_inv` | | |
| dense | `base` | | | |

The stored format is read from the tensors (dtypes, shape ratios) and compared with what the
config says, so a config naming a format the tensors do not carry is an error, not garbage.
Activation / KV-cache scales (`input_scale`, `k_scale`, ...) are kept aside as `extras`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..scope import QuantScope, is_weight_param, split_name
from .config import QuantConfig
from .errors import (
    CheckpointError,
    ConfigError,
    DtypeMismatchError,
    FormatMismatchError,
    MissingCompanionError,
    ShapeMismatchError,
    UncoveredTensorError,
)
from .index import ShardIndex
from .registry import CODECS, LAYOUT_OF_METHOD, LAYOUTS, LogicalSpec
from workbench.formats import Recipe
from workbench.scope import Rule

EXTRA_PARAMS = re.compile(r"(input|output)_(scale|global_scale|zero_point)|[kvq]_scale")
_EP = re.compile(r"@ep\d+$")
_E8 = (torch.uint8, torch.float8_e8m0fnu)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# derived views of the records, for callers that only ask "which formats codec is this"
FMT_OF_CODEC = {c.name: c.fmt for c in CODECS.values() if c.fmt is not None}


@dataclass
class Built:
    layout: str
    logicals: dict[str, LogicalSpec]
    extras: list[str]
    problems: list[CheckpointError]
    scope: QuantScope


def detect_layout(qcfg: QuantConfig) -> str:
    return LAYOUT_OF_METHOD[qcfg.method].name


def _group(names: list[str], layout: str):
    """base -> {role: stored name}; plus extras."""
    sfx = LAYOUTS[layout].role_of_suffix.items()
    groups: dict[str, dict[str, str]] = {}
    extras = []
    for n in names:
        q = _EP.search(n) if "@" in n else None
        plain, qual = (n[: q.start()], q.group()) if q else (n, "")
        module, param = split_name(plain)
        if EXTRA_PARAMS.fullmatch(param):
            extras.append(n)
            continue
        role, base = "data", n
        for s, r in sfx:
            if param.endswith(s) and is_weight_param(param[: -len(s)]):
                role, base = r, f"{module}.{param[: -len(s)]}{qual}" if module else param[:-len(s)]
                break
        g = groups.setdefault(base, {})
        if role in g:
            g.setdefault("_conflict", n)
        g[role] = n
    return groups, extras


def _foreign(name: str, layout: str) -> str | None:
    """A name that looks like another layout's packed companion (never right in `layout`)."""
    _, param = split_name(_EP.sub("", name))
    own = LAYOUTS[layout].role_of_suffix
    for lay in LAYOUTS.values():
        if lay.name == layout:
            continue
        for s in lay.role_of_suffix:
            if param.endswith(s) and is_weight_param(param[: -len(s)]) and s not in own:
                return lay.name
    return None


def build(index: ShardIndex, qcfg: QuantConfig, model_type: str | None = None) -> Built:
    layout = detect_layout(qcfg)
    groups, extras = _group(index.names(), layout)
    problems: list[CheckpointError] = []
    path = index.folder
    # logical shapes first (scope class inference needs ndim), then decide, then check
    shapes: dict[str, tuple[int, ...]] = {}
    for base, g in groups.items():
        if "_conflict" in g:
            problems.append(ConfigError(f"two tensors claim the same role for {base!r}: "
                                        f"{g['_conflict']!r} and another", path=path, tensor=base))
        data = g.get("data")
        if data is None:
            role, comp = next((r, n) for r, n in g.items() if r != "_conflict")
            problems.append(MissingCompanionError(
                f"{role} tensor {comp!r} has no data tensor {base!r} (or its packed form)",
                path=index.entry(comp).file, tensor=comp))
            continue
        shape = _logical_shape(index, layout, g)
        if len(shape) >= 2 and 0 in shape and is_weight_param(split_name(_EP.sub("", base))[1]):
            # a weight with a zero-size dim holds no data, whatever its other dims claim: a
            # 248-byte header can declare 10^7 experts of 0 rows, and each would get records
            comp = g["data"]
            problems.append(ShapeMismatchError(
                f"weight of shape {list(shape)} holds no elements (a zero-size dimension)",
                path=index.entry(comp).file, tensor=comp))
            continue
        shapes[base] = shape
    stored_q = None
    lay = LAYOUTS[layout]
    if lay.stored_scope:  # DeepSeek configs name no targets: the scale companions do
        (codec,) = qcfg.codecs
        stored_q = {b: codec for b, g in groups.items() if "scale" in g and b in shapes}
    scope = QuantScope.from_config(qcfg, names=shapes, stored=stored_q)
    logicals: dict[str, LogicalSpec] = {}
    for base, shape in shapes.items():
        g = groups[base]
        dec = scope.decide(base)
        codec = dec.recipe if dec.quantized else None
        errs = _check(index, layout, qcfg, base, g, codec, shape)
        if errs:
            problems += errs
            continue
        logicals[base] = _spec(index, layout, qcfg, base, g, codec, shape, model_type)
    return Built(layout, logicals, extras, problems, _public_scope(scope, layout, shapes))


def _public_scope(scope: QuantScope, layout: str, shapes) -> QuantScope:
    """The same decisions, with recipes users can pass to workbench.formats: MX / NVFP4 codecs
    become `Recipe(fmt, profile of the layout's decoder)`; INT4 / FP8 stay codec strings."""


    def public(codec):
        if codec in FMT_OF_CODEC:
            return Recipe(FMT_OF_CODEC[codec], LAYOUTS[layout].profile)
        return codec

    stored = None if scope.stored is None else {n: public(c) for n, c in scope.stored.items()}
    rules = [Rule(r.name, r.targets, public(r.recipe)) for r in scope.rules]
    return QuantScope(rules, scope.ignore, label=scope.label, names=shapes, stored=stored)


def _logical_shape(index: ShardIndex, layout: str, g: dict[str, str]) -> tuple[int, ...]:
    e = index.entry(g["data"])
    s = e.shape
    if e.dtype == torch.uint8 and "scale" in g and len(s) >= 1:
        if LAYOUTS[layout].blocks4d and len(s) >= 2:
            return (*s[:-2], s[-2] * s[-1] * 2)
        return (*s[:-1], s[-1] * 2)
    if e.dtype == torch.int32 and "shape" in g:
        return s  # true width read in _check / _spec from the weight_shape tensor
    return s


def _stored_codec(index: ShardIndex, g: dict[str, str]) -> str | None:
    """What the tensors carry, read from dtypes alone (None: plain dense weight)."""
    d = index.entry(g["data"]).dtype
    sc = index.entry(g["scale"]).dtype if "scale" in g else None
    if sc is None:
        # a uint8 / int32 / fp8 *weight* without scales can only be packed data; buffers
        # (position ids, masks, counters) are never weights
        weight = is_weight_param(split_name(_EP.sub("", g["data"]))[1]) or len(g) > 1
        packed = d in (torch.uint8, torch.int32, torch.float8_e4m3fn)
        return "packed?" if weight and packed else None
    if d == torch.uint8:
        return "nvfp4" if sc == torch.float8_e4m3fn else "mxfp4" if sc in _E8 else "?"
    if d == torch.float8_e4m3fn:
        return "mxfp8_e4m3" if sc in _E8 else "fp8" if sc in _FLOATS else "?"
    if d == torch.int32:
        return "int4"
    return "?"


def _family(codec: str | None) -> str | None:
    return CODECS[codec].family if codec in CODECS else codec


def _check(index, layout, qcfg, base, g, codec, shape) -> list[CheckpointError]:
    path = index.entry(g["data"]).file
    carried = _stored_codec(index, g)
    if codec is None:
        foreign = _foreign(g["data"], layout)
        if carried is not None or len(g) > 1 or foreign is not None:
            comp = next((n for r, n in g.items() if r != "data"), g["data"])
            why = ("config.json has no quantization_config" if qcfg.method == "dense"
                   else "no config target covers it (or an ignore entry excludes it)")
            what = f"named like a {foreign} packed companion" if foreign else \
                f"stored quantized ({carried or 'packed'})"
            return [UncoveredTensorError(f"{what}, but {why} (layout {layout})",
                                         path=index.entry(comp).file, tensor=comp)]
        return []
    if carried in CODECS and _family(carried) != _family(codec):
        return [FormatMismatchError(f"config says {codec} but the stored tensors carry "
                                    f"{carried} ({_dtypes(index, g)})", path=path, tensor=base)]
    errs: list[CheckpointError] = []
    need = CODECS[codec].roles
    for role in need:
        if role not in g:
            want = LAYOUTS[layout].companion(base, role)
            errs.append(MissingCompanionError(
                f"config says {base!r} is {codec}, but its {role} companion {want!r} is missing",
                path=path, tensor=want))
    if errs:
        return errs
    for role, allowed in need.items():
        e = index.entry(g[role])
        if e.dtype not in allowed:
            errs.append(DtypeMismatchError(f"{codec} {role} must be {_names(allowed)}, is "
                                           f"{e.dtype}", path=e.file, tensor=g[role]))
    if errs:
        return errs
    return CODECS[codec].check(index, LAYOUTS[layout], qcfg, base, g, shape, CODECS[codec])


def _fused_gpt_oss(index: ShardIndex, base: str, shape: tuple[int, ...], model_type) -> bool:
    """Dense 3-D `experts.gate_up_proj` / `down_proj` stored as transformers' GptOssExperts
    parameters, `[E, in, out]`: the bias `[E, out]` says which dim is out (else model_type)."""
    if len(shape) != 3 or not re.search(r"\.experts\.(gate_up_proj|down_proj)$", base):
        return False
    bias = index.entries.get(base + "_bias")
    if bias is not None and len(bias.shape) == 2 and shape[1] != shape[2]:
        return bias.shape[-1] == shape[2]
    return model_type == "gpt_oss"


def _spec(index, layout, qcfg, base, g, codec, shape, model_type=None) -> LogicalSpec:
    if codec is not None:
        return CODECS[codec].spec(index, LAYOUTS[layout], qcfg, base, g, shape, CODECS[codec])
    d = index.entry(g["data"])
    parts = tuple(sorted((r, n) for r, n in g.items() if r != "_conflict"))
    if _fused_gpt_oss(index, base, d.shape, model_type):
        E, K, N = d.shape
        return LogicalSpec(base, None, (E, N, K), d.dtype, parts, transposed=True,
                           interleaved=True)
    return LogicalSpec(base, None, d.shape, d.dtype, parts)


def _dtypes(index, g) -> str:
    return ", ".join(f"{r}={index.entry(n).dtype}" for r, n in sorted(g.items()) if r != "_conflict")


def _names(dts) -> str:
    return " or ".join(str(t).replace("torch.", "") for t in dts)
