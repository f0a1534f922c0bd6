"""Typed errors for checkpoint reading.

Every error names the file and, where one is involved, the tensor, so a user staring at a
1.5 TB checkpoint knows exactly which shard or which companion tensor is wrong.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """Base class: something about a checkpoint on disk is wrong or unsupported."""

    def __init__(self, message: str, *, path: str | Path | None = None, tensor: str | None = None):
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        self.detail = message
        where = []
        if self.path is not None:
            where.append(f"file {self.path}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message)

    def one_line(self, limit: int = 400) -> str:
        """The message as one printable line (a CLI prints this): control characters from
        hostile names escaped, cut to `limit` characters."""
        text = str(self)
        if isinstance(self, ValidationError) and self.errors:
            text = f"{len(self.errors)} problems, the first: {self.errors[0]}"
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
        return text if len(text) <= limit else text[: limit - 3] + "..."


class MissingFileError(CheckpointError):
    """A file the checkpoint needs (shard, config, index) does not exist."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor (stored or logical) asked for by name does not exist."""

    __str__ = Exception.__str__  # KeyError would quote the message


class UnsafePathError(CheckpointError):
    """A shard name would leave the checkpoint folder (absolute, `..`, symlink out)."""


class CorruptShardError(CheckpointError):
    """A safetensors shard is empty, truncated, or has an inconsistent header."""


class RemoteReadError(CheckpointError):
    """A remote file could not be read: an HTTP error, a short or wrong reply, retries spent."""


class ConfigError(CheckpointError):
    """config.json / hf_quant_config.json / the index JSON is malformed or inconsistent."""


class UnknownFormatError(ConfigError):
    """A quant_method / format / quant_algo the workbench does not know."""


class FormatMismatchError(ConfigError):
    """The config names a format that the stored tensors do not carry."""


class MissingCompanionError(CheckpointError):
    """A quantized weight lacks its packed data, scale or global scale companion."""


class ShapeMismatchError(CheckpointError):
    """A packed tensor or scale has a shape that does not fit its companions."""


class DtypeMismatchError(CheckpointError):
    """A packed tensor or scale has a dtype its format does not use."""


class UncoveredTensorError(CheckpointError):
    """A packed tensor exists that the quantization config does not cover (or vice versa)."""


class ValidationError(CheckpointError):
    """Several problems found at once; `.errors` lists each (each names file and tensor)."""

    def __init__(self, errors: list[CheckpointError], *, path: str | Path | None = None):
        self.errors = list(errors)
        lines = [f"{len(self.errors)} problem(s) found:"]
        lines += [f"  - {type(e).__name__}: {e}" for e in self.errors[:50]]
        if len(self.errors) > 50:
            lines.append(f"  ... and {len(self.errors) - 50} more")
        first = self.errors[0] if self.errors else None
        super().__init__("\n".join(lines), path=path,
                         tensor=first.tensor if first is not None else None)
