"""Real datasets: every source format tokenized under the documented convention (checked against
the tokenizer itself), the token cache, deterministic sharded sampling, and bad data named."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from conftest import REPO, command, env
from realdata import corpus_texts, model_with_tokenizer, train_tokenizer, write_jsonl

from workbench.train import datasets as ds
from workbench.train.data import PackedSplit, global_batch, rank_slice
from workbench.train.tokenizer import TokenizerError, check_fits, load_tokenizer


@pytest.fixture(scope="module")
def texts():
    return corpus_texts(120, 400)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, texts):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), texts)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def expected_stream(tok, texts: list[str]) -> list[int]:
    # The convention, written from docs/data.md with the transformers tokenizer itself: each
    # record without special tokens, then one EOS, concatenated.
    out: list[int] = []
    for t in texts:
        out += tok.hf.encode(t, add_special_tokens=False) + [tok.hf.eos_token_id]
    return out


def tokens_of(sources, tok, cache) -> tuple[ds.TokenFile, list[int]]:
    f = ds.tokenize_sources([ds.parse_source(str(s)) for s in sources], tok, cache, name="train",
                            show_progress=False)
    return f, f.memmap().tolist()


def test_jsonl_text_and_chat_messages(tmp_path, tok, texts):
    path = write_jsonl(tmp_path / "d.jsonl", texts, chat_every=3)
    f, got = tokens_of([path], tok, tmp_path / "cache")
    rendered = []
    for i, t in enumerate(texts):
        if i % 3 == 0:
            msgs = [{"role": "user", "content": t[:100]}, {"role": "assistant", "content": t[100:]}]
            rendered.append(tok.hf.apply_chat_template(msgs, tokenize=False))
        else:
            rendered.append(t)
    assert "<|im_start|>user\n" in rendered[0]  # the chat template really rendered it
    assert got == expected_stream(tok, rendered)
    assert (f.records, f.tokens) == (len(texts), len(got))
    assert tok.hf.bos_token_id is None or tok.hf.bos_token_id not in got


def test_parquet_txt_folder_and_saved_dataset(tmp_path, tok, texts):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts[:40], "other": list(range(40))}), tmp_path / "a.parquet")
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    for i, t in enumerate(texts[40:60]):
        (tmp_path / "txt" / ("sub" if i % 2 else "") / f"f{i:02d}.txt").write_text(t)
    (tmp_path / "single.txt").write_text(texts[60])
    datasets.Dataset.from_dict({"text": texts[61:80]}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[80:90]})}
                         ).save_to_disk(str(tmp_path / "saved_dict"))
    srcs = [tmp_path / "a.parquet", tmp_path / "txt", tmp_path / "single.txt",
            tmp_path / "saved", tmp_path / "saved_dict"]
    assert [ds.parse_source(str(s)).kind for s in srcs] == ["parquet", "txt-dir", "txt",
                                                            "saved", "saved"]
    f, got = tokens_of(srcs, tok, tmp_path / "cache")
    txt_order = sorted((tmp_path / "txt").rglob("*.txt"))
    want = texts[:40] + [p.read_text() for p in txt_order] + [texts[60]] + texts[61:90]
    assert got == expected_stream(tok, want) and f.records == len(want)


def test_cache_is_reused_and_keyed_by_data_and_tokenizer(tmp_path, tok, tok_dir, texts,
                                                         monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", texts[:20])
    first, got = tokens_of([path], tok, tmp_path / "cache")
    header = json.loads((first.folder / "header.json").read_text())
    assert header["tokens"] == len(got) and header["sources"][0]["sha256"]
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # written atomically

    def no_reading(*a, **k):
        raise AssertionError("the cached token file should have been reused")

    with monkeypatch.context() as m:
        m.setattr(ds, "records", no_reading)
        again, got2 = tokens_of([path], tok, tmp_path / "cache")
    assert again.folder == first.folder and got2 == got
    write_jsonl(path, texts[:21])  # other data: other key
    assert tokens_of([path], tok, tmp_path / "cache")[0].folder != first.folder
    other = load_tokenizer(train_tokenizer(tmp_path / "tok2", texts, vocab=350))
    assert tokens_of([path], other, tmp_path / "cache")[0].folder != first.folder


@pytest.mark.parametrize("content, match", [
    ('{"text": "a"}\n{"txt": "b"}\n', r"d\.jsonl:2: no 'text' field"),
    ('{"text": "a"}\n\n{"text": "b"\n', r"d\.jsonl:3: invalid JSON"),
    ('{"text": 5}\n', r"d\.jsonl:1: field 'text' must be a string"),
    ("\n\n", r"empty dataset"),
])
def test_bad_jsonl_is_named_with_its_line(tmp_path, tok, content, match):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ds.DataError, match=match):
        tokens_of([tmp_path / "d.jsonl"], tok, tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*"))  # no half-written cache entry


def test_source_parsing_and_offline_hub(tmp_path, monkeypatch):
    s = ds.parse_source("hf:HuggingFaceFW/fineweb-edu:sample-10BT:train")
    assert (s.kind, s.hf_name, s.hf_config, s.hf_split) == ("hf", "HuggingFaceFW/fineweb-edu",
                                                           "sample-10BT", "train")
    s = ds.parse_source("hf:wikitext")
    assert (s.hf_name, s.hf_config, s.hf_split) == ("wikitext", None, "train")
    for bad in ("hf:", "hf:a::b", "hf:a:b:c:d"):
        with pytest.raises(ds.DataError, match="hf:NAME"):
            ds.parse_source(bad)
    with pytest.raises(ds.DataError, match="no such file"):
        ds.parse_source(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ds.DataError, match="unknown format '.csv'"):
        ds.parse_source(str(tmp_path / "x.csv"))
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ds.DataError, match="cannot load 'no-such/dataset' from the Hugging Face"):
        ds._load_hf(ds.parse_source("hf:no-such/dataset"))


def test_vocab_larger_than_embedding_names_both(tok):
    check_fits(tok, tok.vocab_size)
    with pytest.raises(TokenizerError, match=rf"has {tok.vocab_size} tokens, more than the "
                       rf"model's embedding \({tok.vocab_size - 1} rows\)"):
        check_fits(tok, tok.vocab_size - 1)


def test_packed_sampling_is_stateless_sharded_and_covers_each_epoch():
    L, n = 9, 10
    split = PackedSplit(np.arange(n * L + 5, dtype=np.uint32), L, 0, n)  # 5-token tail dropped
    rows = torch.cat([global_batch(split, seed=3, index=i, batch=5, seq=L - 1) for i in range(4)])
    starts = rows[:, 0].tolist()
    assert all(s % L == 0 for s in starts) and max(starts) < n * L
    assert sorted(starts[:10]) == sorted(starts[10:]) == [i * L for i in range(n)]  # epochs
    assert starts[:10] != starts[10:]  # each epoch its own order
    assert torch.equal(rows[:, 1:] - rows[:, :1], torch.arange(1, L).expand(20, L - 1))
    b = global_batch(split, seed=3, index=7, batch=8, seq=L - 1)
    assert torch.equal(b, global_batch(split, seed=3, index=7, batch=8, seq=L - 1))
    assert not torch.equal(b, global_batch(split, seed=4, index=7, batch=8, seq=L - 1))
    for world in (1, 2, 4, 8):  # EP sizes: the ranks' slices make up the same global batch
        assert torch.equal(torch.cat([rank_slice(b, r, world) for r in range(world)]), b)
    held = PackedSplit(split.tokens, L, 7, 3)  # a held-out tail only samples its own sequences
    assert set(global_batch(held, seed=0, index=0, batch=6, seq=L - 1)[:, 0].tolist()) == \
        {7 * L, 8 * L, 9 * L}


# -- through the CLI: errors are one line, exit status 2, and OUT holds no finished run ----------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, texts):
    return model_with_tokenizer(tmp_path_factory.mktemp("model"), texts)


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command(1, args), env=env(), cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=300)


@pytest.mark.parametrize("case", ["missing_text", "seq_too_long", "vocab_too_large"])
def test_cli_bad_data_exits_2_with_one_line(tmp_path, model_dir, texts, tok_dir, case):
    data = write_jsonl(tmp_path / "d.jsonl", texts[:5])
    args = ["--init", str(model_dir), "--data", str(data), "--steps", "2", "--batch", "2",
            "--seq", "16", "--wandb", "disabled", "--out", str(tmp_path / "run")]
    if case == "missing_text":
        with open(data, "a") as f:
            f.write('{"content": "x"}\n')
        want = f"{data}:6: no 'text' field"
    elif case == "seq_too_long":
        args[args.index("--seq") + 1] = "100000"
        want = "sequence(s) of --seq + 1 = 100001"
    else:
        args = args[2:] + ["--preset", "tiny", "--tokenizer", str(tok_dir)]  # 256 rows
        want = "more than the model's embedding (256 rows)"
    p = _cli(args)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and want in last, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    out = tmp_path / "run"
    assert not (out / "result.json").exists() and not (out / "checkpoints").exists()
    assert not (out / "metrics.jsonl").exists() and not (out / "data.json").exists()


def test_char_bpe_of_the_demo_fits_256_rows_and_is_lossless(tmp_path, texts):
    from workbench.train.tokenizer import train_bpe

    tok = load_tokenizer(train_bpe(texts, tmp_path / "t", vocab_size=256, byte_level=False))
    assert tok.vocab_size == 256 and tok.hf.eos_token == "<|endoftext|>"
    check_fits(tok, 256)
    ids = tok.encode(texts[0])
    assert len(ids) < 0.8 * len(texts[0])  # merges were learned: fewer tokens than characters
    assert tok.hf.decode(ids) == texts[0]
    assert tok.hf.unk_token_id not in ids
