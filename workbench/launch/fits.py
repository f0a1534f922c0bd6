"""Refuse a launch that cannot fit before anything is queued (`workbench.train.plan`).

The planner reads the trainer configuration the job will get (`spec.train`), so batch, sequence
length, recipe, layout and activation checkpointing are the job's, not guesses. CPU launches
(gpus_per_node == 0) are not checked: the planner models GPU memory.
"""

from __future__ import annotations

from workbench.launch.spec import LaunchSpec, LaunchSpecError
from workbench.train.plan import Plan, PlanError, model_config_of, plan


def plan_for(spec: LaunchSpec) -> Plan | None:
    """The plan of `spec`'s run on its layout, or None for a CPU launch."""
    res = spec.resources
    if res.gpus_per_node == 0:
        return None
    cfg = spec.train
    try:
        mcfg = model_config_of(cfg.init if cfg.init else cfg.preset)
        mcfg = mcfg.replace(max_seq_len=max(cfg.seq, mcfg.max_seq_len))
        return plan(mcfg, res.nodes, res.tasks_per_node, res.gpu_mem_gib, batch=cfg.batch,
                    seq=cfg.seq, ep=spec.ep, fsdp=spec.dp, fsdp_on=cfg.fsdp,
                    act_ckpt=cfg.activation_checkpointing, qat=cfg.recipe != "bf16")
    except PlanError as e:
        raise LaunchSpecError(f"LaunchSpec: {e}") from None


def check_fits(spec: LaunchSpec) -> Plan | None:
    """Raise LaunchSpecError with the plan's numbers when the run cannot fit (unless
    `spec.skip_memory_check`)."""
    p = plan_for(spec)
    if p is not None and not p.fits and not spec.resources.skip_memory_check:
        raise LaunchSpecError(f"LaunchSpec: the run does not fit; nothing was queued "
                              f"(Resources.skip_memory_check=True overrides)\n{p}")
    return p
