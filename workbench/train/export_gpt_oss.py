"""gpt-oss exports: its fused expert layout, in BF16 or in the native MXFP4 it ships in.

Per MoE layer, with P = `model.layers.{L}.mlp.experts`, E experts, F expert FFN, D hidden
(what transformers' `GptOssExperts` holds and `Mxfp4Config` reads):

| fmt | tensors |
|---|---|
| "bf16" | `P.gate_up_proj` [E, D, 2F] (gate and up columns interleaved), `P.down_proj` [E, F, D] |
| "gpt-oss" | `P.gate_up_proj_blocks` uint8 [E, 2F, D/32, 16] and `P.gate_up_proj_scales` uint8 E8M0 [E, 2F, D/32] (gate and up rows interleaved), `P.down_proj_blocks` [E, D, F/32, 16], `P.down_proj_scales` [E, D, F/32] |
| both | `P.gate_up_proj_bias` BF16 [E, 2F] (interleaved), `P.down_proj_bias` BF16 [E, D] |

An MXFP4 block holds 32 consecutive elements of a row along the reduction dim, two E2M1 codes a
byte, element 2i in the low nibble (the OCP MX packing gpt-oss uses); each expert projection is
packed exactly as `workbench.qat.convert` packs it, so the export decodes to the weights the run
fake-quantized. `config.json` carries `quantization_config = {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}` as the released gpt-oss checkpoints do: attention, router,
embeddings and head stay BF16.

A fused tensor holds every expert, so the EP slices meet on rank 0, one MoE layer at a time
(point to point, the owner of EP slice k being global rank k: the layout puts dp index 0 of
slice k there); under FSDP each slice is first gathered over its dp ranks. Rank 0 writes the
dense tensors to the first shard and each MoE layer to a shard of its own, so no rank holds more
than one layer of experts.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from workbench._io import fsync_path, writing
from workbench.model.experts import GroupedExperts
from workbench.model.hf import hf_name

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                 "model.embed_tokens", "lm_head"]
FORMATS = ("bf16", "gpt-oss")


def quantization_config() -> dict:
    """The `quantization_config` of the released gpt-oss checkpoints."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(NOT_CONVERTED)}


def _interleave(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """a and b [.., N, ..] -> [.., 2N, ..] with a at the even and b at the odd indices of dim."""
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)


