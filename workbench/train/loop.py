"""The training loop: AdamW + warmup/cosine, global gradient clipping, validation, metrics, DCP.

Legend: B global batch, b = B/W per-rank batch, S predicted tokens per sequence, W world size.

Under expert parallelism (EP size = world size, see `workbench.train.distributed`) every rank runs
this same code on its slice of the global batch; `workbench.model.sync_gradients` turns the
gradients into those of the mean of the ranks' losses, i.e. of the EP1 loss on the whole batch.
Under FSDP (`workbench.train.fsdp`) the backward's reduce-scatters do it instead.

Metrics: `loss` is the language-model cross-entropy, averaged over the global batch; the objective
that is optimised adds `aux_loss_coef * aux_loss` (the load-balancing loss, logged as `aux_loss`).
`peak_mem_gib` is the CUDA allocator peak on GPU and the process's peak RSS on CPU, the max over
ranks. `fake_quant_share` is the fraction of the step's time spent in the forward fake
quantization (`workbench.train.fqtime`: wall time on CPU, CUDA events on GPU, no added
synchronisation), averaged over ranks; 0 for bf16, absent if the hook is unavailable.

Non-finite steps: a step whose objective or global gradient norm is NaN/Inf (on any rank: the
flag is all-reduced, so every rank decides alike) never reaches the optimizer. By default the run
stops there (`NonFiniteStep`: the step, the values and the last good checkpoint; the CLI exits
2, nothing is exported); with `skip_nonfinite_steps` N it skips up to N such steps (no optimizer
or LR step, the next step trains on the next batch), counted as `skipped_steps` in metrics.

Preemption seam: `request_stop()` only sets a flag (safe inside a signal handler). At every step
boundary the ranks all-reduce it; if any rank asked, all ranks write a DCP checkpoint and
`train` returns with `stopped=True`. Nothing else in the loop is interrupted mid-step.

Rank 0's own writes (metrics.jsonl, data.json, result.json) that fail (a full disk) do not raise
on the spot, where the other ranks would wait for rank 0 in their next collective: the failure
rides on the same step-boundary all-reduce (or an agreement after the write) and every rank
stops together; rank 0 reports it (`workbench.train.distributed`).
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from workbench import kernels
from workbench._io import atomic_write_json, writing
from workbench.kernels.sumsq import sum_of_squares
from workbench.train import checkpointing as ckpt
from workbench.train import distill
from workbench.train.build import build
from workbench.train.config import TrainConfig
from workbench.train.data import global_batch, rank_slice
from workbench.train.datasets import DATA_JSON, load_train_data
from workbench.train.determinism import enable as enable_determinism
from workbench.train.distributed import DistInfo, PeerFailed, agree, all_reduce_max, all_reduce_sum
from workbench.train.expert_stats import ExpertStatsRecorder
from workbench.train.export import export_model
from workbench.train.fqtime import FakeQuantTimer
from workbench.train.memory import SavedTensorMeter, state_bytes
from workbench.train.metrics import METRICS_FILE, MetricsWriter, truncate_metrics
from workbench.train.resume_config import checkpoint_meta
from workbench.train.router_bias import update_router_biases_
from workbench.train.startup import OpenRun, open_run
from workbench.model import is_expert_param
from workbench.model import sync_gradients

_stop_requested = False


def request_stop() -> None:
    """Ask the loop to checkpoint and return at the next step boundary (signal-handler safe)."""
    global _stop_requested
    _stop_requested = True


def clear_stop() -> None:
    global _stop_requested
    _stop_requested = False


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient is NaN/Inf and no more skips are allowed; the message names the
    step, the values and the last good checkpoint."""


