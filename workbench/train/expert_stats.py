"""Per-expert quantization telemetry during QAT: `OUT/expert_stats.parquet`, one row per
record step x layer x expert x projection.

Columns (docs/expert-stats.md has the same list for readers):
    step, layer, expert (global index), proj (gate/up/down), recipe
    rel_err, sqnr_db, sat_frac, clip_frac, amax      the weight's fake quantization at `step`
                                                       (`workbench.qat.telemetry`)
    amax_drift       amax / amax at the first record - 1
    churn            share of the expert's codes that changed since the previous record (NaN at
                     the first record, and at the first record after a resume)
    load             tokens routed to the expert (all ranks, top-k copies) since the previous
                     record; the step-0 record has 0
    act_amax         max |x| of the expert's input rows since the previous record, when the
                     recipe quantizes activations (NaN otherwise); the gate/up GEMMs' input
    scale_exp_lo, scale_exp_hist   block-scale exponent histogram: counts for exponents
                     scale_exp_lo, scale_exp_lo + 1, ... (trimmed to the non-zero range)

How it is computed: statistics batched per [E, O, I] stack on the device that holds it
(rank-local under expert parallelism), loads counted by a forward hook on every router (summed
over ranks with one all-reduce), activation maxima by a forward pre-hook on every expert module;
rank 0 gathers the rows (a few numbers per expert) and rewrites the parquet file atomically.
Under FSDP (workbench.train.fsdp) a stack is a Shard(1) DTensor over the dp ranks of its EP
slice: they gather it (`full_tensor()`, one stack at a time), so the statistics (NVFP4's amax
above all) are those of whole experts, and only dp rank 0 of each slice computes and reports
its rows; the dp ranks' activation maxima (each saw its own tokens) are max-reduced first.
Summary scalars per record, logged next to the loss: `expert_worst_rel_err`,
`experts_zero_load` (this interval), `experts_dead` (zero load in each of the last
`dead_intervals` intervals), `expert_mean_churn`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from workbench._io import atomic_open
from workbench.model.experts import GroupedExperts
from workbench.model.router import TopKRouter
from workbench.qat.telemetry import (
    EXP_LO,
    PROJ_OF,
    ExpertStack,
    activation_recipe,
    code_churn,
    quantized_stacks,
    stack_stats,
)
from workbench.train.distributed import DistInfo

FILE = "expert_stats.parquet"
_ATTR = {proj: attr for attr, proj in PROJ_OF.items()}  # gate -> w1, ...


class ExpertStatsRecorder:
    """Collects loads and activation maxima every training step; `record(step)` writes a record."""

    def __init__(self, model: nn.Module, info: DistInfo, out: Path, *, dead_intervals: int = 3,
                 resume_step: int | None = None) -> None:
        self.info, self.path = info, Path(out) / FILE
        self.stacks: list[ExpertStack] = quantized_stacks(model)
        layout = getattr(model, "layout", None)
        self.fsdp = layout is not None and layout.fsdp
        # Under FSDP the dp ranks of an EP slice hold pieces of the same experts (rank = d * ep
        # + e): dp rank 0 reports them; the group max-reduces the activation maxima.
        self.reports = not self.fsdp or info.rank // layout.ep == 0
        self.dp_group = layout.dp_group if self.fsdp and layout.dp > 1 else None
        self.dead_intervals = dead_intervals
        cfg = model.config
        self.E, self.layers = cfg.num_experts, sorted({s.layer for s in self.stacks})
        device = info.device
        self.load = torch.zeros(cfg.num_layers, self.E, dtype=torch.float64, device=device)
        self.act_amax: dict[int, torch.Tensor] = {}
        self._prev_codes: dict[tuple[int, str], torch.Tensor] = {}
        self._amax0: dict[tuple[int, int, str], float] = {}
        self._zero_streak: dict[tuple[int, int], int] = {}
        self._hooks = []
        for name, mod in model.named_modules():
            if isinstance(mod, TopKRouter):
                layer = int(name.split(".")[2])
                self._hooks.append(mod.register_forward_hook(self._count_hook(layer)))
            elif isinstance(mod, GroupedExperts) and activation_recipe(mod) is not None:
                layer = int(name.split(".")[2])
                self.act_amax[layer] = torch.zeros(mod.num_experts, dtype=torch.float64,
                                                   device=device)
                self._hooks.append(mod.register_forward_pre_hook(self._act_hook(layer)))
        self.rows: list[dict] = []
        if info.is_main:
            if resume_step is not None and self.path.is_file():
                self._reload(resume_step)
            elif resume_step is None:  # a fresh run: no table of an earlier run in this folder
                self.path.unlink(missing_ok=True)

    # -- hooks (training steps only; validation runs in eval mode)
    def _count_hook(self, layer: int):
        def hook(module, args, output):
            # activation checkpointing re-runs the router inside backward (a graph task is
            # running then): counting that call too would double every load
            if module.training and torch._C._current_graph_task_id() == -1:
                idx = output[2].reshape(-1)
                self.load[layer].index_add_(0, idx, torch.ones(idx.shape, dtype=torch.float64,
                                                               device=idx.device))
        return hook

    def _act_hook(self, layer: int):
        def hook(module, args):
            if not module.training:
                return
            x_TD, offs = args[0], args[1]
            ends = offs.to(torch.int64)
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            rows = x_TD[: int(ends[-1])].detach().abs().amax(dim=1).double()
            seg = torch.segment_reduce(rows, "max", lengths=counts, unsafe=True, initial=0.0)
            torch.maximum(self.act_amax[layer], seg, out=self.act_amax[layer])
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- records
    def _reload(self, resume_step: int) -> None:
        import pandas as pd

        df = pd.read_parquet(self.path)
        df = df[df["step"] <= resume_step]
        self.rows = df.to_dict("records")
        first = df[df["step"] == df["step"].min()] if len(df) else df
        for r in first.itertuples():
            self._amax0[(r.layer, r.expert, r.proj)] = float(r.amax)

    @torch.no_grad()
    def record(self, step: int) -> dict[str, float]:
        """Compute, gather on rank 0, rewrite the parquet file; returns the summary scalars
        (on every rank: they are all-reduced)."""
        info = self.info
        load = self.load.clone()
        if info.group is not None:
            dist.all_reduce(load, group=info.group)
        for t in self.act_amax.values():
            if self.dp_group is not None:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        rows = []
        for s in self.stacks:
            w = getattr(s.module, _ATTR[s.proj])
            if isinstance(w, DTensor):
                w = w.full_tensor()  # every dp rank of the slice: a collective over them
            if not self.reports:
                continue
            st = stack_stats(w, s.recipe)
            key = (s.layer, s.proj)
            prev = self._prev_codes.get(key)
            churn = code_churn(prev, st.codes) if prev is not None else None
            self._prev_codes[key] = st.codes
            act = self.act_amax.get(s.layer)
            cols = {"rel_err": st.rel_err, "sqnr_db": st.sqnr_db, "sat_frac": st.sat_frac,
                    "clip_frac": st.clip_frac, "amax": st.amax}
            host = {k: v.tolist() for k, v in cols.items()}
            hist = st.scale_hist.tolist()
            churn_l = churn.tolist() if churn is not None else None
            act_l = act.tolist() if act is not None else None
            for e in range(st.amax.shape[0]):
                g = s.expert_offset + e
                nz = [i for i, c in enumerate(hist[e]) if c]
                lo, hi = (nz[0], nz[-1]) if nz else (0, -1)
                rows.append({"step": step, "layer": s.layer, "expert": g, "proj": s.proj,
                             "recipe": str(s.recipe), **{k: v[e] for k, v in host.items()},
                             "churn": churn_l[e] if churn_l is not None else math.nan,
                             "act_amax": act_l[e] if act_l is not None else math.nan,
                             "scale_exp_lo": lo + EXP_LO,
                             "scale_exp_hist": hist[e][lo:hi + 1]})
        if info.group is not None:
            gathered: list = [None] * info.world
            dist.all_gather_object(gathered, rows, group=info.group)
            rows = [r for part in gathered for r in part]
        load_l = load.tolist()
        for r in rows:
            r["load"] = load_l[r["layer"]][r["expert"]]
            a0 = self._amax0.setdefault((r["layer"], r["expert"], r["proj"]), r["amax"])
            r["amax_drift"] = r["amax"] / a0 - 1 if a0 > 0 else math.nan
        rows.sort(key=lambda r: (r["layer"], r["expert"], r["proj"]))
        summary = self._summary(rows, load_l, step)
        if info.is_main:
            self.rows.extend(rows)
            self._write()
        self.load.zero_()
        for t in self.act_amax.values():
            t.zero_()
        return summary

    def _summary(self, rows: list[dict], load: list[list[float]], step: int) -> dict[str, float]:
        zero = dead = 0
        if step > 0:  # the step-0 record has seen no tokens
            for layer in self.layers:
                for e in range(self.E):
                    k = (layer, e)
                    self._zero_streak[k] = self._zero_streak.get(k, 0) + 1 \
                        if load[layer][e] == 0 else 0
                    zero += load[layer][e] == 0
                    dead += self._zero_streak[k] >= self.dead_intervals
        churns = [r["churn"] for r in rows if not math.isnan(r["churn"])]
        return {"expert_worst_rel_err": max((r["rel_err"] for r in rows), default=math.nan),
                "experts_zero_load": float(zero), "experts_dead": float(dead),
                "expert_mean_churn": sum(churns) / len(churns) if churns else math.nan}

    def table(self, step: int):
        import pandas as pd

        return pd.DataFrame([r for r in self.rows if r["step"] == step])

    def _write(self) -> None:
        import pandas as pd

        with atomic_open(self.path, "wb") as f:
            pd.DataFrame(self.rows).to_parquet(f, index=False)


def read_expert_stats(run_dir: str | Path):
    """The run's `expert_stats.parquet` as a DataFrame (see the module docstring for columns)."""
    import pandas as pd

    path = Path(run_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no expert statistics (a bf16 run, or "
                                "--expert-stats-every 0)")
    return pd.read_parquet(path)