def layer_tensors(prefix: str, stacks: dict[str, torch.Tensor], fmt: str, pack) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one MoE layer's experts (any contiguous range of them): `stacks`
    holds our w1, w3, w2 [E, out, in] and b1, b3, b2; `pack(name, stack)` -> its
    QuantizedTensor (fmt "gpt-oss")."""
    out = {f"{prefix}.gate_up_proj_bias": _interleave(stacks["b1"], stacks["b3"], 1),
           f"{prefix}.down_proj_bias": stacks["b2"]}
    if fmt == "bf16":
        out[f"{prefix}.gate_up_proj"] = _interleave(stacks["w1"], stacks["w3"], 1).transpose(1, 2)
        out[f"{prefix}.down_proj"] = stacks["w2"].transpose(1, 2)
    else:
        q1, q3, q2 = (pack(w, stacks[w]) for w in ("w1", "w3", "w2"))
        for q in (q1, q3, q2):
            if q.fmt != "mxfp4":
                raise ValueError(f"the gpt-oss layout stores MXFP4, the recipe packs {q.fmt}")
        E, F, D = stacks["w1"].shape
        out[f"{prefix}.gate_up_proj_blocks"] = _interleave(q1.data, q3.data, 1).reshape(
            E, 2 * F, D // 32, 16)
        out[f"{prefix}.gate_up_proj_scales"] = _interleave(_scale_bytes(q1.scale),
                                                           _scale_bytes(q3.scale), 1)
        out[f"{prefix}.down_proj_blocks"] = q2.data.reshape(E, D, F // 32, 16)
        out[f"{prefix}.down_proj_scales"] = _scale_bytes(q2.scale)
    dtype_of = {"_blocks": torch.uint8, "_scales": torch.uint8}
    return {k: v.to(next((d for s, d in dtype_of.items() if k.endswith(s)), torch.bfloat16))
            .contiguous() for k, v in out.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _send_recv(tensors: dict[str, torch.Tensor] | None, src: int, like: dict[str, tuple]
               ) -> dict[str, torch.Tensor] | None:
    """Move `tensors` (on rank `src`) to rank 0 as one byte buffer; `like`: {name: (dtype,
    shape)} known on every rank. Returns them on rank 0, None elsewhere."""
    rank = dist.get_rank()
    order = sorted(like)
    sizes = [torch.empty(like[n][1], dtype=like[n][0], device="meta").nbytes for n in order]
    if rank == src:
        dist.send(torch.cat([tensors[n].reshape(-1).view(torch.uint8) for n in order]), dst=0)
        return None
    if rank == 0:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.recv(buf, src=src)
        return {n: b.view(like[n][0]).view(like[n][1]) for n, b in zip(order, buf.split(sizes))}
    return None


def write(model: nn.Module, tmp: Path, fmt: str, pack, *, failed: list[OSError] | None = None
          ) -> list[tuple[str, dict, int]] | None:
    """Write the export's shards into `tmp` (rank 0); collective over the world when
    distributed. Returns rank 0's (shard, {name: shape}, bytes) entries, None elsewhere.
    `failed`: rank 0's first failed write (a full disk) is appended there instead of raised and
    later writes are skipped, so rank 0 keeps joining the other ranks' sends; the caller raises
    it on every rank once the walk is over."""
    if fmt not in FORMATS:
        raise ValueError(f"gpt-oss export format must be one of {FORMATS}, got {fmt!r}")
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    layout = getattr(model, "layout", None)
    ep = layout.ep if layout is not None else (dist.get_world_size() if distributed else 1)
    family = model.config.family
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]
    expert_mods = {n for n, _ in experts}
    units = 1 + len(experts)
    entries = []

    def save(index: int, tensors: dict[str, torch.Tensor]) -> None:
        shard = f"model-{index + 1:05d}-of-{units:05d}.safetensors"
        if failed:
            return
        try:
            with writing(tmp / shard):
                save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
                fsync_path(tmp / shard)
        except OSError as e:
            if failed is None:
                raise
            failed.append(e)
            return
        entries.append((shard, {k: tuple(v.shape) for k, v in sorted(tensors.items())},
                        sum(v.numel() * v.element_size() for v in tensors.values())))

    dense: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # a tied lm_head appears once
        if name.rpartition(".")[0] in expert_mods:
            continue
        full = _full(p.detach())  # under FSDP a collective over the world
        if rank == 0:
            dense[hf_name(name, family)] = full.to(torch.bfloat16).cpu().contiguous()
    if rank == 0:
        save(0, dense)
    del dense
    for i, (prefix, mod) in enumerate(experts):
        names = mod.expert_params()
        local = {w: _full(getattr(mod, w).detach()) for w in names}  # FSDP: gather over dp
        owner = layout is None or not layout.fsdp or rank // ep == 0
        mine = layer_tensors(prefix, local, fmt, functools.partial(_pack_in, pack, prefix)) \
            if owner else None
        parts = [mine] if rank == 0 else []
        if distributed:
            like = _shapes(prefix, tuple(local["w1"].shape), fmt)
            for k in range(1, ep):
                got = _send_recv(mine if rank == k else None, k, like)
                if got is not None:
                    parts.append(got)
        del local
        if rank == 0:
            save(i + 1, {n: torch.cat([p[n].cpu() for p in parts]) for n in parts[0]})
        del parts, mine
    return entries if rank == 0 else None


def _pack_in(pack, prefix: str, w: str, stack: torch.Tensor):
    return pack(f"{prefix}.{w}", stack)


def _shapes(prefix: str, w1_shape: tuple[int, int, int], fmt: str
            ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{name: (dtype, shape)} of what `layer_tensors` returns for experts whose w1 is
    `w1_shape` [E, F, D]."""
    E, F, D = w1_shape
    out = {f"{prefix}.gate_up_proj_bias": (torch.bfloat16, (E, 2 * F)),
           f"{prefix}.down_proj_bias": (torch.bfloat16, (E, D))}
    if fmt == "bf16":
        out[f"{prefix}.gate_up_proj"] = (torch.bfloat16, (E, D, 2 * F))
        out[f"{prefix}.down_proj"] = (torch.bfloat16, (E, F, D))
    else:
        out[f"{prefix}.gate_up_proj_blocks"] = (torch.uint8, (E, 2 * F, D // 32, 16))
        out[f"{prefix}.gate_up_proj_scales"] = (torch.uint8, (E, 2 * F, D // 32))
        out[f"{prefix}.down_proj_blocks"] = (torch.uint8, (E, D, F // 32, 16))
        out[f"{prefix}.down_proj_scales"] = (torch.uint8, (E, D, F // 32))
    return out
