"""Export a (possibly expert-parallel) workbench model as a Hugging Face checkpoint of its family.

Tensor names are transformers' for the family (`workbench.model.hf`); `config.json` is the
family's transformers config (`workbench.arch.to_hf_config`). gpt-oss keeps its experts fused,
so its "bf16" export and its native MXFP4 layout ("gpt-oss") are written by
`workbench.train.export_gpt_oss`. For the other families, two layouts:
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
adds the tokenizer, merges one `model.safetensors.index.json`, writes `config.json`, fsyncs and
renames the folder into place (`workbench.train.export_folder`: only over an export the workbench
wrote), so a crash or a failed step never leaves a folder that looks like a finished export. A
failure on any rank (a full disk: "no space left on DEVICE while writing PATH") is raised on
every rank, reported by the rank that met it. Under FSDP
(`model.layout.fsdp`) rank 0 alone writes the same files, streamed (`_write_fsdp`): byte for byte
the export of the same weights without FSDP at the same EP size.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workbench._io import atomic_write_json, fsync_path, new_file_mode, writing
from workbench.arch import to_hf_config
from workbench.formats import format_spec
from workbench.model.experts import GroupedExperts
from workbench.model.hf import hf_name
from workbench.qat import convert, pack_master, prepared_report
from workbench.recipe import parse_qat_recipe
from workbench.scope import QuantScope, infer_class
from workbench.train import export_folder, export_gpt_oss
from workbench.train.distributed import DistInfo, agree
from workbench.train.export_folder import ExportFolderError
from workbench.train.fsdp import reshard_
from workbench.train.safetensors_stream import StreamedFile, nbytes
from workbench.train.tokenizer import copy_tokenizer

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


EXPORT_FORMATS = ("bf16", "compressed-tensors", "gpt-oss")


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


def _pack(x: torch.Tensor, recipe, site=None):
    """The QuantizedTensor of one whole [E, out, in] stack: as `convert()` packs the site when
    the model is prepared, else the codec on the master (NVFP4: one global scale per expert, the
    EP-invariant choice, as every expert is its own Linear on disk)."""
    if site is None:
        return pack_master(x, recipe)
    return pack_master(x, recipe, site.reduction_dim)


def _packer(model: nn.Module, wrecipe):
    """pack(param name, whole [E, out, in] stack) -> QuantizedTensor, as `convert()` packs
    the site when the model is prepared, else the codec with `wrecipe`."""
    report = prepared_report(model)
    sites = {s.name: s for s in report.converted} if report is not None else {}
    recipe = report.recipe.weight if report is not None else wrecipe

    def pack(name: str, stack: torch.Tensor):
        return _pack(stack, recipe, sites.get(name))

    return pack


def _packed_experts(model: nn.Module, recipe, packed: Mapping[str, Any] | None) -> dict[str, Any]:
    """{param name: QuantizedTensor [E_local, out, in]} for every routed-expert stack."""
    names = [f"{n}.{w}" for n, _ in _experts_modules(model) for w in _PROJ]
    if packed is None:
        if prepared_report(model) is not None:
            packed = convert(model)
        else:
            packed = {f"{n}.{w}": _pack(getattr(m, w), recipe)
                      for n, m in _experts_modules(model) for w in _PROJ}
    missing = [n for n in names if n not in packed]
    if missing:
        raise ExportError(f"packed weights lack the routed-expert stacks {missing[:4]}")
    return {n: packed[n] for n in names}


def _stack_tensors(module: str, w: str, offset: int, fmt: str, recipe, stack,
                   shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one routed-expert stack whose first expert is global `offset`:
    `stack` is the [E, out, in] master (bf16) or its QuantizedTensor (compressed-tensors)."""
    proj = _PROJ[w]
    out: dict[str, torch.Tensor] = {}
    if fmt == "bf16":
        for k in range(stack.shape[0]):
            out[f"{module}.{offset + k}.{proj}.weight"] = stack[k].to(torch.bfloat16)
        return out
    q = stack
    if q.fmt != recipe.fmt:
        raise ExportError(f"{module}.{w} is packed as {q.fmt}, the export asks for {recipe.fmt}")
    if tuple(q.shape) != tuple(shape):
        raise ExportError(f"{module}.{w}: packed logical shape {q.shape} != parameter shape "
                          f"{tuple(shape)}")
    gs = q.global_scale
    for k in range(q.shape[0]):
        base = f"{module}.{offset + k}.{proj}"
        out[f"{base}.weight_packed"] = q.data[k].contiguous()
        out[f"{base}.weight_scale"] = q.scale[k].contiguous()
        if recipe.fmt == "nvfp4":
            g = gs.float().reshape(-1)
            g = g[k] if g.numel() > 1 else g[0]
            # compressed-tensors stores the encode direction: x_q = x * gs / scale.
            out[f"{base}.weight_global_scale"] = (1.0 / g).reshape(1).contiguous()
    return out


