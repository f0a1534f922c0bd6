"""Benchmark: downstream-eval throughput of a packed export through lm-eval's HF backend, against
the BF16 checkpoint of the same model in the same run, and the workbench's own model (PTQ: fp32
masters with fake quantization) as `workbench eval` runs it.

    python jobs/bench_eval.py                                   # GPU: the 30B-A3B-like preset
    python jobs/bench_eval.py --preset tiny --device cpu --docs 8 --gen-docs 4   # a CPU check

The job writes (under --out) a random-initialised model of --preset with --layers layers as a
BF16 checkpoint and as a compressed-tensors export packed with --recipe's weight format (the
trainer's `export_model`), a BPE tokenizer trained on the shipped corpus, and two local lm-eval
tasks made from the corpus' validation split: a 4-way multiple choice (which line follows;
log-likelihood requests) and a line completion (greedy generation up to the newline). Each
model is loaded once per task by `workbench.eval.run` and timed by it (the harness's own
`simple_evaluate` call, model loading excluded), after an untimed warm-up of every model on both
tasks.

Rows: model (bf16, packed, ptq), engine (transformers / workbench), task, documents, lm-eval
requests, seconds, requests/s and documents/s, generated tokens/s (the line completion: a random
model stops where its own text first holds a newline, so documents/s alone would compare unequal
work), and each model's speed relative to BF16 (requests/s; generated tokens/s for generation).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch
from transformers import AutoTokenizer

from workbench._io import atomic_write_json, atomic_write_text
from workbench.arch import preset
from workbench.eval import run
from workbench.eval.record import safe_name
from workbench.model import MoEForCausalLM
from workbench.track import read_eval
from workbench.train.data import load_corpus
from workbench.train.export import export_model
from workbench.train.tokenizer import copy_tokenizer, train_bpe

CHOICE_YAML = """task: bench_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
COMPLETE_YAML = """task: bench_complete
dataset_path: json
dataset_kwargs:
  data_files:
    test: complete.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: MAX_GEN
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_tasks(folder: Path, docs: int, gen_docs: int, max_gen: int, seed: int = 0) -> Path:
    """Tasks from the corpus' validation split (code the model never trained on: it is random)."""
    text = bytes(load_corpus().val.numpy()).decode("utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 12]
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    choice = []
    for _ in range(docs):
        i = rng.randrange(len(lines) - 1)
        wrong = rng.sample(lines, 3)
        k = rng.randrange(4)
        choices = [f"\n{x}" for x in wrong[:k] + [lines[i + 1]] + wrong[k:]]
        choice.append(json.dumps({"context": lines[i], "choices": choices, "answer": k}) + "\n")
    complete = [json.dumps({"prompt": ln[:len(ln) // 2], "target": ln[len(ln) // 2:]}) + "\n"
                for ln in rng.sample(lines, gen_docs)]
    atomic_write_text(folder / "choice.jsonl", "".join(choice))
    atomic_write_text(folder / "complete.jsonl", "".join(complete))
    atomic_write_text(folder / "bench_choice.yaml", CHOICE_YAML)
    atomic_write_text(folder / "bench_complete.yaml",
                      COMPLETE_YAML.replace("MAX_GEN", str(max_gen)))
    return folder


def write_models(out: Path, name: str, layers: int | None, recipe: str, device: str,
                 vocab: int) -> tuple[Path, Path]:
    cfg = preset(name) if layers is None else preset(name).with_layers(layers)
    model = MoEForCausalLM(cfg, seed=0, device=device, dtype=torch.float32)
    bf16, packed = out / "bf16", out / f"packed-{recipe}"
    export_model(model, bf16, fmt="bf16")
    export_model(model, packed, fmt="compressed-tensors", recipe=recipe)
    del model
    text = bytes(load_corpus().train[:2_000_000].numpy()).decode("utf-8", errors="replace")
    chunks = [text[i:i + 10_000] for i in range(0, len(text), 10_000)]
    byte_level = min(vocab, cfg.vocab_size) > 300  # byte-level BPE needs 256 tokens + specials
    tok = train_bpe(chunks, out / "tokenizer", vocab_size=min(vocab, cfg.vocab_size),
                    byte_level=byte_level)
    for folder in (bf16, packed):
        copy_tokenizer(tok, folder)
    return bf16, packed


def generated_tokens(samples: Path, tok) -> int:
    """Tokens the model generated over a generation task's samples (its raw answers, before the
    stop sequence is cut off, re-tokenized)."""
    n = 0
    for line in samples.read_text().splitlines():
        for resp in json.loads(line).get("resps", []):
            text = resp[0] if isinstance(resp, list) else resp
            n += len(tok(text, add_special_tokens=False)["input_ids"])
    return n


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3_30b_a3b_like")
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's")
    ap.add_argument("--recipe", default="mxfp4", help="weight format of the packed export")
    ap.add_argument("--docs", type=int, default=256, help="multiple-choice documents")
    ap.add_argument("--gen-docs", type=int, default=64, help="line-completion documents")
    ap.add_argument("--max-gen-toks", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096, help="tokenizer size (<= the preset's)")
    ap.add_argument("--models", default="bf16,packed,ptq")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="runs/bench_eval")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    t0 = time.perf_counter()
    bf16, packed = write_models(out, args.preset, args.layers, args.recipe, args.device,
                                args.vocab)
    tasks = write_tasks(out / "tasks", args.docs, args.gen_docs, args.max_gen_toks)
    print(f"[bench_eval] models and tasks written in {time.perf_counter() - t0:.0f} s")
    refs = {"bf16": str(bf16), "packed": str(packed), "ptq": f"ptq:{args.recipe}@{bf16}"}
    models = [refs[m] for m in args.models.split(",")]
    names = dict(zip(models, args.models.split(",")))
    common = {"include": [tasks], "device": args.device, "batch_size": args.batch_size,
              "record_runs": False, "log": lambda s: None}
    # every model through both tasks first, untimed: CUDA init, kernel choices and the first
    # generate's set-up would otherwise fall on whichever model runs first
    run(models, "bench_choice,bench_complete", out=out / "warmup", limit=2, **common)
    tok = AutoTokenizer.from_pretrained(bf16)
    rows = []
    for task, docs in (("bench_choice", args.docs), ("bench_complete", args.gen_docs)):
        run(models, task, out=out / task, **common)
        for m in read_eval(out / task)["models"]:
            per_doc = 4 if task == "bench_choice" else 1
            row = {"model": names[m["ref"]["text"]], "engine": m["engine"], "task": task,
                   "docs": docs, "requests": docs * per_doc, "seconds": m["seconds"],
                   "requests_per_s": docs * per_doc / m["seconds"],
                   "docs_per_s": docs / m["seconds"], "precision": m["precision"]}
            if task == "bench_complete":  # a random model stops at its own length: count it
                row["generated_tokens"] = generated_tokens(
                    out / task / "samples" / safe_name(m["label"]) / f"{task}.jsonl", tok)
                row["gen_tokens_per_s"] = row["generated_tokens"] / m["seconds"]
            rows.append(row)

    def rate(r):  # generation: tokens made per second (models stop at different lengths)
        return r.get("gen_tokens_per_s", r["requests_per_s"])

    base = {r["task"]: rate(r) for r in rows if r["model"] == "bf16"}
    for r in rows:
        r["speed_vs_bf16"] = rate(r) / base[r["task"]] if base.get(r["task"]) else None
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\n[bench_eval] {args.preset} ({args.layers or 'all'} layers), {dev}, batch "
          f"{args.batch_size}, torch {torch.__version__}")
    head = ("model", "engine", "task", "docs", "requests", "seconds", "requests/s", "docs/s",
            "generated tokens/s", "vs bf16", "precision")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        vs = "-" if r["speed_vs_bf16"] is None else f"{r['speed_vs_bf16']:.2f}x"
        print(f"| {r['model']} | {r['engine']} | {r['task']} | {r['docs']} | {r['requests']} | "
              f"{r['seconds']:.2f} | {r['requests_per_s']:.1f} | {r['docs_per_s']:.2f} | "
              f"{r.get('gen_tokens_per_s', float('nan')):.1f} | {vs} | {r['precision']} |")
    atomic_write_json(out / "bench_eval.json", rows)
    return rows


if __name__ == "__main__":
    main()
