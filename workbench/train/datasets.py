"""Real text for training: `--data` / `--val-data` sources, tokenized once into a cached token file.

Sources (each `--data PATH`, repeatable, read in the order given):
- `*.jsonl`: one JSON object per line with a `text` string, or a chat `messages` list rendered
  with the tokenizer's chat template (`apply_chat_template(messages, tokenize=False)`);
- `*.parquet`: a `text` column;
- `*.txt`: the whole file is one record; a folder of `*.txt` files (recursive, sorted by path);
- a folder written by `datasets.Dataset.save_to_disk` (its `train` split if it is a DatasetDict)
  with a `text` or `messages` column;
- `hf:NAME[:CONFIG][:SPLIT]`: `datasets.load_dataset(NAME, CONFIG, split=SPLIT)` from the
  Hugging Face hub (online only; SPLIT defaults to train).

Convention (docs/data.md): every record is tokenized without special tokens, one EOS id is
appended, the records are concatenated in source order into one stream, and the stream is cut into
sequences of `seq + 1` tokens; only the incomplete tail is dropped, nothing is padded.
A record longer than `PIECE_CHARS` characters is tokenized in pieces (`pieces`: each cut
before the last space that a letter follows, else at the limit) and its EOS follows its last
piece; `.txt` files and JSONL lines longer than `LONG_LINE` are read in pieces too, so memory
does not grow with a record's size.

Cache (`workbench.train.token_cache`): the stream is written once as raw little-endian uint32
(`tokens.bin`) plus `header.json` (counts, the digests of the inputs and of the tokens), under
`CACHE/<key>/`, verified on use and rebuilt when damaged. CACHE is `--token-cache DIR`, else
`<parent of --out>/.token-cache-<uid>`, a folder only its user can write (0700); a cache folder
another user owns or can write is refused. No pickle anywhere: the header is JSON, the tokens
raw integers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench._io import writing
from workbench.train import jsonl_stream, token_cache
from workbench.train.data import PackedSplit, load_corpus
from workbench.train.distributed import DistInfo, on_main
from workbench.train.token_cache import DTYPE, CacheError, TokenFile
from workbench.train.tokenizer import Tokenizer, TokenizerError, check_fits, load_tokenizer

DATA_JSON = "data.json"
# Without --val-data, this share of the train sequences (the last ones, at least one) is held out.
HOLDOUT_FRACTION = 0.02
# A tokenizer holds many times the size of the text it encodes at once: records are cut into
# pieces of at most PIECE_CHARS characters, and at most _ENCODE_BATCH pieces or _BATCH_CHARS
# characters go to it at once, so memory does not grow with a record's size.
PIECE_CHARS = 1 << 16
_ENCODE_BATCH = 512
_BATCH_CHARS = 1 << 18
# JSONL lines longer than this are parsed as a stream (their text in parts), not by json.loads.
LONG_LINE = 1 << 20
# JSON's \uD800-\uDFFF escapes can leave a lone surrogate in a string: not Unicode, so no
# tokenizer encodes it (the Rust tokenizers refuse the whole batch with a TypeError).
_SURROGATE = re.compile("[\ud800-\udfff]")
# Tokenization options: part of every cache key, so other options never reuse tokens.
OPTIONS = {"piece_chars": PIECE_CHARS, "cut": "before the last space a letter follows"}


class DataError(ValueError):
    """A data source is unusable; the message names the file (and line or row)."""


@dataclass(frozen=True)
class Source:
    spec: str  # as given on the command line
    kind: str  # jsonl | parquet | txt | txt-dir | saved | hf
    path: Path | None = None
    hf_name: str = ""
    hf_config: str | None = None
    hf_split: str = "train"


def parse_source(spec: str) -> Source:
    if spec.startswith("hf:"):
        parts = spec[3:].split(":")
        if not parts[0] or len(parts) > 3 or any(p == "" for p in parts):
            raise DataError(f"--data {spec}: expected hf:NAME[:CONFIG][:SPLIT]")
        return Source(spec, "hf", hf_name=parts[0], hf_config=parts[1] if len(parts) > 1 else None,
                      hf_split=parts[2] if len(parts) > 2 else "train")
    path = Path(spec)
    if path.is_dir():
        if any((path / n).is_file() for n in ("dataset_info.json", "state.json",
                                              "dataset_dict.json")):
            return Source(spec, "saved", path)
        return Source(spec, "txt-dir", path)
    if not path.is_file():
        raise DataError(f"--data {spec}: no such file or folder")
    kind = {".jsonl": "jsonl", ".parquet": "parquet", ".txt": "txt"}.get(path.suffix)
    if kind is None:
        raise DataError(f"--data {spec}: unknown format {path.suffix!r} (expected .jsonl, "
                        ".parquet, .txt, a folder of .txt files or a datasets.save_to_disk folder)")
    return Source(spec, kind, path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _folder_files(root: Path, pattern: str) -> list[Path]:
    real = root.resolve()
    files = []
    for p in sorted(root.rglob(pattern)):
        # A symlink must not lead the reader outside the folder it was given.
        if p.is_file() and p.resolve().is_relative_to(real):
            files.append(p)
    return files


def source_digest(src: Source) -> str:
    if src.kind == "hf":
        return hashlib.sha256(f"hf/{src.hf_name}/{src.hf_config}/{src.hf_split}".encode()
                              ).hexdigest()
    if src.kind in ("txt-dir", "saved"):
        h = hashlib.sha256()
        for f in _folder_files(src.path, "*"):
            h.update(str(f.relative_to(src.path)).encode() + b"\0"
                     + bytes.fromhex(_sha256_file(f)))
        return h.hexdigest()
    return _sha256_file(src.path)


# ---------------------------------------------------------------------------------------------
# Records: (text, where) pairs; `where` names the file and line/row for error messages.


def _record_text(obj: Any, where: str, tok: Tokenizer) -> str:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise DataError(f"{where}: field 'text' must be a string, got "
                            f"{type(obj['text']).__name__}")
        return obj["text"]
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m
                                                 and "content" in m for m in msgs):
            raise DataError(f"{where}: field 'messages' must be a list of {{role, content}}")
        try:
            return tok.render_chat(msgs, where)
        except TokenizerError as e:
            raise DataError(str(e)) from e
    raise DataError(f"{where}: no 'text' field (nor chat 'messages'); keys: {sorted(obj)[:8]}")


def _jsonl(path: Path, tok: Tokenizer) -> Iterator[tuple[str | Iterable[str], str]]:
    """Lines up to LONG_LINE bytes through json.loads; longer ones streamed
    (`jsonl_stream`): their text comes in parts, read block by block."""
    with open(path, "rb") as f:
        n = 0
        while raw := f.readline(LONG_LINE):
            n += 1
            where = f"{path}:{n}"
            if len(raw) == LONG_LINE and not raw.endswith(b"\n"):
                yield _streamed(f, raw, where, tok), where
                continue
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{where}: invalid JSON ({e})") from e
            except RecursionError:
                raise DataError(f"{where}: JSON nested too deeply to read") from None
            yield _record_text(obj, where, tok), where


def _streamed(f, first: bytes, where: str, tok: Tokenizer) -> Iterator[str]:
    def chat(messages):
        return _record_text({"messages": messages}, where, tok)

    try:
        yield from jsonl_stream.text_parts(f, first, chat)
    except KeyError as e:
        raise DataError(f"{where}: no 'text' field (nor chat 'messages'); keys: "
                        f"{e.args[0]}") from None
    except TypeError as e:
        raise DataError(f"{where}: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError included
        raise DataError(f"{where}: invalid JSON ({e})") from e
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read") from None


def _unicode(parts: Iterable[str], where: str) -> Iterator[str]:
    """`parts` as they are, or DataError at a lone surrogate (see _SURROGATE)."""
    for part in parts:
        m = _SURROGATE.search(part)
        if m is not None:
            raise DataError(f"{where}: the text holds a lone surrogate {m.group()!r} (a \\u"
                            f"{ord(m.group()):04x} escape without its pair): not Unicode, no "
                            "tokenizer can encode it; fix or drop the record")
        yield part


def _parquet(path: Path) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow.ArrowInvalid and friends
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{path}: no 'text' column (columns: {pf.schema_arrow.names[:8]})")
    row = 0
    for rb in pf.iter_batches(columns=["text"], batch_size=4096):
        for value in rb.column(0).to_pylist():
            if not isinstance(value, str):
                raise DataError(f"{path}: row {row}: 'text' is {type(value).__name__}, not a "
                                "string")
            yield value, f"{path}: row {row}"
            row += 1


def _txt(path: Path) -> Iterator[tuple[Iterable[str], str]]:
    yield _txt_parts(path), str(path)


def _txt_parts(path: Path) -> Iterator[str]:
    """The file's text in pieces of PIECE_CHARS characters (universal newlines, as
    `Path.read_text` reads it), never the whole file at once."""
    try:
        with open(path, encoding="utf-8") as f:
            while part := f.read(PIECE_CHARS):
                yield part
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e


def _hf_rows(ds: Any, where: str, tok: Tokenizer) -> Iterator[tuple[str, str]]:
    cols = ds.column_names
    if "text" not in cols and "messages" not in cols:
        raise DataError(f"{where}: no 'text' or 'messages' column (columns: {cols[:8]})")
    for i, row in enumerate(ds):
        yield _record_text(row, f"{where}: row {i}", tok), f"{where}: row {i}"


def _load_saved(src: Source) -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("dataset folders need the datasets package: pip install datasets") from e
    try:
        ds = datasets.load_from_disk(str(src.path))
    except Exception as e:  # datasets raises FileNotFoundError/ValueError per layout
        raise DataError(f"{src.path}: not a datasets.save_to_disk folder ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{src.path}: a DatasetDict without a 'train' split "
                            f"(splits: {sorted(ds)})")
        ds = ds["train"]
    return ds


def _load_hf(src: Source) -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("hf: sources need the datasets package: pip install datasets") from e
    try:
        return datasets.load_dataset(src.hf_name, src.hf_config, split=src.hf_split)
    except Exception as e:  # offline: ConnectionError / DatasetNotFoundError / OSError
        raise DataError(f"--data {src.spec}: cannot load {src.hf_name!r} from the Hugging Face "
                        f"hub ({type(e).__name__}: {str(e)[:200]}); without network, save it "
                        "with datasets.save_to_disk elsewhere and pass that folder") from e


def records(src: Source, tok: Tokenizer) -> Iterator[tuple[str | Iterable[str], str]]:
    """(text, where) per record; a `.txt` record's text comes as an iterable of parts."""
    if src.kind == "jsonl":
        yield from _jsonl(src.path, tok)
    elif src.kind == "parquet":
        yield from _parquet(src.path)
    elif src.kind == "txt":
        yield from _txt(src.path)
    elif src.kind == "txt-dir":
        files = _folder_files(src.path, "*.txt")
        if not files:
            raise DataError(f"{src.path}: a folder with no .txt files (nor a "
                            "datasets.save_to_disk folder)")
        for f in files:
            yield from _txt(f)
    elif src.kind == "saved":
        yield from _hf_rows(_load_saved(src), str(src.path), tok)
    else:
        yield from _hf_rows(_load_hf(src), src.spec, tok)