class _Deferred:
    """The first failure of a write only this rank makes into `path` (rank 0's metrics line),
    kept until the next step boundary shares it with every rank."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error: OSError | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.error is not None:
            return
        try:
            with writing(self.path):
                fn(*args)
        except OSError as e:
            self.error = e


def _any_rank_stopping(info: DistInfo, deferred: _Deferred | None = None) -> bool:
    """The step boundary, collective: whether any rank asked to stop; a deferred write failure
    on any rank is raised on every rank (the lowest failing rank's own error, PeerFailed on the
    others). One all-reduce of two numbers, as cheap as the flag alone."""
    failed = deferred is not None and deferred.error is not None
    flags = torch.tensor([1.0 if _stop_requested else 0.0,
                          float(info.world - info.rank) if failed else 0.0], device=info.device)
    stop, code = all_reduce_max(flags, info).tolist()
    if code > 0:
        reporter = info.world - int(code)
        if reporter == info.rank:
            deferred.error.reporter = reporter
            raise deferred.error
        raise PeerFailed(f"rank {reporter} failed")
    return stop > 0


def _mean_over_ranks(x: float, info: DistInfo) -> float:
    return _means_over_ranks([x], info)[0]


def _means_over_ranks(xs: list[float], info: DistInfo) -> list[float]:
    t = torch.tensor(xs, dtype=torch.float64, device=info.device)
    return [v / info.world for v in all_reduce_sum(t, info).tolist()]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _use_sumsq_kernel(g: torch.Tensor) -> bool:
    """Whether ``g``'s squared norm comes from the one-pass Triton kernel. torch's
    ``g.double().pow(2).sum()`` is an fp64 copy, a pow pass and a reduction (~36 bytes of traffic
    per fp32 element, a visible share of a GPU step: docs/kernels.md); the kernel reads each
    element once. CPU gradients keep torch's ops, so CPU runs keep
    their bits; dtypes or layouts the kernel does not take (fp16, non-contiguous) too."""
    return (g.is_cuda and g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous()
            and kernels.available())


def _sumsq(g: torch.Tensor) -> torch.Tensor:
    # the kernel's sum is in another order than torch's: equal within fp64 rounding, not bits
    return sum_of_squares(g) if _use_sumsq_kernel(g) else g.double().pow(2).sum()


def global_grad_norm(model: torch.nn.Module, info: DistInfo) -> torch.Tensor:
    """L2 norm of the full gradient, each element counted once over the world: replicated dense
    grads once (every rank holds the same), sharded grads summed over the ranks. Sharded are the
    EP expert slices and, under FSDP, every DTensor gradient: FSDP's shards of the dense
    parameters partition them over the world, and its dp-shards of an EP slice partition that
    slice over the dp ranks that hold it (workbench.train.fsdp), so the world holds each element
    of every gradient exactly once."""

    dense = torch.zeros((), dtype=torch.float64, device=info.device)
    sharded = torch.zeros((), dtype=torch.float64, device=info.device)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach()
        if isinstance(g, DTensor):
            if not all(isinstance(pl, Shard) for pl in g.placements):
                raise ValueError(f"global_grad_norm: {name}'s gradient is placed "
                                 f"{g.placements}; only sharded DTensor gradients are counted")
            sharded += _sumsq(g.to_local())
        elif is_expert_param(model, name):
            sharded += _sumsq(g)
        else:
            dense += _sumsq(g)
    return (dense + all_reduce_sum(sharded, info)).sqrt()


def _clip_(model: torch.nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    if max_norm <= 0:
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
    # One foreach launch per (device, dtype) instead of one g.mul_ per gradient: a tensor times
    # a 0-d CUDA tensor takes torch's non-vectorised broadcast kernel (slow enough to show in a
    # step's profile: docs/kernels.md). Same bits: each element is one product rounded once to
    # the gradient's dtype, as mul_ computes it (the coefficient rounded to that dtype first).
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            g = _local(p.grad)  # a DTensor shard scales in place like any tensor
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))


def _autocast(info: DistInfo):
    # bf16 autocast on GPU only: CPU bf16 matmuls are slow and round differently per kernel.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=info.device.type == "cuda")


def _own_peak_mem_gib(info: DistInfo) -> float:
    if info.device.type == "cuda":
        return torch.cuda.max_memory_allocated(info.device) / 2**30
    # CPU: the process's peak resident set (Linux reports KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _peak_mem_gib(info: DistInfo) -> float:
    # The max over ranks: rank 0 logs, and the per-rank budget is set by the fullest rank
    # (expert routing is uneven), not by rank 0. One scalar all-reduce per step.
    t = torch.tensor([_own_peak_mem_gib(info)], dtype=torch.float64, device=info.device)
    return float(all_reduce_max(t, info).item())


@torch.no_grad()
def validate(model, val_tokens: torch.Tensor, cfg: TrainConfig, info: DistInfo) -> float:
    model.eval()
    total = 0.0
    for i in range(cfg.val_batches):
        tok_BS = rank_slice(global_batch(val_tokens, seed=cfg.seed, index=i, batch=cfg.batch,
                                         seq=cfg.seq, split="val"), info.rank, info.world)
        tok_BS = tok_BS.to(info.device)
        with _autocast(info):
            out = model(tok_BS, labels_BS=tok_BS, return_logits=False)
        total += float(out.ce_loss)
    model.train()
    return _mean_over_ranks(total / cfg.val_batches, info)


def _finite_everywhere(objective: torch.Tensor, norm: torch.Tensor, info: DistInfo) -> bool:
    """Whether the objective on every rank and the (global) gradient norm are finite: one
    scalar all-reduce and the host synchronisation a decision before `opt.step()` needs."""
    bad = (~torch.isfinite(objective.detach().float()) | ~torch.isfinite(norm)).double()
    return not bool(all_reduce_sum(bad.reshape(1), info).item() > 0)


def train_step(model, opt, sched, train_tokens: torch.Tensor, cfg: TrainConfig, info: DistInfo,
               step: int, fq_timer: FakeQuantTimer | None = None, teacher=None,
               measure_memory: bool = False, logits: bool = False) -> dict[str, Any]:
    """One optimizer step on the global batch of `step` (this rank's slice); returns its metrics.
    With an entered `fq_timer`, the record has `fake_quant_share` too; with a `teacher`
    (workbench.train.distill) the objective is the distillation one and the record has `kl`;
    with `measure_memory`, the `mem_*_bytes` this rank holds (max over ranks;
    `workbench.train.memory`). `logits`: make the [B, S, V] logits (the plain head and loss)
    even without a teacher, for comparing the two paths (default: only when distilling).
    A step whose objective or gradient norm is NaN/Inf updates nothing and its record has
    `nonfinite: True` (the caller stops or skips)."""

    timing = fq_timer is not None and fq_timer.available
    if timing:
        fq_timer.take()  # drop what validation or anything else ran since the last step
    t0 = time.perf_counter()
    tok_BS = rank_slice(global_batch(train_tokens, seed=cfg.seed, index=step, batch=cfg.batch,
                                     seq=cfg.seq), info.rank, info.world).to(info.device)
    kl = []
    meter = SavedTensorMeter(model) if measure_memory else contextlib.nullcontext()
    with _autocast(info), meter:
        # the [B, S, V] logits only when distillation needs them (workbench.model.loss)
        want_logits = bool(logits) or teacher is not None
        res = model(tok_BS, labels_BS=tok_BS, return_logits=want_logits)
        objective = res.loss
        if teacher is not None:
            objective, kl_t = distill.objective(res, teacher, tok_BS, cfg,
                                                model.config.aux_loss_coef)
            kl = [float(kl_t)]
    objective.backward()
    layout = getattr(model, "layout", None)
    fsdp = layout is not None and layout.fsdp
    if info.group is not None and not fsdp:  # under FSDP the backward reduced every gradient
        sync_gradients(model, info.group)
    norm = global_grad_norm(model, info)
    finite = _finite_everywhere(objective, norm, info)
    lr = opt.param_groups[0]["lr"]
    if finite:
        _clip_(model, norm, cfg.grad_clip)
        opt.step()
        sched.step()
        if cfg.router_bias_update:  # DeepSeek-V3's balancing from this step's global loads
            update_router_biases_(model, res.router_logits, cfg.router_bias_update, info.group)
    mem = {**state_bytes(model, opt), "mem_activations_bytes": meter.bytes} if measure_memory \
        else {}
    if mem and teacher is not None:  # the frozen teacher's weights this rank holds
        mem["mem_teacher_bytes"] = state_bytes(teacher, None)["mem_masters_bytes"]
    opt.zero_grad(set_to_none=True)
    ce = float(res.ce_loss.detach())  # the step's host synchronisation
    share = fq_timer.take()[0] / (time.perf_counter() - t0) if timing else 0.0
    # One all-reduce for both means; the loss's sum is the same as alone (elementwise).
    loss, share, *kl = _means_over_ranks([ce, share, *kl], info)
    dt = time.perf_counter() - t0
    rec = {
        "step": step, "loss": loss, "grad_norm": float(norm), "lr": lr,
        "tokens_per_s": cfg.batch * cfg.seq / dt, "step_time_s": dt,
        "aux_loss": float(res.aux_loss.detach()) if res.aux_loss is not None else None,
        "peak_mem_gib": _peak_mem_gib(info),
    }
    if timing:
        rec["fake_quant_share"] = share
    if kl:
        rec["kl"] = kl[0]
    if not finite:
        rec["nonfinite"] = True
    if mem:
        names = sorted(mem)
        t = torch.tensor([float(mem[k]) for k in names], dtype=torch.float64, device=info.device)
        rec.update({k: int(v) for k, v in zip(names, all_reduce_max(t, info).tolist())})
    return rec


def _values(rec: dict) -> str:
    return f"loss {rec['loss']}, grad norm {rec['grad_norm']}"


def _nonfinite_message(rec: dict, cfg: TrainConfig, out: Path, last_saved: int) -> str:
    good = (f"the last good checkpoint is {ckpt.checkpoint_root(out) / f'step_{last_saved:08d}'}"
            " (--resume continues from it)" if last_saved >= 0 else
            "no checkpoint was written yet")
    allowed = f"{cfg.skip_nonfinite_steps} skip(s) allowed, " if cfg.skip_nonfinite_steps else ""
    return (f"step {rec['step']}: non-finite {_values(rec)}; stopped before the optimizer step, "
            f"nothing exported; {good}; {allowed}--skip-nonfinite-steps N skips such steps")


def train(cfg: TrainConfig, info: DistInfo, *, logger=None,
          on_step: Callable[[dict], None] | None = None, return_model: bool = False,
          opened: OpenRun | None = None):
    """Run (or resume) `cfg` on this rank; every rank calls it. Returns the result dict
    (JSON-able; submitit pickles it back to the caller), or (result, model) with return_model.
    `opened`: the run folder the caller opened already (`startup.open_run`; `cli.run` does);
    else train opens it here (claim and lock), and releases it when it returns."""
    cfg.check_world(info.world)
    enable_determinism(cfg.deterministic)  # for callers that skip cli.main
    run = opened if opened is not None else open_run(cfg, info)
    try:
        return _train(cfg, info, logger=logger, on_step=on_step, return_model=return_model)
    finally:
        if opened is None:
            run.release()


def _train(cfg: TrainConfig, info: DistInfo, *, logger, on_step, return_model):
    out = Path(cfg.out)
    torch.manual_seed(cfg.seed + info.rank)
    found = None
    b = build(cfg, info, resuming=cfg.resume and bool(ckpt.candidates(out)))
    model, opt, sched = b.model, b.opt, b.sched
    corpus = load_train_data(cfg, info, model.config.vocab_size)
    teacher = distill.build_teacher(cfg, info, b.layout) if cfg.distill else None

    start = 0
    if cfg.resume:  # the newest checkpoint that verifies and loads (says which it skipped)
        found = ckpt.resume(out, model, opt, sched, info)
    if found is not None:
        start = found.step
        if info.is_main:
            print(f"[train] resumed from {found.path} (step {start})", flush=True)
    err = None
    if info.is_main:
        try:
            if cfg.resume:
                truncate_metrics(out, start)
            else:
                (out / METRICS_FILE).unlink(missing_ok=True)
            if corpus.info:
                atomic_write_json(out / DATA_JSON, corpus.info)
        except OSError as e:
            err = e
    agree(info, err)
    stats = None
    if cfg.stats_every:
        stats = ExpertStatsRecorder(model, info, out, resume_step=start if found else None)
    deferred = _Deferred(out / METRICS_FILE)  # rank 0's writes: a failure stops all
    writer = None
    if info.is_main:
        with writing(out / METRICS_FILE):
            writer = MetricsWriter(out)
    meta = checkpoint_meta(cfg)
    protect = found.step if found is not None else None  # never pruned by this run

    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=start, desc=f"train {cfg.recipe}", unit="step",
               disable=not info.is_main, mininterval=1.0)
    stopped = False
    last_saved = start if found is not None else -1
    last: dict[str, Any] = {}
    step = start
    skipped = 0
    model.train()
    fq_timer = FakeQuantTimer().__enter__()
    try:
        if stats is not None and found is None:
            stats.record(0)  # the map before training: the drift and churn baseline
        while step < cfg.steps:
            if _any_rank_stopping(info, deferred):
                stopped = True
                break
            step += 1
            rec = train_step(model, opt, sched, corpus.train, cfg, info, step, fq_timer, teacher,
                             measure_memory=step == start + 1)
            loss = rec["loss"]
            if rec.get("nonfinite"):
                skipped += 1
                rec["skipped_steps"] = skipped
                if skipped > cfg.skip_nonfinite_steps:
                    if info.is_main:
                        deferred.run(writer.write, rec)  # the curve shows where it stopped
                    raise NonFiniteStep(_nonfinite_message(rec, cfg, out, last_saved))
                if info.is_main:
                    print(f"[train] step {step}: {_values(rec)}: skipped ({skipped} of at most "
                          f"{cfg.skip_nonfinite_steps})", flush=True)
            elif skipped:
                rec["skipped_steps"] = skipped
            if cfg.val_every and (step % cfg.val_every == 0 or step == cfg.steps):
                if teacher is not None:
                    rec.update(distill.validate(model, teacher, corpus.val, cfg, info,
                                                lambda: _autocast(info)))
                else:
                    rec["val_loss"] = validate(model, corpus.val, cfg, info)
            if not math.isfinite(loss):
                rec["diverged"] = True
            if stats is not None and (step % cfg.stats_every == 0 or step == cfg.steps):
                err = None
                try:  # rank 0 rewrites the parquet file after the ranks' gather
                    rec.update(stats.record(step))
                except OSError as e:
                    err = e
                agree(info, err)
                if info.is_main and logger is not None:
                    logger.log_table("expert_stats", stats.table(step), step)
            if info.is_main:
                deferred.run(writer.write, rec)
                if logger is not None:
                    logger.log({k: v for k, v in rec.items() if k != "step"}, step)
                if on_step is not None:
                    on_step(rec)
            last = rec
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < cfg.steps:
                ckpt.save(out, model, opt, sched, step, info, keep=cfg.keep, meta=meta,
                          protect=protect)
                last_saved = step
        agree(info, deferred.error)  # the last step's metrics line, before the final save
        if last_saved != step:  # final or preemption checkpoint
            ckpt.save(out, model, opt, sched, step, info, keep=cfg.keep, meta=meta,
                      protect=protect)
    finally:
        if stats is not None:
            stats.close()
        fq_timer.__exit__(None, None, None)
        bar.close()
        if writer is not None:
            writer.close()

    result: dict[str, Any] = {
        "step": step, "steps": cfg.steps, "stopped": stopped, "world_size": info.world,
        "recipe": cfg.recipe, "preset": cfg.preset, "final_loss": last.get("loss"),
        "final_val_loss": last.get("val_loss"),
        "checkpoint": str(ckpt.checkpoint_root(out) / f"step_{step:08d}"),
    }
    if not stopped and cfg.export:
        # the export is usable with its own tokenizer, copied in before the swap into place
        path = export_model(model, out / "export", fmt=cfg.export, recipe=cfg.recipe,
                            profile=cfg.profile, group=info.group,
                            tokenizer=corpus.info.get("tokenizer") if corpus.info else None)
        result["export"] = str(path)
    err = None
    if info.is_main:
        try:
            atomic_write_json(out / "result.json", result)
        except OSError as e:
            err = e
    agree(info, err)
    return (result, model) if return_model else result
