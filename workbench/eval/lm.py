"""The model as lm-eval's HF backend sees it.

A transformers model runs in lm-eval's own `HFLM` unchanged. The workbench's model (`ptq:` and
DCP checkpoints, fake quantization installed) runs in `WorkbenchLM`, an `HFLM` whose two model
calls are ours: `_model_call` (logits of a right-padded batch: our attention is causal and
routing is per token, so the padding after a sequence changes nothing before it) and
`_model_generate` (greedy decoding of the batch HFLM builds: the model has no padding mask, so
the left-padded rows are re-packed right-padded, for the same reason as above, and each step
runs the batch's live rows once, the head only at each row's last token; there is no KV cache,
so a step runs the whole sequences). Everything else, tokenization, request batching,
truncation, log-likelihood and scoring, is lm-eval's.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.eval.errors import EvalError

try:
    import transformers
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("workbench.eval needs lm-eval: pip install 'workbench[eval]'") from e


class _ModuleView(nn.Module):
    """What HFLM reads of a transformers model (config, device, tie_weights, .logits), around
    our module."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__()
        self.module = module
        self.config = transformers.PretrainedConfig(
            max_position_embeddings=module.config.max_seq_len)
        self.name_or_path = name

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def tie_weights(self) -> None:
        pass  # our model ties (or not) at construction

    def forward(self, input_ids: torch.Tensor):
        return self.module(input_ids)


class WorkbenchLM(HFLM):
    """HFLM over `workbench.model.MoEForCausalLM` (see the module docstring). Greedy decoding
    only: a task that samples is refused."""

    def __init__(self, module: nn.Module, tokenizer, *, name: str, batch_size: int = 1,
                 max_length: int | None = None) -> None:
        super().__init__(pretrained=_ModuleView(module, name), tokenizer=tokenizer,
                         backend="causal", batch_size=batch_size, max_length=max_length)

    def _autocast(self):
        # The trainer's precision: fp32 masters, BF16 autocast on CUDA, none on CPU.
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if attn_mask is not None or labels is not None:
            raise EvalError("the workbench model is a causal LM; seq2seq calls are not supported")
        with torch.no_grad(), self._autocast():
            return self.model.module(inps).logits

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs) -> torch.Tensor:
        mask = generation_kwargs.pop("attention_mask", None)
        temperature = generation_kwargs.pop("temperature", 0.0)
        if generation_kwargs.pop("do_sample", False) or temperature not in (0, 0.0, None):
            raise EvalError("a task asks for sampled generation; the workbench model decodes "
                            "greedily only (evaluate the run's export to sample)")
        ignored = {k for k in generation_kwargs if k not in ("max_new_tokens",)}
        if ignored:
            raise EvalError(f"generation options {sorted(ignored)} are not supported by the "
                            "workbench model's greedy decoding")
        pad = self.tokenizer.pad_token_id
        prompts = [context[b] if mask is None else context[b][mask[b].bool()]
                   for b in range(context.shape[0])]
        made = self._greedy(prompts, max_length - context.shape[1], stop)
        rows = [torch.cat([context[b], made[b]]) for b in range(context.shape[0])]
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), pad, dtype=context.dtype, device=context.device)
        for b, r in enumerate(rows):
            out[b, :len(r)] = r
        return out

    def _greedy(self, prompts: list[torch.Tensor], max_new: int,
                stop: list[str]) -> list[torch.Tensor]:
        """argmax decoding of each prompt until a stop sequence appears in its generated text
        (what HFLM's stopping criteria look for; HFLM cuts the text at it afterwards) or
        max_new tokens. The rows still generating run together, right-padded: causal attention
        and per-token routing leave a row's positions unchanged by what follows them."""
        lens = [len(p) for p in prompts]
        seq = prompts[0].new_zeros(len(prompts), max(lens) + max(0, max_new))
        for b, p in enumerate(prompts):
            seq[b, :len(p)] = p
        new: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        for _ in range(max(0, max_new)):
            if not live:
                break
            rows = torch.tensor(live, device=seq.device)
            last = torch.tensor([lens[b] - 1 for b in live], device=seq.device)
            with torch.no_grad(), self._autocast():
                logits = self.model.module(seq[rows, :max(lens[b] for b in live)],
                                           logits_at_B=last).logits
            still = []
            for b, nxt in zip(live, logits[:, 0].argmax(-1).tolist()):
                new[b].append(nxt)
                seq[b, lens[b]] = nxt
                lens[b] += 1
                text = self.tokenizer.decode(new[b], skip_special_tokens=False)
                if not any(s in text for s in stop):
                    still.append(b)
            live = still
        return [seq.new_tensor(n) for n in new]

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": "fp32 masters", "model_revision": "", "model_sha": ""}


def hf_lm(model: nn.Module, tokenizer, *, batch_size: int = 1,
          max_length: int | None = None) -> HFLM:
    """lm-eval's own HFLM around an already loaded transformers model."""
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                max_length=max_length)