# ---------------------------------------------------------------------------------------------
# Pieces and the token file.


def pieces(parts: Iterable[str], limit: int = PIECE_CHARS) -> Iterator[str]:
    """The text of one record, given as `parts`, re-cut into pieces of at most `limit`
    characters. A cut lies before the last space within the limit that a letter follows (in
    the byte-level pre-tokenizers of GPT-2, Llama 3 and Qwen such a space starts a pre-token,
    so the pieces' ids equal the whole text's), else, when the window has none in its second
    half, at the limit. An empty record is one empty piece."""
    buf = ""
    emitted = False
    for part in parts:
        buf += part
        while len(buf) > limit:
            cut = _cut(buf, limit)
            yield buf[:cut]
            buf = buf[cut:]
            emitted = True
    if buf or not emitted:
        yield buf


def _cut(buf: str, limit: int) -> int:
    p = limit
    while (p := buf.rfind(" ", limit // 2, p)) > 0:
        if buf[p + 1].isalpha():
            return p
    return limit


def _encode(pending: list[tuple[str, bool]], tok: Tokenizer, out, bar) -> int:
    """Append the pieces' ids, with EOS after each piece that ends a record; returns the
    tokens written."""
    ids = tok.hf([p for p, _ in pending], add_special_tokens=False,
                 return_attention_mask=False, return_token_type_ids=False)["input_ids"]
    flat: list[int] = []
    for row, (_, last) in zip(ids, pending):
        flat += row
        if last:
            flat.append(tok.eos_id)
    np.asarray(flat, dtype=DTYPE).tofile(out)
    bar.update(sum(last for _, last in pending))
    pending.clear()
    return len(flat)


def _inputs(digests: list[str], tok: Tokenizer) -> dict:
    return {"options": OPTIONS, "tokenizer": tok.digest, "eos": tok.eos_id,
            "sources": digests}


def check_cache(cache: Path) -> Path:
    """The cache folder, created private (0700) when missing; DataError when another user
    owns it or others can write it (they could plant tokens)."""
    try:
        return token_cache.private_dir(cache, "token cache")
    except CacheError as e:
        raise DataError(str(e)) from None


def tokenize_sources(sources: list[Source], tok: Tokenizer, cache: Path, *, name: str,
                     show_progress: bool = True) -> TokenFile:
    """The token file of `sources` (in order) under `cache`: the verified entry when there
    is one, else written now (a damaged entry is rebuilt, with one line saying so)."""
    from tqdm.auto import tqdm

    check_cache(cache)
    digests = [source_digest(s) for s in sources]
    inputs = _inputs(digests, tok)
    digest = token_cache.inputs_digest(inputs)
    folder = token_cache.entry_folder(cache, digest)
    found = token_cache.open_entry(folder, digest)
    if isinstance(found, TokenFile):
        return found
    if found is not None:
        print(f"[data] token cache {folder} is damaged ({found}): rebuilding", flush=True)
    tmp = token_cache.new_entry(cache, folder)
    n_tokens = n_records = 0
    try:
        with writing(tmp / token_cache.TOKENS), open(tmp / token_cache.TOKENS, "wb") as out, \
                tqdm(desc=f"tokenize {name}", unit="rec", disable=not show_progress) as bar:
            pending: list[tuple[str, bool]] = []
            chars = 0
            for src in sources:
                for text, where in records(src, tok):
                    n_records += 1
                    parts = _unicode((text,) if isinstance(text, str) else text, where)
                    for piece, last in _with_last(pieces(parts)):
                        pending.append((piece, last))
                        chars += len(piece)
                        if len(pending) == _ENCODE_BATCH or chars >= _BATCH_CHARS:
                            n_tokens += _encode(pending, tok, out, bar)
                            chars = 0
            if pending:
                n_tokens += _encode(pending, tok, out, bar)
            out.flush()
            os.fsync(out.fileno())
        if n_records == 0:
            raise DataError(f"{name} data {[s.spec for s in sources]}: empty dataset (no records)")
        token_cache.seal_entry(tmp, {
            "dtype": "uint32-le", "tokens": n_tokens, "records": n_records,
            "eos_id": tok.eos_id, "tokenizer": tok.path, "tokenizer_digest": tok.digest,
            "options": OPTIONS, "inputs_sha256": digest,
            "sources": [{"source": s.spec, "sha256": d} for s, d in zip(sources, digests)]})
        token_cache.commit_entry(tmp, folder, damaged=found is not None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    entry = token_cache.open_entry(folder, digest)
    if not isinstance(entry, TokenFile):
        raise DataError(f"token cache {folder}: the entry just written does not verify ({entry})")
    return entry


def _with_last(items: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """(item, whether it is the last) for each item, looking one ahead."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


# ---------------------------------------------------------------------------------------------
# What the loop calls.


@dataclass(frozen=True)
class TrainData:
    train: Any  # PackedSplit, or the byte corpus' uint8 tensor
    val: Any
    info: dict  # OUT/data.json (empty for the byte corpus)


def cache_dir(cfg) -> Path:
    """`--token-cache`, else a folder of this user's next to the run folder: on the file system
    every rank already shares (the run folder's), and private (`check_cache`)."""
    if cfg.token_cache:
        return Path(cfg.token_cache)
    return Path(cfg.out).resolve().parent / f".token-cache-{os.geteuid()}"


def tokenizer_path(cfg) -> str:
    return cfg.tokenizer or cfg.init


def _prepare(cfg, vocab_rows: int, show_progress: bool) -> dict:
    """Rank 0's part: load, check and tokenize; returns data.json."""
    if not cfg.tokenizer and not cfg.init:
        raise TokenizerError("--data needs a tokenizer: pass --tokenizer PATH or --init CKPT "
                             "(its folder's tokenizer.json)")
    tok = load_tokenizer(tokenizer_path(cfg), flag="--tokenizer" if cfg.tokenizer else "--init")
    check_fits(tok, vocab_rows)
    cache = cache_dir(cfg)
    train_f = tokenize_sources([parse_source(s) for s in cfg.data], tok, cache, name="train",
                               show_progress=show_progress)
    val_f = (tokenize_sources([parse_source(s) for s in cfg.val_data], tok, cache, name="val",
                              show_progress=show_progress) if cfg.val_data else None)
    L = cfg.seq + 1
    n_train = train_f.tokens // L
    if val_f is None:
        n_val = max(1, int(n_train * HOLDOUT_FRACTION)) if cfg.val_every else 0
        n_fit = n_train - n_val
    else:
        n_val, n_fit = val_f.tokens // L, n_train
        if n_val == 0 and cfg.val_every:
            raise DataError(f"--val-data {list(cfg.val_data)}: {val_f.tokens} tokens, fewer than "
                            f"one sequence of --seq + 1 = {L}")
    if n_fit <= 0:
        raise DataError(f"--data {list(cfg.data)}: {train_f.tokens} tokens make {n_train} "
                        f"sequence(s) of --seq + 1 = {L}; training needs at least "
                        f"{1 + (n_val if val_f is None else 0)} (lower --seq or add data)")
    return {
        "train_tokens": train_f.tokens, "train_records": train_f.records,
        "val_tokens": val_f.tokens if val_f else n_val * L,
        "val_records": val_f.records if val_f else None,
        "val_source": "val-data" if val_f else f"last {n_val} train sequences (held out)",
        "train_sequences": n_fit, "val_sequences": n_val, "seq_len": L,
        "tokenizer": str(Path(tok.path).resolve()), "tokenizer_digest": tok.digest,
        "tokenizer_source": tok.source.record() if tok.source is not None else None,
        "eos_id": tok.eos_id, "vocab_size": tok.vocab_size,
        "train_cache": str(train_f.folder), "val_cache": str(val_f.folder) if val_f else None,
        "train_sources": train_f.header["sources"],
        "val_sources": val_f.header["sources"] if val_f else [],
    }


def _check_same_data(out: Path, new: dict) -> None:
    """--resume must train on the data the checkpoint was trained on: the data position is a
    function of (seed, step) only, so the same step of other data would resume silently wrong."""
    old_path = out / DATA_JSON
    if not old_path.is_file():
        return
    old = json.loads(old_path.read_text())
    keys = ("train_sources", "val_sources", "tokenizer_digest", "seq_len")
    if any(old.get(k) != new.get(k) for k in keys):
        raise DataError(f"{old_path}: --resume with other data, tokenizer or --seq than the run "
                        "was started with; use the same --data/--val-data/--tokenizer/--seq or a "
                        "new --out")


def load_train_data(cfg, info: DistInfo, vocab_rows: int) -> TrainData:
    """Collective. No --data: the shipped byte corpus. Else rank 0 tokenizes (once, cached),
    the others wait and open the same files; a failure on rank 0 fails every rank."""
    if not cfg.data:
        corpus = load_corpus()
        return TrainData(corpus.train, corpus.val, {})

    def prepare() -> dict:
        meta = _prepare(cfg, vocab_rows, show_progress=True)
        if cfg.resume:
            _check_same_data(Path(cfg.out), meta)
        return meta

    # Rank 0's result (or its error) reaches every rank, so no rank re-reads or re-hashes the
    # data; the others wait for it however long tokenizing takes (not a timed collective), and
    # none waits forever after a failure on rank 0, which reports it (PeerFailed elsewhere).
    meta = on_main(info, prepare)
    train_tokens = TokenFile(Path(meta["train_cache"]), meta["train_tokens"],
                             meta["train_records"], {}).memmap()
    L = meta["seq_len"]
    train = PackedSplit(train_tokens, L, 0, meta["train_sequences"])
    if meta["val_sequences"] == 0:
        val = None
    elif meta["val_cache"] is None:
        val = PackedSplit(train_tokens, L, meta["train_sequences"], meta["val_sequences"])
    else:
        val = PackedSplit(TokenFile(Path(meta["val_cache"]), meta["val_tokens"],
                                    meta["val_records"], {}).memmap(), L, 0, meta["val_sequences"])
    return TrainData(train, val, meta)
