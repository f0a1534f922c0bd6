"""The README's demo: the main job on the embedded default.

Quantizes a generated set of MoE expert weights (heavy tails, outlier channels, one badly
conditioned expert) with every format's default profile and prints a per-format error table.
"""

from __future__ import annotations

import torch

from workbench.formats import FORMATS, fake_quantize


def expert_weights(n_experts: int = 8, out_f: int = 256, in_f: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Student-t-like tails: Gaussian divided by a random scale per element.
    w = torch.randn(n_experts, out_f, in_f, generator=g)
    w = w / torch.rand(n_experts, out_f, in_f, generator=g).clamp_min(0.05).sqrt()
    cols = torch.randint(0, in_f, (n_experts, 4), generator=g)
    for e in range(n_experts):
        w[e, :, cols[e]] *= 8.0  # outlier input channels
    w[-1] *= torch.logspace(-3, 1, in_f)  # a badly conditioned expert
    return (w * 0.02).to(torch.bfloat16)


def main() -> None:
    w = expert_weights()
    ref = w.float()
    print(f"expert stack {tuple(w.shape)} bf16")
    print(f"{'format':<14}{'profile':<12}{'rel_err':>10}{'sqnr_db':>10}{'max_abs_err':>14}")
    for name, spec in FORMATS.items():
        deq = fake_quantize(w, name).float()
        err = deq - ref
        rel = (err.norm() / ref.norm()).item()
        sqnr = (20 * torch.log10(ref.norm() / err.norm())).item()
        print(f"{name:<14}{spec.default_profile:<12}{rel:>10.4f}{sqnr:>10.2f}{err.abs().max().item():>14.3e}")


if __name__ == "__main__":
    main()
