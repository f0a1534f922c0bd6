"""Fixtures no workbench code wrote: a Qwen3-MoE checkpoint saved by transformers (vocab 512) and
a byte-level BPE tokenizer trained with the `tokenizers` library, plus JSONL text."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")


def corpus_texts(n: int = 400, size: int = 600) -> list[str]:
    """Real text: chunks of the shipped CPython standard-library corpus."""
    from workbench.train.data import load_corpus

    blob = bytes(load_corpus().train[: n * size].numpy()).decode("utf-8", errors="replace")
    return [blob[i * size:(i + 1) * size] for i in range(n)]


def train_tokenizer(folder: Path, texts: list[str], vocab: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def write_checkpoint(folder: Path, *, seed: int = 0, vocab: int = 512) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                         architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # a sharper router than the default init, so experts matter
        for n, p in model.named_parameters():
            if "mlp.gate." in n:
                p.normal_(0, 0.5)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def write_jsonl(path: Path, texts: list[str], *, chat_every: int = 0) -> Path:
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            if chat_every and i % chat_every == 0:
                rec = {"messages": [{"role": "user", "content": t[:100]},
                                    {"role": "assistant", "content": t[100:]}]}
            else:
                rec = {"text": t}
            f.write(json.dumps(rec) + "\n")
    return path


def model_with_tokenizer(folder: Path, texts: list[str]) -> Path:
    write_checkpoint(folder)
    train_tokenizer(folder, texts)
    return folder
