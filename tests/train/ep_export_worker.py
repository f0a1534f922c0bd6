"""Under torchrun: EP-sharded packed export, and --init from a packed checkpoint (local experts)."""

import json
import sys

import torch
import torch.distributed as dist

from workbench.checkpoint import open_checkpoint
from workbench.model import GroupedExperts, MoEForCausalLM, tiny
from workbench.qat import prepare
from workbench.train import distributed
from workbench.train.export import export_model
from workbench.train.init import load_init

out_dir, init_path, report = sys.argv[1], sys.argv[2], sys.argv[3]
info = distributed.setup()
model = MoEForCausalLM(tiny(), seed=0, ep_group=info.group)
prepare(model, recipe="mxfp4", scope="routed-experts")
export_model(model, out_dir, fmt="compressed-tensors", recipe="mxfp4", group=info.group)

fresh = MoEForCausalLM(tiny(), seed=7, ep_group=info.group)
stats = load_init(init_path, fresh, info)
ck = open_checkpoint(init_path)
ok = True
for name, mod in fresh.named_modules():
    if isinstance(mod, GroupedExperts):
        layer = int(name.split(".")[2])
        for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            want = ck.stacked_experts(layer, proj)[mod.expert_offset:mod.expert_offset +
                                                   mod.num_experts].float()
            ok &= torch.equal(getattr(mod, w).detach(), want)
dense_ok = torch.equal(fresh.model.embed_tokens.weight.detach(),
                       ck.tensor("model.embed_tokens.weight")[:].float())
with open(f"{report}.{info.rank}.json", "w") as f:
    json.dump({"rank": info.rank, "bytes_read": stats["bytes_read"], "experts_equal": bool(ok),
               "dense_equal": bool(dense_ok),
               "local_experts": [m.expert_offset for m in fresh.modules()
                                 if isinstance(m, GroupedExperts)]}, f)
dist.barrier()
distributed.teardown(info)
distributed.exit_process(0)  # as the trainer's entry points end (see its docstring)
