"""The launch planner: per-rank bytes of a QAT run and the smallest layouts that fit.

    from workbench.train import plan
    p = plan(model_config, nodes=2, gpus_per_node=8, gpu_mem_gib=141, batch=64, seq=4096)
    print(p)            # per-rank table, verdict, smallest layouts that fit
    p.fits, p.memory.total

A layout is (nodes x gpus_per_node) ranks split as EP x FSDP (the trainer's `--ep N --fsdp`;
FSDP here is the expert-data-parallel degree dp = world / EP). EP-only layouts replicate the
dense parameters on every rank; layouts with FSDP shard dense parameters and optimizer state
over the world and the experts over the dp ranks (workbench.train.fsdp). Both are runnable.
`Layout.fsdp_on` marks `--fsdp` at FSDP degree 1 (EP = world, dense parameters still sharded).
Numbers come from `workbench.train.memory`, whose activation count is checked against a
measured forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workbench.arch import PRESETS, ModelConfigError, MoEConfig, from_checkpoint, preset
from workbench.source import SourceError, resolve
from workbench.train.memory import ACT_CKPT_MODES, GIB, RankMemory, param_counts, rank_memory

# What a rank needs besides the trainer's tensors: CUDA context, NCCL buffers, the allocator's
# fragmentation, all-to-all buffers and the logits of one step. A fixed share, stated.
DEFAULT_RESERVE_GIB = 8.0


class PlanError(ValueError):
    """A layout that cannot run (bad sizes, or it does not fit and the override was not given)."""


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    ep: int
    fsdp: int = 1
    fsdp_on: bool = False  # --fsdp at degree 1 (EP = world): dense parameters still sharded

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def sharded(self) -> bool:
        """FSDP2 holds this layout's parameters (workbench.train.fsdp)."""
        return self.fsdp > 1 or self.fsdp_on

    @property
    def trainable(self) -> bool:
        """Every layout the planner lists is one the trainer runs (EP-only, or EP x FSDP2)."""
        return True

    def __str__(self) -> str:
        return (f"{self.nodes}x{self.gpus_per_node} (EP{self.ep}"
                + (f" x FSDP{self.fsdp})" if self.fsdp > 1 else
                   " +FSDP)" if self.fsdp_on else ")"))


@dataclass(frozen=True)
class Plan:
    config: MoEConfig
    layout: Layout
    memory: RankMemory
    gpu_mem_gib: float
    reserve_gib: float
    batch: int
    seq: int
    act_ckpt: str
    alternatives: tuple[tuple[Layout, str, RankMemory], ...] = field(default=())

    @property
    def budget_bytes(self) -> float:
        return (self.gpu_mem_gib - self.reserve_gib) * GIB

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget_bytes

    def verdict(self) -> str:
        need = self.memory.total / GIB
        word = "fits" if self.fits else "does NOT fit"
        return (f"{self.layout}: {need:.1f} GiB per rank {word} in {self.gpu_mem_gib:g} GiB "
                f"({self.reserve_gib:g} GiB reserved for CUDA/NCCL/buffers)")

    def __str__(self) -> str:
        counts = param_counts(self.config)
        total = counts.total(self.config.num_experts)
        m = self.memory
        rows = [("parameters, bf16 compute copies", m.params_compute),
                ("masters, fp32", m.masters), ("gradients, fp32", m.grads),
                ("optimizer (AdamW m, v), fp32", m.optimizer),
                ((f"activations ({self.batch}x{self.seq} global, "
                 f"{self.batch * self.seq / self.layout.world:g} tokens/rank, "
                 f"ckpt {self.act_ckpt})"), m.activations),
                ("fake-quantized expert weights (QAT)", m.qat_copies),
                ("FSDP2 buffers (prefetch, unsharded grads, fp32 reduce)", m.fsdp_buffers),
                ("total", m.total)]
        cfg = self.config
        mtp = (f"; the checkpoint's {cfg.mtp_layers} multi-token-prediction layer(s) are not "
               "part of it" if cfg.mtp_layers else "")
        lines = [(f"model: {total / 1e9:.2f}B parameters ({counts.dense / 1e9:.2f}B dense, "
                 f"{counts.experts_total * cfg.num_experts / 1e9:.2f}B in "
                 f"{cfg.num_experts} experts x {counts.moe_layers} MoE layers)"),
                 (f"family: {cfg.family}, {cfg.attention.kind.upper()} attention, "
                  f"{cfg.router.kind} router, {cfg.experts.activation} experts{mtp}"),
                 f"activations: {m.activations_per_token / 2**10:.1f} KiB per token per rank",
                 f"{'per rank':<60} {'GiB':>9}"]
        lines += [f"{name:<60} {b / GIB:>9.2f}" for name, b in rows]
        lines.append(self.verdict())
        if self.alternatives:
            lines.append("smallest layouts that fit:")
            for layout, mode, mem in self.alternatives:
                flags = (f"--ep {layout.ep} --fsdp" if layout.sharded else "")
                lines.append(f"  {layout!s:<24} ckpt {mode:<9} {mem.total / GIB:>7.1f} GiB "
                             f"per rank  {flags}".rstrip())
        else:
            lines.append(f"no layout up to {_MAX_NODES} nodes fits (the world size must divide "
                         f"the global batch of {self.batch})")
        return "\n".join(lines)


