"""torchrun worker for test_fsdp.py: fake-quantized expert weights under FSDP vs unsharded.

At EP1 x FSDP over the world, each expert stack is split on dim 1 between the ranks; the
fake quantization must still see whole experts (NVFP4: one amax per expert). Every weight that
`workbench.qat`'s grouped GEMM quantizes is recorded in a forward of the FSDP model and of an
unsharded model built from the same seed; they must be equal. As a check that the comparison
can fail, each rank also quantizes its own FSDP shard alone and reports whether that differs
from the matching slice of the whole-expert result (it must, on some rank).

Usage: torchrun --nproc-per-node 2 fsdp_fq_worker.py OUT_JSON RECIPE
"""

from __future__ import annotations

import json
import sys

import torch

import workbench.qat.grouped as qat_grouped
from workbench.model import MoEForCausalLM
from workbench.train import distributed
from workbench.train.build import build, model_config, prepare_qat
from workbench.train.config import tiny
from workbench.train.fsdp import EXPERT_DIM


def _recording(records: list[torch.Tensor], real):
    def rec(x, recipe, **kw):
        y = real(x, recipe, **kw)
        if kw.get("per_leading"):  # the weight stacks (activations have no per_leading)
            records.append(y.detach().clone())
        return y

    return rec


def main() -> None:
    out_json, recipe = sys.argv[1], sys.argv[2]
    info = distributed.setup()
    cfg = tiny("/nonexistent-not-written", recipe=recipe, fsdp=True, ep=1, batch=4, seq=16)
    tok = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    real = qat_grouped.fake_quant_ste
    try:
        fsdp_q: list[torch.Tensor] = []
        b = build(cfg, info)
        qat_grouped.fake_quant_ste = _recording(fsdp_q, real)
        with torch.no_grad():
            b.model(tok)
        ref_q: list[torch.Tensor] = []
        ref = MoEForCausalLM(model_config(cfg), seed=cfg.seed, dtype=torch.float32)
        prepare_qat(ref, cfg)
        qat_grouped.fake_quant_ste = _recording(ref_q, real)
        with torch.no_grad():
            ref(tok)
    finally:
        qat_grouped.fake_quant_ste = real
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
        q_whole = real(whole[n].detach(), w_recipe, per_leading=True)
        q_shard = real(local.detach(), w_recipe, per_leading=True)
        if not torch.equal(q_shard, q_whole.narrow(EXPERT_DIM, start, size)):
            shard_differs = True
    res = {"rank": info.rank, "equal": equal, "n": len(fsdp_q), "shard_differs": shard_differs,
           "placements": [str(params[n].placements) for n in names[:1]]}
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
