"""Export a (possibly expert-parallel) workbench model as a Hugging Face Qwen3-MoE checkpoint.

Two layouts:
- "bf16": every tensor in BF16 under transformers' names, experts per expert
  (`...mlp.experts.{e}.{gate,up,down}_proj.weight`, the on-disk layout transformers 5 reads).
- "compressed-tensors": routed experts packed exactly as compressed-tensors 0.20.1 writes them
  (`MXFP4PackedCompressor` / `NVFP4PackedCompressor`): per expert projection `weight_packed` uint8
  [out, in/2] (element 2i in the low nibble) and `weight_scale` (MXFP4: uint8 E8M0 [out, in/32];
  NVFP4: float8_e4m3fn [out, in/16]) plus, for NVFP4, `weight_global_scale` fp32 [1] in
  compressed-tensors' ENCODE direction (2688/amax, i.e. the reciprocal of the workbench's decode
  scale). Everything else stays BF16. `config.json` carries the `quantization_config` that
  `ModelCompressor.update_config` writes, with `targets`/`ignore` in the style llm-compressor
  writes for MoE models (`["Linear"]`; `ignore`: `lm_head`, the router gates `re:.*mlp.gate$` and
  every other dense Linear), checked against the QuantScope and the packed set. The weights
  scheme is compressed-tensors' MXFP4A16 / NVFP4A16; a `+mxfp8` recipe adds the dynamic MXFP8
  `input_activations` of compressed-tensors' MXFP8 preset, so the export states what was trained.

Every EP rank writes its own shard (rank 0 adds the dense tensors) into a temporary folder; rank 0
merges one `model.safetensors.index.json`, writes `config.json`, fsyncs and renames the folder into
place, so a crash never leaves a folder that looks like a finished export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workbench._io import atomic_write_json, fsync_path
from workbench.arch import to_hf_config
from workbench.formats import quantize
from workbench.model.experts import GroupedExperts
from workbench.qat import convert, prepared_report
from workbench.recipe import parse_qat_recipe
from workbench.scope import QuantScope, infer_class

INDEX_FILE = "model.safetensors.index.json"
CT_VERSION = "0.20.1"  # the compressed-tensors release whose on-disk layout this reproduces
_CT_FORMAT = {"mxfp4": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized"}
_CT_WEIGHTS = {
    # QuantizationArgs.model_dump() of compressed-tensors' MXFP4A16 / NVFP4A16 presets
    "mxfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
              "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"},
    "nvfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
              "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
}
# QuantizationArgs.model_dump() of the input_activations of compressed-tensors' MXFP8 preset: the
# dynamic MX (E8M0 per 32) activation scheme, the one `+mxfp8` (mxfp8_e4m3) recipes train with.
_CT_INPUT_ACTS = {
    "mxfp8_e4m3": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 32,
                   "strategy": "group", "dynamic": True, "scale_dtype": "torch.uint8"},
}
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ExportError(ValueError):
    """The model cannot be exported as asked; the message names the tensor or option."""


def ct_quantization_config(weight_fmt: str, targets: list[str], ignore: list[str],
                           act_fmt: str | None = None) -> dict:
    """The `quantization_config` compressed-tensors 0.20.1 writes for an FP4 weight scheme, with
    the dynamic MXFP8 input-activation scheme when the run trained with one (`act_fmt`)."""
    if weight_fmt not in _CT_WEIGHTS:
        raise ExportError(f"compressed-tensors export supports {sorted(_CT_WEIGHTS)}, "
                          f"got weight format {weight_fmt!r}")
    if act_fmt is not None and act_fmt not in _CT_INPUT_ACTS:
        raise ExportError(f"compressed-tensors has no dynamic activation scheme for {act_fmt!r} "
                          f"(it writes {sorted(_CT_INPUT_ACTS)}); export this run with "
                          "--export bf16")
    acts = None if act_fmt is None else dict(_CT_INPUT_ACTS[act_fmt])
    return {
        "config_groups": {"group_0": {
            "targets": list(targets), "weights": dict(_CT_WEIGHTS[weight_fmt]),
            "input_activations": acts, "output_activations": None, "format": None}},
        "format": _CT_FORMAT[weight_fmt],
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def _experts_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def _packed_experts(model: nn.Module, recipe, packed: Mapping[str, Any] | None) -> dict[str, Any]:
    """{param name: QuantizedTensor [E_local, out, in]} for every routed-expert stack."""
    names = [f"{n}.{w}" for n, _ in _experts_modules(model) for w in _PROJ]
    if packed is None:
        if prepared_report(model) is not None:
            packed = convert(model)
        else:
            # Not prepared for QAT: quantize the masters directly. NVFP4 gets one global scale
            # per expert (the EP-invariant choice, as every expert is its own Linear on disk).
            packed = {}
            for n, m in _experts_modules(model):
                for w in _PROJ:
                    x = getattr(m, w).detach()
                    kw = {}
                    if recipe.fmt == "nvfp4":
                        kw["global_amax"] = x.float().abs().amax(dim=(1, 2), keepdim=True)
                    packed[f"{n}.{w}"] = quantize(x, recipe, **kw)
    missing = [n for n in names if n not in packed]
    if missing:
        raise ExportError(f"packed weights lack the routed-expert stacks {missing[:4]}")
    return {n: packed[n] for n in names}


def _expert_tensors(model: nn.Module, fmt: str, recipe, packed) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if fmt == "bf16":
        for n, m in _experts_modules(model):
            for w, proj in _PROJ.items():
                stack = getattr(m, w).detach()
                for k in range(m.num_experts):
                    out[f"{n}.{m.expert_offset + k}.{proj}.weight"] = stack[k].to(torch.bfloat16)
        return out
    q_by_name = _packed_experts(model, recipe, packed)
    for n, m in _experts_modules(model):
        for w, proj in _PROJ.items():
            q = q_by_name[f"{n}.{w}"]
            if q.fmt != recipe.fmt:
                raise ExportError(f"{n}.{w} is packed as {q.fmt}, the export asks for {recipe.fmt}")
            if tuple(q.shape) != tuple(getattr(m, w).shape):
                raise ExportError(f"{n}.{w}: packed logical shape {q.shape} != parameter shape "
                                  f"{tuple(getattr(m, w).shape)}")
            gs = q.global_scale
            for k in range(m.num_experts):
                base = f"{n}.{m.expert_offset + k}.{proj}"
                out[f"{base}.weight_packed"] = q.data[k].contiguous()
                out[f"{base}.weight_scale"] = q.scale[k].contiguous()
                if recipe.fmt == "nvfp4":
                    g = gs.float().reshape(-1)
                    g = g[k] if g.numel() > 1 else g[0]
                    # compressed-tensors stores the encode direction: x_q = x * gs / scale.
                    out[f"{base}.weight_global_scale"] = (1.0 / g).reshape(1).contiguous()
    return out


def _dense_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    expert_mods = {n for n, _ in _experts_modules(model)}
    out = {}
    for name, p in model.named_parameters():  # a tied lm_head appears once, as the embedding
        if name.rpartition(".")[0] in expert_mods:
            continue
        out[name] = p.detach().to(torch.bfloat16).contiguous()
    return out


# What llm-compressor writes for an MoE model quantized as `QuantizationModifier(targets="Linear",
# ignore=["lm_head", "re:.*mlp.gate$", ...])`: a class-name target, and every Linear that stays
# dense named in `ignore`. compressed-tensors matches a class target against the loaded model's
# modules (`compressed_tensors.utils.match.is_match`), so this holds for both layouts readers
# build: per-expert `nn.Linear` (vLLM, the on-disk names) and transformers 5's fused
# `Qwen3MoeExperts` (no Linear per expert; its experts are decoded by transformers' conversion
# op, which takes a group whose targets are class names as the experts' group). A name regex
# such as `re:.*experts\.\d+\.gate_proj$` matches no module of the fused model and makes
# compressed-tensors log "Could not match" on every transformers load.
CT_TARGETS = ["Linear"]
# Always ignored, present on disk or not: a tied lm_head is stored once (as the embedding) but
# transformers still builds an `lm_head` Linear, which the class target would otherwise select.
CT_ALWAYS_IGNORE = ["lm_head"]
_LAYER = re.compile(r"(?:.*\.)?layers\.\d+\.(?P<rest>.+)")


def _ignore_entry(module: str) -> str:
    """One `ignore` entry for a dense Linear, in llm-compressor's style: a per-layer module becomes
    `re:.*<name inside the layer>$` (one entry covers every layer; dots unescaped as llm-compressor
    writes them, harmless under the `$` anchor and checked below), anything else its exact name."""
    m = _LAYER.fullmatch(module)
    return f"re:.*{m['rest']}$" if m else module


def ct_targets_ignore(scope, shapes: Mapping[str, tuple[int, ...]], packed_modules: set[str]
                      ) -> tuple[list[str], list[str]]:
    """`targets`/`ignore` for the export's tensors (`shapes`: on-disk name -> logical shape).

    Checks first that `scope` and the packed set agree on every weight matrix (the exporter packs
    exactly the routed experts), then that the written targets/ignore, read back under
    compressed-tensors' matching rules (`QuantScope` reproduces them), select exactly the packed
    modules among the on-disk Linears plus `lm_head`."""
    linears: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        module, param = name.rpartition(".")[::2]
        if param not in ("weight", "weight_packed"):
            continue
        d = scope.decide(module + ".weight")
        if d.quantized != (module in packed_modules):
            raise ExportError(f"scope {scope.label!r} says {module} is "
                              f"{'quantized' if d.quantized else 'not quantized'} ({d.reason}), "
                              "but the packed export packs exactly the routed experts")
        if infer_class(module + ".weight", shape) == "Linear":
            linears[module + ".weight"] = shape
    dense = sorted({_ignore_entry(n.rpartition(".")[0]) for n in linears
                    if n.rpartition(".")[0] not in packed_modules} - set(CT_ALWAYS_IGNORE))
    # the router gate first, as llm-compressor's MoE examples list it
    ignore = CT_ALWAYS_IGNORE + sorted(dense, key=lambda p: (not p.endswith("mlp.gate$"), p))
    check = QuantScope.from_patterns(CT_TARGETS, ignore, label="export")
    # a tied head has no tensor on disk, but transformers builds the Linear: check it too (the
    # 2-D stand-in shape only tells the matcher it is a matrix)
    lm_head = {"lm_head.weight": (2, 2)} if "lm_head.weight" not in linears else {}
    for name, shape in {**linears, **lm_head}.items():
        module = name.rpartition(".")[0]
        d = check.decide(name, shape)
        if d.quantized != (module in packed_modules):
            raise ExportError(f"targets {CT_TARGETS} / ignore {ignore} would "
                              f"{'quantize' if d.quantized else 'keep dense'} {module} "
                              f"({d.reason}); the export packs exactly the routed experts")
    return list(CT_TARGETS), ignore


def _hf_config(model: nn.Module) -> dict:
    cfg = json.loads(to_hf_config(model.config).to_json_string())
    cfg["dtype"] = "bfloat16"
    return cfg


def recover_swap(out_dir: str | Path) -> None:
    """Undo what a crash left of an earlier export's swap (`out_dir` -> `.old-*`, `.tmp-*` ->
    `out_dir`, remove `.old-*`), so the next swap cannot fail on a leftover `.old-*`:
    - `.old-*` and `out_dir` both present (killed after the second rename, or while `.old-*`
      was being removed): `out_dir` is the newer complete export; `.old-*` goes;
    - only `.old-*` (killed between the renames): it is the last complete export; it goes back
      to `out_dir`, so readers find an export even if this one is killed too.
    A `.tmp-*` folder is never complete until renamed; the export removes and rewrites it."""
    out_dir = Path(out_dir)
    old = out_dir.parent / f".old-{out_dir.name}"
    if not old.exists():
        return
    if out_dir.exists():
        shutil.rmtree(old)
    else:
        os.rename(old, out_dir)
    fsync_path(out_dir.parent)


def export_model(model: nn.Module, out_dir: str | Path, *, fmt: str = "bf16",
                 recipe: str | None = None, profile: str | None = None,
                 group: dist.ProcessGroup | None = None, packed: Mapping[str, Any] | None = None,
                 scope=None) -> Path:
    """Collective under EP (every rank of `group` calls it). Returns `out_dir`.

    fmt "compressed-tensors" packs the weight format of `recipe` ("mxfp4", "mxfp4+mxfp8" ->
    MXFP4 weights; "nvfp4"); `packed` may pass `workbench.qat.convert(model)`'s output, else it
    is computed (convert() when the model is prepared, the codec otherwise)."""
    from safetensors.torch import save_file

    if fmt not in ("bf16", "compressed-tensors"):
        raise ExportError(f"export format must be 'bf16' or 'compressed-tensors', got {fmt!r}")
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    wrecipe = arecipe = None
    if fmt == "compressed-tensors":
        if recipe is None:
            raise ExportError("compressed-tensors export needs the recipe (mxfp4 or nvfp4)")
        qr = parse_qat_recipe(recipe, profile)
        wrecipe, arecipe = qr.weight, qr.act
        if wrecipe is None or wrecipe.fmt not in _CT_WEIGHTS:
            raise ExportError(f"recipe {recipe!r} has no FP4 weight format to pack")
        if arecipe is not None and arecipe.fmt not in _CT_INPUT_ACTS:
            raise ExportError(f"recipe {recipe!r}: compressed-tensors has no dynamic activation "
                              f"scheme for {arecipe.fmt!r}; use --export bf16")

    tensors = _expert_tensors(model, fmt, wrecipe, packed)
    if rank == 0:
        tensors = {**_dense_tensors(model), **tensors}
    shard = f"model-{rank + 1:05d}-of-{world:05d}.safetensors"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if group is not None:
        dist.barrier(group=group)
    save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
    fsync_path(tmp / shard)
    # stored shapes travel with the names: the targets/ignore check needs to know what is a matrix
    entry = (shard, {k: tuple(tensors[k].shape) for k in sorted(tensors)},
             sum(t.numel() * t.element_size() for t in tensors.values()))
    entries = [entry]
    if group is not None:
        entries = [None] * world
        dist.all_gather_object(entries, entry, group=group)

    if rank == 0:
        weight_map = {k: s for s, keys, _ in entries for k in keys}
        shapes = {k: shape for _, keys, _ in entries for k, shape in keys.items()}
        hf_cfg = _hf_config(model)
        if fmt == "compressed-tensors":
            if scope is None:
                scope = QuantScope.preset("routed-experts", str(wrecipe))
            packed_modules = {k.rpartition(".")[0] for k in weight_map if k.endswith(".weight_packed")}
            targets, ignore = ct_targets_ignore(scope, shapes, packed_modules)
            hf_cfg["quantization_config"] = ct_quantization_config(
                wrecipe.fmt, targets, ignore, None if arecipe is None else arecipe.fmt)
        index = {"metadata": {"total_size": sum(n for _, _, n in entries)},
                 "weight_map": dict(sorted(weight_map.items()))}
        for name, obj in ((INDEX_FILE, index), ("config.json", hf_cfg)):
            atomic_write_json(tmp / name, obj, indent=2, sort_keys=True)
        old = out_dir.parent / f".old-{out_dir.name}"
        recover_swap(out_dir)
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        fsync_path(out_dir.parent)
        if old.exists():
            shutil.rmtree(old)
    if group is not None:
        dist.barrier(group=group)
    return out_dir