def _stack_entries(fmt: str, recipe, out_dim: int, in_dim: int
                   ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{suffix: (dtype, shape)} of one expert projection on disk, as `_stack_tensors` writes it
    (the streamed writer checks every tensor against this)."""
    if fmt == "bf16":
        return {"weight": (torch.bfloat16, (out_dim, in_dim))}
    spec = format_spec(recipe.fmt)
    blocks = -(-in_dim // spec.block)
    scale = torch.uint8 if spec.scale == "e8m0" else torch.float8_e4m3fn
    out = {"weight_packed": (torch.uint8, (out_dim, blocks * spec.block // 2)),
           "weight_scale": (scale, (out_dim, blocks))}
    if recipe.fmt == "nvfp4":
        out["weight_global_scale"] = (torch.float32, (1,))
    return out


def _expert_tensors(model: nn.Module, fmt: str, recipe, packed) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    q_by_name = None if fmt == "bf16" else _packed_experts(model, recipe, packed)
    for n, m in _experts_modules(model):
        for w in _PROJ:
            p = getattr(m, w)
            stack = p.detach() if q_by_name is None else q_by_name[f"{n}.{w}"]
            out.update(_stack_tensors(n, w, m.expert_offset, fmt, recipe, stack, tuple(p.shape)))
    return out


def dense_dtype(name: str) -> torch.dtype:
    """What a dense tensor is stored as: BF16, except DeepSeek's e_score_correction_bias, which
    the released checkpoints store and transformers keeps in fp32 (it moves in steps far below
    BF16's resolution near its values)."""
    return torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16


def _dense_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    expert_mods = {n for n, _ in _experts_modules(model)}
    family = model.config.family
    out = {}
    for name, p in model.named_parameters():  # a tied lm_head appears once, as the embedding
        if name.rpartition(".")[0] in expert_mods:
            continue
        out[hf_name(name, family)] = p.detach().to(dense_dtype(name)).contiguous()
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


def export_model(model: nn.Module, out_dir: str | Path, *, fmt: str = "bf16",
                 recipe: str | None = None, profile: str | None = None,
                 group: dist.ProcessGroup | None = None, packed: Mapping[str, Any] | None = None,
                 scope=None, tokenizer: str | Path | None = None) -> Path:
    """Collective under EP (every rank of `group` calls it) and under FSDP (every rank of the
    world). Returns `out_dir`.

    fmt "compressed-tensors" packs the weight format of `recipe` ("mxfp4", "mxfp4+mxfp8" ->
    MXFP4 weights; "nvfp4"); `packed` may pass `workbench.qat.convert(model)`'s output, else it
    is computed (convert() when the model is prepared, the codec otherwise). A model sharded by
    `workbench.train.fsdp` (`model.layout.fsdp`) is streamed (`_write_fsdp`); `packed` is then
    refused, as it would hold shards. `tokenizer`: a folder whose tokenizer files go with the
    export (copied before the swap, so an export never lacks them)."""
    from safetensors.torch import save_file

    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"export format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    family = model.config.family
    fused = family == "gpt_oss"
    if fmt == "gpt-oss" and not fused:
        raise ExportError(f"--export gpt-oss writes gpt-oss's own layout; this model is "
                          f"{family} (use --export compressed-tensors)")
    if fused and fmt == "compressed-tensors":
        raise ExportError("gpt-oss ships in its own MXFP4 layout, which transformers and the "
                          "serving engines read (use --export gpt-oss); transformers has no "
                          "compressed-tensors path for gpt-oss's fused experts")
    layout = getattr(model, "layout", None)
    fsdp = layout is not None and layout.fsdp
    if fsdp:
        if packed is not None:
            raise ExportError("export_model(packed=...) under FSDP: the packer must see whole "
                              "experts, so the streamed export packs them itself")
        rank, world = dist.get_rank(), dist.get_world_size()
        group = None if world == 1 else dist.group.WORLD
    else:
        rank = dist.get_rank(group) if group is not None else 0
        world = dist.get_world_size(group) if group is not None else 1
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    wrecipe = arecipe = None
    if fmt == "gpt-oss":
        qr = parse_qat_recipe(recipe or "mxfp4", profile)
        wrecipe, arecipe = qr.weight, None
        if wrecipe is None or wrecipe.fmt != "mxfp4":
            raise ExportError(f"--export gpt-oss stores MXFP4 weights; recipe {recipe!r} "
                              "trains another weight format (use --export bf16)")
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

    if fused:
        if group is not None and not fsdp and dist.get_world_size(group) != dist.get_world_size():
            raise ExportError("the gpt-oss export gathers experts over the world: the EP "
                              "group must be the whole world")
        if packed is not None:
            raise ExportError("export_model(packed=...) is not taken by the gpt-oss export: it "
                              "packs each layer's experts as they reach rank 0")

    # Every step that can fail runs on every rank of `group` between agreements, so a failure on
    # one rank (a full disk, a foreign folder in the way) stops all of them, none waits forever.
    info = DistInfo(rank, world, 0, torch.device("cpu"), group, False)
    err: Exception | None = None
    if rank == 0:
        try:
            export_folder.begin(out_dir)
        except (ExportFolderError, OSError) as e:
            err = e
    agree(info, err)
    if fused:
        if fsdp:
            reshard_(model)  # a no-grad forward can leave the root gathered: read the shards
        failed: list[OSError] = []
        entries = export_gpt_oss.write(model, tmp, fmt, _packer(model, wrecipe), failed=failed)
        agree(info, failed[0] if failed else None)
    elif fsdp:
        entries, err = _write_fsdp(model, layout, tmp, fmt, wrecipe)  # rank 0 alone writes
        agree(info, err)
    else:
        tensors = _expert_tensors(model, fmt, wrecipe, packed)
        if rank == 0:
            tensors = {**_dense_tensors(model), **tensors}
        shard = f"model-{rank + 1:05d}-of-{world:05d}.safetensors"
        try:
            with writing(tmp / shard):
                save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
                fsync_path(tmp / shard)
        except OSError as e:
            err = e
        agree(info, err)
        # stored shapes travel with the names: the targets/ignore check needs to know what is a
        # matrix
        entry = (shard, {k: tuple(tensors[k].shape) for k in sorted(tensors)},
                 sum(t.numel() * t.element_size() for t in tensors.values()))
        entries = [entry]
        if group is not None:
            entries = [None] * world
            dist.all_gather_object(entries, entry, group=group)

    err = None
    if rank == 0:
        try:
            _finish(model, out_dir, tmp, entries, fmt, wrecipe, arecipe, scope, tokenizer)
        except (ExportError, ExportFolderError, OSError) as e:
            err = e
    agree(info, err)
    return out_dir


def _finish(model, out_dir: Path, tmp: Path, entries, fmt, wrecipe, arecipe, scope,
            tokenizer: str | Path | None = None) -> None:
    """Rank 0, once every shard is on disk: the tokenizer, the index and config.json, then the
    swap into place. `entries`: (shard file, {name: shape}, bytes) per shard."""
    weight_map = {k: s for s, keys, _ in entries for k in keys}
    for shard, _, _ in entries:  # save_file makes 0o600 files: others on the cluster could not
        os.chmod(tmp / shard, new_file_mode())  # read the export (nor vLLM under another user)
    shapes = {k: shape for _, keys, _ in entries for k, shape in keys.items()}
    hf_cfg = _hf_config(model)
    if fmt == "gpt-oss":
        hf_cfg["quantization_config"] = export_gpt_oss.quantization_config()
    if fmt == "compressed-tensors":
        if scope is None:
            scope = QuantScope.preset("routed-experts", str(wrecipe))
        packed_modules = {k.rpartition(".")[0] for k in weight_map if k.endswith(".weight_packed")}
        targets, ignore = ct_targets_ignore(scope, shapes, packed_modules)
        hf_cfg["quantization_config"] = ct_quantization_config(
            wrecipe.fmt, targets, ignore, None if arecipe is None else arecipe.fmt)
    index = {"metadata": {"total_size": sum(n for _, _, n in entries)},
             "weight_map": dict(sorted(weight_map.items()))}
    if tokenizer is not None:
        copy_tokenizer(tokenizer, tmp)
    for name, obj in ((INDEX_FILE, index), ("config.json", hf_cfg)):
        atomic_write_json(tmp / name, obj, indent=2, sort_keys=True)
    fsync_path(tmp)
    export_folder.swap_into_place(tmp, out_dir)


# ---------------------------------------------------------------------------------------------
# The streamed export of an FSDP model (workbench.train.fsdp): the same files as the export of
# the same weights without FSDP at the same EP size, one shard file per EP index (the dense
# tensors in the first), written by rank 0 alone. Each file's header is computed from shapes
# first (workbench.train.safetensors_stream); then every rank walks the same units in the same
# order, joining the gathers that concern it, and rank 0 writes each unit at its offset as it
# arrives. A unit is one dense parameter (`full_tensor()` over the world) or one MoE layer's
# stacks of one EP slice (`full_tensor()` over that slice's dp ranks, packed from whole experts
# by the slice's dp-rank-0 = global rank k, then sent to rank 0), so no rank holds more than one
# unit (plus the shards FSDP keeps anyway).


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class _RankZeroFile:
    """Rank 0's streamed shard: the first write that fails (a full disk) is kept, not raised,
    and later writes are skipped, so rank 0 keeps joining the gathers the other ranks are in;
    the export raises it on every rank once the walk is over."""

    def __init__(self, path: Path, plan: dict, failed: list[OSError]):
        self.path, self.failed, self.f = path, failed, None
        if failed:
            return
        try:
            with writing(path):
                self.f = StreamedFile(path, plan, {"format": "pt"})
        except OSError as e:
            failed.append(e)

    def _guard(self, fn) -> None:
        try:
            with writing(self.path):
                fn()
        except OSError as e:
            self.failed.append(e)
            self.f = None

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.f is not None:
            self._guard(lambda: self.f.write(name, t))

    def close(self) -> None:
        if self.f is not None:
            self._guard(self.f.close)


def _write_fsdp(model: nn.Module, layout, tmp: Path, fmt: str, wrecipe
                ) -> tuple[list | None, OSError | None]:
    """(rank 0: the shards' entries, else None; rank 0's first write failure, if any)."""
    reshard_(model)  # a no-grad forward can leave the root gathered: read the shards
    rank, ep = dist.get_rank(), layout.ep
    e_idx, d_idx = rank % ep, rank // ep  # Layout: rank = d * ep + e
    report = prepared_report(model)
    sites = {s.name: s for s in report.converted} if report is not None else {}
    wr = report.recipe.weight if report is not None else wrecipe
    experts = _experts_modules(model)
    expert_mods = {n for n, _ in experts}
    family = model.config.family
    dense = [(n, p) for n, p in model.named_parameters()  # a tied lm_head appears once
             if n.rpartition(".")[0] not in expert_mods]
    device = next(model.parameters()).device
    entries = []
    failed: list[OSError] = []
    for k in range(ep):
        shard = f"model-{k + 1:05d}-of-{ep:05d}.safetensors"
        units: list[tuple[str, Any, dict]] = []
        if k == 0:
            units += [("dense", (n, p), {hf_name(n, family): (dense_dtype(n), tuple(p.shape))})
                      for n, p in dense]
        for n, m in experts:
            names: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
            for w, proj in _PROJ.items():
                E, O, I = getattr(m, w).shape  # a DTensor's shape is the EP slice's [E, O, I]
                per = _stack_entries(fmt, wrecipe, O, I)
                for j in range(E):
                    for suffix, de in per.items():
                        names[f"{n}.{k * E + j}.{proj}.{suffix}"] = de
            units.append(("experts", (n, m), names))
        plan = {name: de for _, _, names in units for name, de in names.items()}
        writer = _RankZeroFile(tmp / shard, plan, failed) if rank == 0 else None
        for kind, obj, names in units:
            if kind == "dense":
                n, p = obj
                full = _full(p)  # every rank: a collective over the world
                if writer is not None:
                    writer.write(hf_name(n, family), full.detach().to(dense_dtype(n)))
                del full
                continue
            n, m = obj
            tensors = None
            if e_idx == k:  # the dp ranks of EP slice k gather it (a collective over them)
                stacks = {w: _full(getattr(m, w)).detach() for w in _PROJ}
                if d_idx == 0:
                    tensors = {}
                    for w, x in stacks.items():
                        payload = x if fmt == "bf16" else _pack(x, wr, sites.get(f"{n}.{w}"))
                        tensors.update(_stack_tensors(n, w, k * x.shape[0], fmt, wrecipe,
                                                      payload, tuple(x.shape)))
                del stacks
            if k != 0:  # global rank k (dp index 0 of slice k) sends the unit to rank 0
                order = sorted(names)
                if rank == k:
                    if set(tensors) != set(names):
                        raise ExportError(f"{n}: the packed tensors do not match the plan")
                    dist.send(torch.cat([tensors[x].reshape(-1).view(torch.uint8)
                                         for x in order]), dst=0)
                    tensors = None
                elif rank == 0:
                    sizes = [nbytes(*names[x]) for x in order]
                    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
                    dist.recv(buf, src=k)
                    tensors = {x: b.view(names[x][0]).view(names[x][1])
                               for x, b in zip(order, buf.split(sizes))}
            if writer is not None:
                for x, t in tensors.items():
                    writer.write(x, t)
            del tensors
        if writer is not None:
            writer.close()
            entries.append((shard, {x: plan[x][1] for x in sorted(plan)},
                            sum(nbytes(*de) for de in plan.values())))
    return (entries if rank == 0 else None), (failed[0] if failed else None)
