"""Which rounding switches of the fused AdamW kernels (workbench/kernels/_adamw_kernel.py) give
torch's CUDA bits. First the last-op kernel's CONTRACT against torch's CUDA addcdiv: K steps of
torch.optim.AdamW(foreach=False) against
workbench.train.optim.AdamW on the fused path, both CONTRACT values, bf16 and fp32 expert stacks
(values near overflow and underflow, an all-zero expert, a NaN and an inf in the gradients).

    python jobs/gpu/adamw_bits.py [--steps 5] [--experts 6] [--rows 256] [--cols 512]

One line per (dtype, CONTRACT): differing elements of params / exp_avg / exp_avg_sq (NaN equal
to NaN; NaN payloads counted apart), and whether every seeded amax equals
``p.abs().amax(dim=(-2, -1), keepdim=True).float()`` bitwise, NaN payload included. Keep the
CONTRACT whose lines read params 0 for both dtypes (exp_avg / exp_avg_sq are torch's ops on both
paths and must read 0 everywhere); a line names it, or says neither matched. Then the whole-step
kernel (fp32): every combination of its four switches (LERP_FMA, ADDCMUL_FMA, DIV_RECIP,
CONTRACT in workbench/kernels/adamw.py), one line each, and whether the module's defaults are a
combination that gave torch's bits. Exit 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's workbench

from workbench.qat import QATState  # noqa: E402
from workbench.train.optim import AdamW  # noqa: E402


def _stack(dtype, e, o, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, o, i, generator=g) * torch.logspace(-4, 4, e)[:, None, None]
    w[1] = 0  # an all-zero expert (its gradients are zero too)
    big = torch.finfo(dtype).max / 4
    w[2, 0, :8] = big * torch.linspace(-1, 1, 8)  # near overflow
    w[2, 1, :8] = torch.finfo(dtype).tiny * torch.arange(8)  # near underflow (and subnormals)
    return w.to(dtype)


def _grad(dtype, shape, step):
    g = torch.Generator().manual_seed(100 + step)
    gr = torch.randn(shape, generator=g) * 10.0 ** (step % 5 - 2)
    gr[1] = 0
    gr[2, 1, :8] *= 1e-30  # tiny gradients on the tiny weights
    gr[3, 2, 3] = float("nan")
    if step == 1:
        gr[4, 5, 6] = float("inf")
    return gr.to(dtype).cuda()


def _diff(a, b):
    """(elements that differ, NaN equal to NaN; NaN with another payload)."""
    ia = a.view(torch.int32 if a.element_size() == 4 else torch.int16)
    ib = b.view(torch.int32 if b.element_size() == 4 else torch.int16)
    both_nan = a.isnan() & b.isnan()
    return int(((ia != ib) & ~both_nan).sum()), int(((ia != ib) & both_nan).sum())


def run(dtype, contract, args):
    shape = (args.experts, args.rows, args.cols)
    w = nn.Parameter(_stack(dtype, *shape).cuda())
    ref_w = nn.Parameter(_stack(dtype, *shape).cuda())
    # the trainer's wiring: the amax book wants w's per-expert amax, the optimizer's sink fills it
    holder = nn.Module()
    holder.w = w
    state = QATState()
    state.want("w")
    # whole_step=False: the last-op kernel for fp32 too (the whole step has its own sweep)
    ours = AdamW([w], lr=1e-2, weight_decay=0.1, foreach=False, contract=contract,
                 whole_step=False, amax_sink=state.optimizer_sink(holder))
    ref = torch.optim.AdamW([ref_w], lr=1e-2, weight_decay=0.1, foreach=False)
    p = m = v = nanp = 0
    amax_ok = True
    for step in range(args.steps):
        w.grad, ref_w.grad = _grad(dtype, shape, step), _grad(dtype, shape, step)
        ours.step()
        ref.step()
        d, n = _diff(w.detach(), ref_w.detach())
        p, nanp = p + d, nanp + n
        m += sum(_diff(ours.state[w]["exp_avg"], ref.state[ref_w]["exp_avg"]))
        v += sum(_diff(ours.state[w]["exp_avg_sq"], ref.state[ref_w]["exp_avg_sq"]))
        seeded = state.amax("w", w)  # None unless the fused path wrote it for these values
        want = w.detach().abs().amax(dim=(-2, -1), keepdim=True).float()
        amax_ok &= seeded is not None and torch.equal(seeded.view(torch.int32),
                                                      want.view(torch.int32))
        # the runs go on from torch's params, so each step's count is that step's rounding
        with torch.no_grad():
            w.copy_(ref_w)
    torch.cuda.synchronize()
    print(f"{str(dtype):15s} CONTRACT={contract!s:5s}  params {p:7d} (NaN payloads {nanp})  "
          f"exp_avg {m}  exp_avg_sq {v}  seeded amax exact: {amax_ok}", flush=True)
    return p == 0 and m == 0 and v == 0, amax_ok


SWITCHES = ("lerp_fma", "addcmul_fma", "div_recip", "contract")


def run_whole(switches: dict, args) -> tuple[int, int, int]:
    """``kernels.adamw_step_`` with these rounding switches against torch.optim.AdamW
    (foreach=False) on an fp32 stack: differing params / exp_avg / exp_avg_sq over the steps,
    each step started from torch's state (so each count is one step's rounding)."""
    from workbench import kernels

    shape = (args.experts, args.rows, args.cols)
    ref_w = nn.Parameter(_stack(torch.float32, *shape).cuda())
    ref = torch.optim.AdamW([ref_w], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1,
                            foreach=False)
    p_d = m_d = v_d = 0
    for step in range(args.steps):
        ref_w.grad = _grad(torch.float32, shape, step)
        st = ref.state.get(ref_w, {})
        p = ref_w.detach().clone()
        m = st["exp_avg"].clone() if st else torch.zeros_like(p)
        v = st["exp_avg_sq"].clone() if st else torch.zeros_like(p)
        n = (st["step"].item() if st else 0) + 1
        kernels.adamw_step_(p, ref_w.grad, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.1, step=n, amax=True, **switches)
        ref.step()
        p_d += sum(_diff(p, ref_w.detach()))
        m_d += sum(_diff(m, ref.state[ref_w]["exp_avg"]))
        v_d += sum(_diff(v, ref.state[ref_w]["exp_avg_sq"]))
    torch.cuda.synchronize()
    return p_d, m_d, v_d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--experts", type=int, default=6)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=512)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (this script decides a GPU question)")
        return 0
    import triton

    print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
          torch.cuda.get_device_name(0), flush=True)
    matches = {}
    for contract in (True, False):
        ok = [run(dtype, contract, args) for dtype in (torch.bfloat16, torch.float32)]
        matches[contract] = all(a for a, _ in ok), all(b for _, b in ok)
    keep = [c for c, (bits, _) in matches.items() if bits]
    print("keep CONTRACT=" + "/".join(map(str, keep)) if keep else
          "neither CONTRACT matches torch bit for bit", "; seeded amax exact:",
          {c: b for c, (_, b) in matches.items()})
    # the whole-step kernel (fp32 masters): every combination of its rounding switches
    import itertools

    from workbench.kernels import adamw as kadamw

    print("\nwhole step (kernels.adamw_step_, fp32): differing params / exp_avg / exp_avg_sq")
    good = []
    for combo in itertools.product((True, False), repeat=len(SWITCHES)):
        sw = dict(zip(SWITCHES, combo))
        p, m, v = run_whole(sw, args)
        flag = "  <- torch's bits" if p == m == v == 0 else ""
        print("  " + " ".join(f"{k}={val!s:5s}" for k, val in sw.items())
              + f"  params {p:7d}  exp_avg {m:7d}  exp_avg_sq {v:7d}{flag}", flush=True)
        if p == m == v == 0:
            good.append(sw)
    default = {k: getattr(kadamw, k.upper()) for k in SWITCHES}
    print("whole step matches torch with:", good or "no combination",
          "; the module's defaults", default, "match" if default in good else "DO NOT match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
