"""The token cache is verified, rebuilt when damaged, private by default; long records are
tokenized in bounded memory under the documented cut convention (docs/data.md)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, env
from realdata import corpus_texts, train_tokenizer, write_jsonl

from workbench.train import datasets as ds
from workbench.train.config import TrainConfig
from workbench.train.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def texts():
    return corpus_texts(120, 400)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, texts):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), texts)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def expected_stream(tok, texts):
    out = []
    for t in texts:
        out += tok.hf.encode(t, add_special_tokens=False) + [tok.hf.eos_token_id]
    return out


def tokenize(path, tok, cache):
    return ds.tokenize_sources([ds.parse_source(str(path))], tok, cache, name="train",
                               show_progress=False)


@pytest.fixture
def cached(tmp_path, tok, texts):
    """(source, cache folder, its one entry, the stream the convention gives)."""
    path = write_jsonl(tmp_path / "d.jsonl", texts[:30])
    cache = tmp_path / "cache"
    f = tokenize(path, tok, cache)
    want = expected_stream(tok, texts[:30])
    assert f.memmap().tolist() == want
    return path, cache, f.folder, want


def test_the_header_carries_the_content_and_inputs_digests(cached, tok):
    _, _, folder, want = cached
    header = json.loads((folder / "header.json").read_text())
    raw = (folder / "tokens.bin").read_bytes()
    assert header["tokens_sha256"] == hashlib.sha256(raw).hexdigest()
    assert np.frombuffer(raw, dtype="<u4").tolist() == want
    assert folder.name == header["inputs_sha256"][:32]
    assert header["tokenizer_digest"] == tok.digest


def _rebuilt(path, tok, cache, want, capsys) -> str:
    f = tokenize(path, tok, cache)
    assert f.memmap().tolist() == want
    lines = [x for x in capsys.readouterr().out.splitlines() if "token cache" in x]
    assert len(lines) == 1, lines
    return lines[0]


def _flip_same_size(folder):
    p = folder / "tokens.bin"
    data = bytearray(p.read_bytes())
    data[40] ^= 0x01  # one id, one bit: the file keeps its size
    os.chmod(p, 0o600)
    p.write_bytes(bytes(data))


DAMAGE = {
    "same size, other content": _flip_same_size,
    "truncated tokens": lambda f: os.truncate(f / "tokens.bin", 12),
    "tokens missing": lambda f: (f / "tokens.bin").unlink(),
    "header not JSON": lambda f: (f / "header.json").write_text("{oops"),
    "header missing": lambda f: (f / "header.json").unlink(),
    "header without digests": lambda f: (f / "header.json").write_text(json.dumps(
        {"version": 2, "tokens": 3, "records": 1})),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_rebuilt_with_one_line(cached, tok, capsys, damage):
    path, cache, folder, want = cached
    capsys.readouterr()
    DAMAGE[damage](folder)
    line = _rebuilt(path, tok, cache, want, capsys)
    assert "damaged" in line and "rebuilding" in line and str(folder) in line
    # and the rebuilt entry is trusted again without a word
    assert tokenize(path, tok, cache).memmap().tolist() == want
    assert "token cache" not in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]  # nothing left aside


def test_an_entry_planted_under_another_key_is_not_used(tmp_path, tok, texts, capsys):
    cache = tmp_path / "cache"
    a = tokenize(write_jsonl(tmp_path / "a.jsonl", texts[:10]), tok, cache)
    path_b = write_jsonl(tmp_path / "b.jsonl", texts[10:20])
    b = tokenize(path_b, tok, cache)
    # b's key now holds a's consistent entry (header and tokens agree with each other)
    shutil.rmtree(b.folder)
    shutil.copytree(a.folder, b.folder)
    capsys.readouterr()
    line = _rebuilt(path_b, tok, cache, expected_stream(tok, texts[10:20]), capsys)
    assert "other inputs" in line


def test_a_copied_cache_is_hashed_once_then_trusted(cached, tok, monkeypatch):
    path, cache, _, want = cached
    moved = cache.parent / "moved"
    shutil.copytree(cache, moved)  # new inodes and times: the seal breaks
    hashed = []
    real = ds.token_cache.sha256_file
    monkeypatch.setattr(ds.token_cache, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert tokenize(path, tok, moved).memmap().tolist() == want
    assert len(hashed) == 1  # verified in full once...
    assert tokenize(path, tok, moved).memmap().tolist() == want
    assert len(hashed) == 1  # ...then sealed again


def test_default_cache_is_private_to_the_user(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "group" / "run"), data=("x.jsonl",))
    cache = ds.cache_dir(cfg)
    assert cache.parent == (tmp_path / "group").resolve()
    ds.check_cache(cache)  # what tokenize_sources does first
    st = cache.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    # another user of the same group folder gets their own
    assert str(os.geteuid()) in cache.name


def test_a_cache_others_can_write_or_own_is_refused(tmp_path, tok, texts, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", texts[:5])
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ds.DataError, match="writable by group or others"):
        tokenize(path, tok, shared)
    os.chmod(shared, 0o755)
    tokenize(path, tok, shared)  # readable by others is private enough: nobody can plant
    owner = shared.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(ds.DataError, match="belongs to another user"):
        tokenize(path, tok, shared)


# ---------------------------------------------------------------------------------------------
# Long records: tokenized in pieces, in bounded memory.


def test_a_long_record_gives_the_whole_records_ids(tmp_path, tok, texts, monkeypatch):
    # 200k characters, cut into several pieces; the test tokenizer's pre-tokenizer is GPT-2's
    # byte-level regex, for which the convention's cuts fall on pre-token boundaries. The JSONL
    # line is streamed (a low LONG_LINE and small blocks put every boundary somewhere).
    monkeypatch.setattr(ds, "LONG_LINE", 4096)
    monkeypatch.setattr(ds.jsonl_stream, "BLOCK", 1000)
    long_text = "".join(texts) * 5
    assert len(long_text) > 3 * ds.PIECE_CHARS
    (tmp_path / "long.txt").write_text(long_text)
    (tmp_path / "short.txt").write_text(texts[0])
    write_jsonl(tmp_path / "long.jsonl", [texts[1], long_text, texts[2]])
    for src, records in (("long.txt", [long_text]), ("long.jsonl", [texts[1], long_text,
                                                                    texts[2]])):
        f = tokenize(tmp_path / src, tok, tmp_path / "cache")
        got = f.memmap().tolist()
        assert got == expected_stream(tok, records), src
        assert got.count(tok.eos_id) == len(records) == f.records


def test_cuts_follow_the_documented_rule():
    limit = 20
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"
    parts = list(ds.pieces([text[:7], text[7:30], text[30:]], limit))
    assert "".join(parts) == text
    assert all(len(p) <= limit for p in parts)
    # each cut lies before a space that a letter follows: the last such within the limit
    for nxt in parts[1:]:
        assert nxt[0] == " " and nxt[1].isalpha()
    assert parts[0] == "alpha beta gamma"
    # no such place within the limit: a hard cut at the limit
    assert list(ds.pieces(["x" * 45], limit)) == ["x" * 20, "x" * 20, "x" * 5]
    assert list(ds.pieces([""], limit)) == [""]  # an empty record is still one record


MEM_WORKER = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from workbench.train import datasets as ds
    from workbench.train.tokenizer import load_tokenizer

    tok_dir, src, cache = sys.argv[1:4]
    tok = load_tokenizer(tok_dir)
    tok.hf("warm up the tokenizer", add_special_tokens=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    f = ds.tokenize_sources([ds.parse_source(src)], tok, Path(cache), name="t",
                            show_progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"tokens": f.tokens, "grew_kib": peak - base}))
""")


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_peak_memory_does_not_grow_with_record_size(tmp_path, tok_dir, texts, kind):
    # One 1 MiB record. Tokenized whole, the tokenizer alone holds ~200 bytes per character
    # (a 50 MB record peaked at 9 GB); in pieces the growth stays far below the record's
    # whole-record cost whatever its size.
    record = ("".join(texts) * 30)[: 1 << 20]
    src = tmp_path / f"big.{kind}"
    if kind == "txt":
        src.write_text(record)
    else:
        src.write_text(json.dumps({"text": record}) + "\n")
    proc = subprocess.run([sys.executable, "-c", MEM_WORKER, str(tok_dir), str(src),
                           str(tmp_path / "cache")], env=env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tokens"] > 100_000
    assert out["grew_kib"] < 64 * 1024, out  # MiB-scale pieces, not 200x the record


def test_streamed_jsonl_lines_read_as_json_loads_reads_them(monkeypatch):
    import io
    import random

    from workbench.train import jsonl_stream

    monkeypatch.setattr(jsonl_stream, "BLOCK", 7)  # every block boundary, every escape split
    rng = random.Random(0)
    alphabet = ["a", " ", "\n", '"', "\\", "\t", "\u00e9", "\u20ac", "\U0001F600", "\ud83d",
                "\ude00", "\x01", "/", "z"]
    for trial in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        obj = ({"a": [1, {"b": 'x"y]'}, None], "text": text, "z": 3.5e3} if trial % 3
               else {"text": text})
        line = json.dumps(obj, ensure_ascii=bool(trial % 2)).encode("utf-8", "surrogatepass")
        parts = list(jsonl_stream.text_parts(io.BytesIO(line[5:] + b"\n"), line[:5], None))
        assert "".join(parts) == json.loads(line)["text"], line


@pytest.mark.parametrize("line, match", [
    (b'{"text": 5, "pad": "%s"}', "field 'text' must be a string"),
    (b'{"pad": "%s", "txt": "b"}', "no 'text' field"),
    (b'{"text": "a", "pad": "%s"', "invalid JSON"),
    (b'{"text": "a", "pad": [1}, "x": "%s"}', "invalid JSON"),
    (b'{"text": "a\\q", "pad": "%s"}', "invalid JSON"),
])
def test_a_damaged_long_line_is_named_with_its_line(tmp_path, tok, line, match, monkeypatch):
    monkeypatch.setattr(ds, "LONG_LINE", 64)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + line.replace(b"%s", b"p" * 200) + b"\n")
    with pytest.raises(ds.DataError, match=rf"d\.jsonl:2: .*{match}"):
        tokenize(path, tok, tmp_path / "cache")


def test_a_long_chat_record_is_rendered_whole(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(ds, "LONG_LINE", 64)
    msgs = [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "ok"}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": 1, "messages": msgs}) + "\n")
    got = tokenize(path, tok, tmp_path / "cache").memmap().tolist()
    assert got == expected_stream(tok, [tok.hf.apply_chat_template(msgs, tokenize=False)])
