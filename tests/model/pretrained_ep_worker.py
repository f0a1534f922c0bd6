"""torchrun worker for test_pretrained_ep.py: `from_pretrained` at EP = world; each rank reports
what it read and computed.

Usage: torchrun --nproc-per-node 2 pretrained_ep_worker.py CKPT REPORT"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from workbench.checkpoint import open_checkpoint
from workbench.model import from_pretrained, load_pretrained_
from workbench.model.pretrained import materialize
from workbench.model.transformer import MoEForCausalLM


def main() -> None:
    path, report = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = open_checkpoint(path)
    model = from_pretrained(ck, ep_group=dist.group.WORLD)
    x = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x).logits
    fresh = materialize(MoEForCausalLM(model.config, ep_group=dist.group.WORLD, device="meta"),
                        torch.device("cpu"))
    stats = load_pretrained_(fresh, path)
    experts = [(n, m.expert_offset, m.num_experts) for n, m in model.named_modules()
               if type(m).__name__ == "GroupedExperts"]
    torch.save({"logits": logits, "w1": {n: model.get_submodule(n).w1.detach() for n, *_ in experts}},
               f"{report}.{rank}.pt")
    with open(f"{report}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "bytes_read": stats["bytes_read"],
                   "experts": [[o, k] for _, o, k in experts]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
