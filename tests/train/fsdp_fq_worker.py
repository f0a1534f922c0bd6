"""torchrun worker for test_fsdp.py: fake-quantized expert weights under FSDP vs unsharded.

At EP1 x FSDP over the world, each expert stack is split on dim 1 between the ranks; the
fake quantization must still see whole experts (NVFP4: one amax per expert). Every weight that
`workbench.qat`'s expert seam quantizes is recorded (through qat's public fake-quant hook) in a
forward of the FSDP model and of an unsharded model built from the same seed; they must be
equal. As a check that the comparison can fail, each rank also quantizes its own FSDP shard
alone and reports whether that differs from the matching slice of the whole-expert result (it
must, on some rank). It also reports whether FSDP left the experts' QAT seams as prepare made
them (the same objects, the same attributes): the seam finds its weights by role, so
`train.fsdp` has nothing to re-bind.

Usage: torchrun --nproc-per-node 2 fsdp_fq_worker.py OUT_JSON RECIPE
"""

from __future__ import annotations

import json
import sys

import torch

import workbench.train.build as build_mod
from workbench.model import MoEForCausalLM
from workbench.model.experts import GroupedExperts
from workbench.qat import QATExpertGemms, fake_quant_reference, register_fake_quant_hook
from workbench.train import distributed
from workbench.train.build import build, model_config, prepare_qat
from workbench.train.config import tiny
from workbench.train.fsdp import EXPERT_DIM


def _recording(records: list[torch.Tensor]):
    def hook(call, x):
        y = call()
        if x.dim() == 3:  # the weight stacks (activations are [T, D])
            records.append(y.detach().clone())
        return y

    return hook


def _seams(model) -> dict[str, tuple[object, dict]]:
    return {n: (m.gemms, dict(vars(m.gemms))) for n, m in model.named_modules()
            if isinstance(m, GroupedExperts)}


def main() -> None:
    out_json, recipe = sys.argv[1], sys.argv[2]
    info = distributed.setup()
    cfg = tiny("/nonexistent-not-written", recipe=recipe, fsdp=True, ep=1, batch=4, seq=16)
    tok = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    before: dict = {}
    real_fsdp = build_mod.apply_fsdp

    def snapshot_then_shard(model, *a, **kw):  # the seams as prepare left them
        before.update(_seams(model))
        return real_fsdp(model, *a, **kw)

    build_mod.apply_fsdp = snapshot_then_shard
    try:
        b = build(cfg, info)
    finally:
        build_mod.apply_fsdp = real_fsdp
    after = _seams(b.model)
    seams_untouched = len(before) == 2 and before.keys() == after.keys() and all(
        isinstance(after[n][0], QATExpertGemms) and after[n][0] is before[n][0]
        and after[n][1] == before[n][1] for n in before)
    fsdp_q: list[torch.Tensor] = []
    handle = register_fake_quant_hook(_recording(fsdp_q))
    try:
        with torch.no_grad():
            b.model(tok)
    finally:
        handle.remove()
    ref_q: list[torch.Tensor] = []
    ref = MoEForCausalLM(model_config(cfg), seed=cfg.seed, dtype=torch.float32)
    prepare_qat(ref, cfg)
    handle = register_fake_quant_hook(_recording(ref_q))
    try:
        with torch.no_grad():
            ref(tok)
    finally:
        handle.remove()
    equal = len(fsdp_q) == len(ref_q) > 0 and all(
        a.shape == r.shape and torch.equal(a, r) for a, r in zip(fsdp_q, ref_q))
    # The mutation the test guards against: quantizing a shard on its own.
    shard_differs = False
    from workbench.formats import parse_recipe
    from workbench.recipe import parse_qat_recipe
    w_recipe = parse_recipe(str(parse_qat_recipe(recipe).weight))
    names = [n for n, _ in b.model.named_parameters() if n.endswith((".w1", ".w3", ".w2"))]
    params = dict(b.model.named_parameters())
    whole = {n: dict(ref.named_parameters())[n] for n in names}
    for n in names:
        local = params[n].to_local()
        size = local.shape[EXPERT_DIM]
        start = info.rank * -(-whole[n].shape[EXPERT_DIM] // info.world)
        q_whole = fake_quant_reference(whole[n].detach(), w_recipe, per_leading=True)
        q_shard = fake_quant_reference(local.detach(), w_recipe, per_leading=True)
        if not torch.equal(q_shard, q_whole.narrow(EXPERT_DIM, start, size)):
            shard_differs = True
    res = {"rank": info.rank, "equal": equal, "n": len(fsdp_q), "shard_differs": shard_differs,
           "placements": [str(params[n].placements) for n in names[:1]],
           "seams_untouched": seams_untouched}
    all_res: list = [None] * info.world
    torch.distributed.all_gather_object(all_res, res)
    if info.rank == 0:
        with open(out_json, "w") as f:
            json.dump(all_res, f)
    distributed.teardown(info)


if __name__ == "__main__":
    main()
    # FSDP leaves gloo threads alive past teardown; a normal interpreter exit can then abort
    # (exit -6) after a run that passed. exit_process is what the trainer's entry points use.
    distributed.exit_process(0)
