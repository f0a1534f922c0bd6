"""The run's tokenizer: the --init checkpoint's own (or --tokenizer SPEC), through transformers'
`AutoTokenizer`, offline (`local_files_only=True`) and without `trust_remote_code`, so a
checkpoint folder can never run code of its own. SPEC is a folder or a hub id
(`org/name[@revision]`, resolved by `workbench.source.resolve`: the Hugging Face cache first,
then, unless HF_HUB_OFFLINE is set, a download of the tokenizer files alone into the cache).

The digest of the tokenizer files keys the token cache (`workbench.train.datasets`): another
tokenizer, or an edited one, never reuses tokens it did not produce.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench._io import atomic_write_bytes
from workbench.source import TOKENIZER_FILES, Source, SourceError, resolve

__all__ = ["TOKENIZER_FILES", "Tokenizer", "TokenizerError", "check_fits", "copy_tokenizer",
           "files_digest", "load_tokenizer", "tokenizer_files", "train_bpe"]


class TokenizerError(ValueError):
    """The tokenizer is missing, unreadable or does not fit the model; the message names it."""


@dataclass(frozen=True)
class Tokenizer:
    path: str
    hf: Any  # transformers PreTrainedTokenizerBase
    eos_id: int
    vocab_size: int  # len(tokenizer): base vocabulary plus added tokens
    digest: str  # sha256 over the tokenizer files (names and contents)
    source: Source | None = None  # what the spec resolved to (hub id and commit, or folder)

    def encode(self, text: str) -> list[int]:
        """The documented convention's ids of one record: no special tokens (no BOS), no EOS."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def render_chat(self, messages: list, where: str) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerError(f"{where}: the record has chat 'messages' but the tokenizer "
                                 f"{self.path} has no chat template")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja errors: a malformed message list, a template bug
            raise TokenizerError(f"{where}: the chat template of {self.path} cannot render "
                                 f"these messages ({type(e).__name__}: {e})") from e


def tokenizer_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    return [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]


def files_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def load_tokenizer(path: str | Path | Source, *, flag: str = "--tokenizer") -> Tokenizer:
    """Load the tokenizer of folder or hub id `path` (see the module docstring); transformers
    reads it offline. `flag` names where the spec came from."""
    try:
        src = resolve(path, need="tokenizer")
    except SourceError as e:
        raise TokenizerError(f"{flag} {path}: {e}") from None
    if src.path is None:  # a URL: tokenizers are small, fetch them with `hf download`
        raise TokenizerError(f"{flag} {path}: a tokenizer must be a folder or a hub id, not a "
                             "URL")
    folder = Path(src.path)
    files = tokenizer_files(folder)
    if not folder.is_dir() or not files:
        raise TokenizerError(f"{flag} {folder}: no tokenizer files there (expected "
                             "tokenizer.json and tokenizer_config.json); pass --tokenizer PATH")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("a tokenizer needs transformers: pip install 'workbench[dev]'") from e
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                           trust_remote_code=False)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError... per format
        raise TokenizerError(f"{flag} {folder}: transformers cannot load this tokenizer "
                             f"({type(e).__name__}: {e})") from e
    if hf.eos_token_id is None:
        raise TokenizerError(f"{flag} {folder}: the tokenizer has no EOS token (eos_token in "
                             "tokenizer_config.json); records are separated by EOS")
    return Tokenizer(str(folder), hf, int(hf.eos_token_id), len(hf), files_digest(files), src)


def check_fits(tok: Tokenizer, embedding_rows: int) -> None:
    """Every id the tokenizer can emit must have an embedding row."""
    if tok.vocab_size > embedding_rows:
        raise TokenizerError(f"tokenizer {tok.path} has {tok.vocab_size} tokens, more than the "
                             f"model's embedding ({embedding_rows} rows)")


def copy_tokenizer(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files next to an export (atomic per file); returns their names."""
    names = []
    for f in tokenizer_files(src):
        atomic_write_bytes(Path(dst) / f.name, f.read_bytes())
        names.append(f.name)
    return names


def train_bpe(texts, folder: str | Path, *, vocab_size: int, byte_level: bool = True) -> Path:
    """Train a BPE tokenizer on `texts` with the `tokenizers` library and save it as a
    transformers tokenizer folder (tokenizer.json + tokenizer_config.json, EOS `<|endoftext|>`,
    a ChatML chat template). `byte_level=False` gives a character-level BPE (unknown characters
    map to `<unk>`), which fits vocabularies of 256 and less (byte-level needs 256 + specials)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ([] if byte_level else ["<unk>"])
    if byte_level:
        tk = RawTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tk = RawTokenizer(models.BPE(unk_token="<unk>"))
        # Words, whitespace runs and punctuation runs, every character kept (lossless).
        tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\w+|[^\w\s]+"), behavior="isolated")
        tk.decoder = decoders.Fuse()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tk.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                   unk_token=None if byte_level else "<unk>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}")
    fast.save_pretrained(str(folder))
    return Path(folder)
