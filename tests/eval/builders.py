"""Models the eval tests evaluate, made by other code than workbench.eval: a Qwen3-MoE checkpoint
written by transformers with a BPE tokenizer trained by the `tokenizers` library, and a run group
trained on it by the workbench trainer (a BF16 run, then an MXFP4 QAT run from its export), on
text holding the lines the shipped tasks ask about, so the models get some of them right."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "workbench" / "eval" / "tasks"


def env(tmp: Path, **extra: str) -> dict[str, str]:
    """Subprocess environment: this checkout first, offline, caches and wandb files in `tmp`,
    one intra-op thread (two cores shared by many processes: spin-waiting threads cost 100x)."""
    e = dict(os.environ)
    e.update(PYTHONPATH=os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep),
             HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             HF_HOME=str(tmp / "hf-home"), HF_DATASETS_CACHE=str(tmp / "hf-datasets"),
             WANDB_MODE="offline", WANDB_DIR=str(tmp), WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
             WANDB_CONFIG_DIR=str(tmp / "wandb-config"), WANDB_SILENT="true",
             WANDB_DATA_DIR=str(tmp / "wandb-data"), WANDB_ARTIFACT_DIR=str(tmp / "wandb-art"),
             OMP_NUM_THREADS="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", MPLBACKEND="Agg",
             **extra)
    e.pop("WANDB_API_KEY", None)
    return e


def workbench_eval(args: list, tmp: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`workbench eval ARGS` as a user runs it (a new process, the CLI's own error handling)."""
    return subprocess.run([sys.executable, "-m", "workbench.cli", "eval", *map(str, args)],
                          env=env(tmp), cwd=tmp, capture_output=True, text=True,
                          timeout=timeout, check=False)


def task_lines() -> list[str]:
    """The valid lines of the shipped tasks: the multiple-choice context + its valid choice, the
    completion prompt + its target."""
    lines = []
    for rec in map(json.loads, (TASKS / "code_choice.jsonl").read_text().splitlines()):
        lines.append(rec["context"] + rec["choices"][rec["answer"]])
    for rec in map(json.loads, (TASKS / "code_complete.jsonl").read_text().splitlines()):
        lines.append(rec["prompt"] + rec["target"])
    return lines


def write_corpus(path: Path, n: int = 1200, seed: int = 0) -> Path:
    """JSONL records of 6 task lines each, shuffled."""
    rng = random.Random(seed)
    lines = task_lines()
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": "\n".join(rng.sample(lines, 6)) + "\n"}) + "\n" for _ in range(n))
    return path


def write_checkpoint(folder: Path, corpus: Path, *, seed: int = 0) -> Path:
    """A random Qwen3-MoE saved by transformers (BF16) and a byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(folder)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048,
                         architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


TRAIN = """
import sys
from workbench.train.cli import main
root, corpus, ckpt = sys.argv[1:4]
common = ["--data", corpus, "--batch", "8", "--seq", "64", "--val-every", "0",
          "--wandb", "offline", "--run-group", "g", "--warmup", "2"]
main(["--init", ckpt, "--recipe", "bf16", "--steps", "60", "--lr", "3e-3", "--ckpt-every", "60",
      "--export", "bf16", "--out", root + "/bf16", *common])
main(["--init", root + "/bf16/export", "--recipe", "mxfp4", "--steps", "12", "--lr", "1e-3",
      "--ckpt-every", "12", "--export", "compressed-tensors", "--out", root + "/qat", *common])
"""


def train_group(root: Path) -> dict[str, Path]:
    """root/{ckpt, bf16, qat}: the checkpoint, a BF16 run from it and an MXFP4 QAT run from the
    BF16 run's export (the workflow the eval compares: BF16, PTQ of it, QAT of it)."""
    root.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(root / "code.jsonl")
    ckpt = write_checkpoint(root / "ckpt", corpus)
    proc = subprocess.run([sys.executable, "-c", TRAIN, str(root), str(corpus), str(ckpt)],
                          env=env(root), cwd=root, capture_output=True, text=True, timeout=900,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"training the eval test group failed:\n{proc.stderr[-4000:]}")
    return {"root": root, "ckpt": ckpt, "bf16": root / "bf16", "bf16_model": root / "bf16" / "export",
            "qat": root / "qat"}


def write_demo_init(folder: Path) -> Path:
    """The demo's BF16 model (workbench.demo's own writer: small preset, structured experts,
    a character-level BPE trained on the shipped corpus), without its QAT run."""
    from workbench.demo import _write_init, _write_tokenizer_and_text

    _write_init(folder, 0)
    _write_tokenizer_and_text(folder, folder.parent / "demo-data")
    return folder


if __name__ == "__main__":  # build once by hand: python tests/eval/builders.py DIR
    print(train_group(Path(sys.argv[1])))


CACHED_HUB_DATASET = """
import sys
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
import datasets
from datasets.data_files import DataFilesDict
from datasets.packaged_modules.parquet.parquet import Parquet, ParquetConfig
repo, config, src = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = {"question": ["What is 2 + 3?", "What is 10 - 4?", "What is 3 + 3?"],
        "answer": ["2 + 3 = 5\\n#### 5", "10 - 4 = 6\\n#### 6", "3 + 3 = 6\\n#### 6"]}
src.mkdir(parents=True)
for split in ("train", "test"):
    pq.write_table(pa.table(rows), src / f"{split}.parquet")
files = DataFilesDict.from_patterns({s: [str(src / f"{s}.parquet")] for s in ("train", "test")})
class Hub(Parquet):
    BUILDER_CONFIGS = [ParquetConfig(name=config, data_files=files)]
namespace, name = repo.split("/")
Hub(config_name=config, dataset_name=name, hash="0123abcd").download_and_prepare()
root = Path(datasets.config.HF_DATASETS_CACHE)
(root / name).rename(root / f"{namespace}___{name}")
assert datasets.load_dataset(repo, config)["test"].num_rows == 3
"""


def cache_hub_dataset(tmp: Path, repo: str, config: str) -> None:
    """What `datasets` leaves in its cache after downloading `repo` (3 rows of grade-school
    arithmetic): written by datasets' own parquet builder under the hub dataset's cache name, and
    read back offline by `datasets.load_dataset(repo, config)` before the test uses it."""
    proc = subprocess.run([sys.executable, "-c", CACHED_HUB_DATASET, repo, config,
                           str(tmp / "hub-source")], env=env(tmp), cwd=tmp,
                          capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"caching {repo} failed:\n{proc.stderr[-3000:]}")
