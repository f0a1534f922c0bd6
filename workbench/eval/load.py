"""Load a `ModelRef` into a model and tokenizer the harness can run.

Two engines, chosen by what the MODEL is (`ModelRef.engine`):
- transformers: checkpoint folders and a run's export, loaded the way transformers loads them
  (`AutoModelForCausalLM.from_pretrained`, offline, no remote code): compressed-tensors packed
  checkpoints are decompressed by transformers' own compressed-tensors integration, gpt-oss MXFP4
  ones through `Mxfp4Config(dequantize=True)`;
- workbench: `ptq:RECIPE@PATH` and a run's DCP checkpoints, as `workbench.model.MoEForCausalLM`
  with `workbench.qat.prepare` fake quantization installed: the model the trainer trains, built and
  loaded by the trainer's own functions (`workbench.train.build`, `init.load_init`, the DCP reader
  of `workbench.train.checkpointing`). `workbench_model` is the one place a checkpoint folder
  becomes our module (a loader for other families slots in there).

Precision: the transformers model's parameters are cast to `dtype` (a packed checkpoint's
decompressed experts may arrive in BF16 whatever was asked); our module keeps the trainer's fp32
masters and runs under the trainer's autocast (BF16 on CUDA, none on CPU).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from workbench.arch import ModelConfigError
from workbench.checkpoint import CheckpointError
from workbench.checkpoint.dcp_metadata import SafeFileSystemReader
from workbench.eval.errors import EvalError
from workbench.eval.refs import ModelRef, read_json_object
from workbench.model import StateDictError, from_pretrained
from workbench.qat import prepare
from workbench.train.build import QAT_SCOPE, build_model, prepare_qat
from workbench.train.checkpointing import Found, verify
from workbench.train.config import TrainConfig
from workbench.train.datasets import DATA_JSON
from workbench.train.distributed import DistInfo
from workbench.train.tokenizer import TokenizerError, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Loaded:
    ref: ModelRef
    model: nn.Module  # a transformers PreTrainedModel, or MoEForCausalLM with QAT prepared
    tokenizer: Any  # a transformers tokenizer
    base: str | None  # the BF16 checkpoint this model derives from (pairs it for recovery)
    precision: str  # what the forward computes in, for the record
    info: dict[str, Any]  # prepare report, tokenizer folder, parameter count


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (CPU BF16 matmuls are slow and round per kernel), BF16 on GPUs."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise EvalError(f"--dtype {dtype!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _tokenizer(folder: str | Path, flag: str):
    try:
        return load_tokenizer(folder, flag=flag)
    except TokenizerError as e:
        raise EvalError(str(e)) from None


def transformers_model(path: Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A checkpoint folder as transformers loads it (see the module docstring)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("workbench eval needs transformers: pip install 'workbench[eval]'") from e
    cfg = read_json_object(path / "config.json", "config.json")
    kwargs: dict[str, Any] = {}
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)  # gpt-oss' own layout
    if device.type != "cpu":  # straight onto the GPU, not a full host copy first
        kwargs["device_map"] = str(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, trust_remote_code=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError/ValueError/KeyError...
        msg = " ".join(str(e).split())[:300]
        raise EvalError(f"{path}: transformers cannot load this checkpoint "
                        f"({type(e).__name__}: {msg})") from None
    with torch.no_grad():  # .float() is refused on a compressed-tensors model; .data is not
        for p in model.parameters():
            p.data = p.data.to(device=device, dtype=dtype)
        for b in model.buffers():
            b.data = b.data.to(device=device)
    return model.eval()


def workbench_model(path: Path, device: torch.device) -> nn.Module:
    """The workbench's model of a BF16 or packed checkpoint folder (fp32 masters on `device`):
    `workbench.model.from_pretrained`, packed experts decoded exactly on the way."""
    try:
        return from_pretrained(path, device=device)
    except (ModelConfigError, CheckpointError, StateDictError, ValueError) as e:
        raise EvalError(f"{path}: {e}") from None


def _single(device: torch.device) -> DistInfo:
    return DistInfo(rank=0, world=1, local_rank=0, device=device, group=None, owns_group=False)


def _train_config(ref: ModelRef) -> TrainConfig:
    conf = dict(ref.train_config or {})
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in conf.items() if k in known}
    kw["out"] = str(ref.run)
    kw["export"] = None  # what the run exported does not change the model it trained
    if kw.get("preset") is None and kw.get("init") and not Path(kw["init"]).is_dir():
        # The architecture lives in --init's config.json; a run's export carries the same file.
        export = ref.run / "export"
        if (export / "config.json").is_file():
            kw["init"] = str(export)
    try:
        return TrainConfig(**kw)
    except (TypeError, ValueError) as e:
        raise EvalError(f"{ref.run}: the run's recorded configuration does not build a "
                        f"TrainConfig ({e})") from None


def _load_dcp(ref: ModelRef, device: torch.device) -> tuple[nn.Module, TrainConfig, Any]:
    """The run's model from a DCP checkpoint: built as the trainer builds it, its weights (only
    the model's, not the optimizer's) read through the allow-listed DCP reader after the
    checkpoint's digests are verified, then the run's fake quantization prepared."""
    cfg = _train_config(ref)
    info = _single(device)
    try:
        model = build_model(cfg, info, overwritten=True)
    except (ModelConfigError, ValueError) as e:
        raise EvalError(f"{ref.run}: cannot build the run's model ({e})") from None
    marker = read_json_object(ref.path / "COMPLETE", "the checkpoint's COMPLETE marker")
    found = Found(ref.step, ref.path, marker)
    sd = {f"model/{n}": p.data for n, p in model.named_parameters()}
    try:
        verify(found, info)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(sd, storage_reader=SafeFileSystemReader(ref.path), no_dist=True)
    except CheckpointError as e:
        raise EvalError(e.one_line()) from None
    except Exception as e:  # noqa: BLE001 - DCP's CheckpointException and reader errors
        raise EvalError(f"{ref.path}: cannot load the model from this checkpoint "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    return model, cfg, prepare_qat(model, cfg)


def _run_tokenizer(ref: ModelRef, cfg: TrainConfig | None) -> str | None:
    """The folder of the tokenizer the run trained with: data.json records it, else the run's
    --tokenizer or --init."""
    data = ref.run / DATA_JSON if ref.run is not None else None
    if data is not None and data.is_file():
        try:
            tok = read_json_object(data, DATA_JSON).get("tokenizer")
        except EvalError:  # unreadable, or not an object: the run's flags below instead
            tok = None
        if isinstance(tok, str) and Path(tok).is_dir():
            return tok
    for cand in ((cfg.tokenizer, cfg.init) if cfg is not None else ()):
        if cand and Path(cand).is_dir():
            return cand
    return None


def load(ref: ModelRef, *, device: str | torch.device = "cpu", dtype: str = "auto",
         tokenizer: str | Path | None = None) -> Loaded:
    """Load `ref` on `device` (see the module docstring); `tokenizer` overrides the model's own."""
    dev = torch.device(device)
    info: dict[str, Any] = {}
    cfg = None
    if ref.engine == "transformers":
        want = resolve_dtype(dtype, dev)
        model = transformers_model(ref.path, dev, want)
        precision = str(want).removeprefix("torch.")
        tok_dir = tokenizer or ref.path
        base = None
        if ref.run is not None and ref.train_config:
            base = ref.train_config.get("init")
    else:
        if dtype != "auto":
            raise EvalError(f"{ref.text}: --dtype {dtype} applies to checkpoint folders only; "
                            "the workbench's model keeps the trainer's fp32 masters")
        if ref.kind == "ptq":
            model = workbench_model(ref.path, dev)
            try:
                report = prepare(model, ref.recipe, scope=QAT_SCOPE)
            except ValueError as e:
                raise EvalError(f"{ref.text}: {e}") from None
            base = str(ref.path)
            tok_dir = tokenizer or ref.path
        else:
            model, cfg, report = _load_dcp(ref, dev)
            base = cfg.init
            tok_dir = tokenizer or _run_tokenizer(ref, cfg)
            if tok_dir is None:
                raise EvalError(f"{ref.run}: the run records no tokenizer (it trained on the "
                                "shipped byte corpus?); pass --tokenizer PATH")
        info["prepare"] = str(report) if report is not None else "bf16: nothing fake-quantized"
        precision = "fp32 masters" + (", bf16 autocast" if dev.type == "cuda" else "")
        model.eval()
    tok = _tokenizer(tok_dir, "--tokenizer" if tokenizer else f"the tokenizer of {ref.label}")
    if tok.vocab_size > _embedding_rows(model):
        raise EvalError(f"tokenizer {tok.path} has {tok.vocab_size} tokens, more than "
                        f"{ref.label}'s embedding ({_embedding_rows(model)} rows)")
    info["tokenizer"] = tok.path
    info["parameters"] = sum(p.numel() for p in model.parameters())
    if base is not None:
        base = str(Path(base).resolve())
    return Loaded(ref, model, tok.hf, base, precision, info)


def _embedding_rows(model: nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0]) if hasattr(
        model, "get_input_embeddings") else int(model.model.embed_tokens.weight.shape[0])