_MAX_NODES = 512


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _memory(cfg: MoEConfig, layout: Layout, batch: int, seq: int, act_ckpt: str,
            device: str, qat: bool) -> RankMemory:
    return rank_memory(cfg, world=layout.world, ep=layout.ep, fsdp=layout.fsdp, batch=batch,
                       seq=seq, act_ckpt=act_ckpt, device=device, qat=qat,
                       sharded=layout.sharded)


def smallest_layouts(cfg: MoEConfig, *, gpus_per_node: int, gpu_mem_gib: float, batch: int,
                     seq: int, act_ckpt: str = "off", device: str = "cuda", qat: bool = True,
                     reserve_gib: float = DEFAULT_RESERVE_GIB
                     ) -> list[tuple[Layout, str, RankMemory]]:
    """For EP-only and for EP x FSDP (both runnable): the fewest nodes that fit, with the
    lightest activation checkpointing (from `act_ckpt` on) that makes them fit, and at that node
    count the split with the least memory per rank. The world size must divide `batch` (each
    rank trains whole sequences; the trainer has no gradient accumulation)."""
    budget = (gpu_mem_gib - reserve_gib) * GIB
    modes = ACT_CKPT_MODES[ACT_CKPT_MODES.index(act_ckpt):]
    found: list[tuple[Layout, str, RankMemory]] = []
    for with_fsdp in (False, True):
        for nodes in range(1, _MAX_NODES + 1):
            world = nodes * gpus_per_node
            if batch % world:
                continue
            best = None
            for mode in modes:
                for ep in _divisors(world):
                    fsdp = world // ep
                    if cfg.num_experts % ep or (fsdp > 1) != with_fsdp:
                        continue
                    layout = Layout(nodes, gpus_per_node, ep, fsdp)
                    mem = _memory(cfg, layout, batch, seq, mode, device, qat)
                    if mem.total <= budget and (best is None or mem.total < best[2].total):
                        best = (layout, mode, mem)
                if best is not None:
                    break
            if best is not None:
                found.append(best)
                break
    return found


def plan(model_config: MoEConfig, nodes: int, gpus_per_node: int, gpu_mem_gib: float, *,
         batch: int, seq: int, ep: int | None = None, fsdp: int = 1, act_ckpt: str = "off",
         device: str = "cuda", qat: bool = True, reserve_gib: float = DEFAULT_RESERVE_GIB,
         fsdp_on: bool = False) -> Plan:
    """Per-rank bytes of training `model_config` on nodes x gpus_per_node ranks (EP = world /
    fsdp unless given), plus the smallest layouts that fit `gpu_mem_gib` per GPU. `qat`: the
    routed experts are fake-quantized (a BF16 baseline run has `qat=False`). `fsdp_on`: the run
    uses --fsdp at FSDP degree 1 (the trainer at EP = world with --fsdp, or world 1)."""
    for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("batch", batch),
                    ("seq", seq), ("fsdp", fsdp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"plan: {name} must be a positive int, got {v!r}")
    if not gpu_mem_gib > reserve_gib:
        raise PlanError(f"plan: gpu_mem_gib ({gpu_mem_gib}) must exceed the reserve "
                        f"({reserve_gib} GiB)")
    if act_ckpt not in ACT_CKPT_MODES:
        raise PlanError(f"plan: activation checkpointing {act_ckpt!r} is not one of "
                        f"{ACT_CKPT_MODES}")
    world = nodes * gpus_per_node
    ep = world // fsdp if ep is None else ep
    if ep * fsdp != world:
        raise PlanError(f"plan: EP{ep} x FSDP{fsdp} = {ep * fsdp} ranks, but the layout has "
                        f"{nodes} x {gpus_per_node} = {world}")
    if model_config.num_experts % ep:
        raise PlanError(f"plan: {model_config.num_experts} experts do not split over EP{ep}")
    layout = Layout(nodes, gpus_per_node, ep, fsdp, fsdp_on=bool(fsdp_on) and fsdp == 1)
    mem = _memory(model_config, layout, batch, seq, act_ckpt, device, qat)
    alts = smallest_layouts(model_config, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib,
                            batch=batch, seq=seq, act_ckpt=act_ckpt, device=device, qat=qat,
                            reserve_gib=reserve_gib)
    return Plan(model_config, layout, mem, gpu_mem_gib, reserve_gib, batch, seq, act_ckpt,
                tuple(alts))


def model_config_of(source: str) -> MoEConfig:
    """A model preset name, or a checkpoint (folder or hub id ``org/name[@revision]``,
    `workbench.source.resolve`) whose config.json describes a supported family
    (`workbench.arch.from_checkpoint`)."""
    if source in PRESETS:
        return preset(source)
    try:
        src = resolve(source, need="config")
    except SourceError as e:
        raise PlanError(str(e)) from None
    folder = Path(src.path if src.path is not None else source)
    if not (folder / "config.json").is_file():
        raise PlanError(f"{source}: neither a model preset ({', '.join(sorted(PRESETS))}) nor a "
                        "folder with config.json")
    try:
        return from_checkpoint(folder)
    except ModelConfigError as e:
        raise PlanError(str(e)) from None
