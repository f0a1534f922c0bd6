"""`open_checkpoint`: one object over a checkpoint, local or remote (see the package docstring)."""

from __future__ import annotations

import os
from pathlib import Path

from ..scope import QuantScope
from ..source import Source, SourceError, resolve
from .config import load_quant_config
from .errors import CheckpointError, MissingFileError, MissingTensorError, ValidationError
from .experts import ExpertRecord, expert_records
from .index import ShardIndex
from .layouts import FMT_OF_CODEC, LogicalSpec, build
from .remote import RemoteFolder, RemoteOptions
from .views import LogicalTensor, StackView, StoredView
from workbench.formats import Recipe


class Checkpoint:
    """A validated, lazily read checkpoint. Build with `open_checkpoint(spec)`.

    ``path`` is the folder (a `RemotePath` URL for a remote one), ``source`` what the spec
    resolved to (`workbench.source.Source`), ``is_local`` whether every read is a local one."""

    def __init__(self, path: str | os.PathLike | None = None, *, source: Source | None = None,
                 remote: RemoteOptions | None = None):
        if source is None:
            source = Source(os.fspath(path), "local", Path(path))
        self.source = source
        if source.is_local:
            self.path = Path(source.path)
            self.index = ShardIndex(self.path)
            folder = None
        else:
            folder = RemoteFolder(source, remote)
            self.path = folder.root
            self.index = ShardIndex(remote=folder)
        try:
            self._open(folder)
        except BaseException:
            self.index.close()
            raise

    @property
    def is_local(self) -> bool:
        return self.index.is_local

    @property
    def fetch_stats(self):
        """Bytes fetched and served from the range cache (`remote.FetchStats`); None when
        local."""
        return None if self.index.remote is None else self.index.remote.stats

    def _open(self, folder) -> None:
        self.config, self.quant_config = load_quant_config(self.path, folder)
        built = build(self.index, self.quant_config, self.config.get("model_type"))
        raise_all(built.problems, self.path)
        self.layout: str = built.layout
        self.scope: QuantScope = built.scope
        self.extras: list[str] = built.extras
        self._specs: dict[str, LogicalSpec] = built.logicals
        shapes = {n: s.shape for n, s in self._specs.items()}
        try:
            interleaved = {n for n, s in self._specs.items() if s.interleaved}
            self._records = expert_records(shapes, interleaved)
        except ValueError as e:
            raise CheckpointError(str(e), path=self.path) from e
        self._by_key: dict[tuple, ExpertRecord] = {}
        dup = []
        for r in self._records:
            k = (r.kind, r.layer, r.expert, r.proj)
            if k in self._by_key:
                dup.append(CheckpointError(f"expert {r.key} stored twice: {r.name!r} and "
                                           f"{self._by_key[k].name!r}", path=self.path,
                                           tensor=r.name))
            self._by_key[k] = r
        raise_all(dup, self.path)

    # -- metadata ---------------------------------------------------------------------------
    def logical_names(self) -> list[str]:
        return list(self._specs)

    def spec(self, name: str) -> LogicalSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise MissingTensorError("no such logical tensor", path=self.path, tensor=name
                                     ) from None

    def recipe_of(self, name: str):
        """Stored format of a logical weight: a `workbench.formats.Recipe` for MX/NVFP4 (profile
        = the library whose decoder the layout follows), a codec string for INT4 / FP8
        (`"int4"`, `"fp8"`, `"fp8-block"`), None for dense tensors."""
        spec = self.spec(name)
        if spec.codec is None:
            return None
        if spec.codec in FMT_OF_CODEC:

            return Recipe(FMT_OF_CODEC[spec.codec], spec.profile)
        return spec.codec

    # -- views ------------------------------------------------------------------------------
    def tensor(self, name: str, *, keep_dtype: bool = False) -> LogicalTensor:
        """Logical view of one weight; dense tensors keep their stored dtype if asked."""
        return StoredView(self.index, self.spec(name), keep_dtype=keep_dtype)

    def experts(self) -> list[ExpertRecord]:
        """Routed expert records (one per layer x expert x gate/up/down)."""
        return self.expert_records("routed")

    def expert_records(self, kind: str | None = None) -> list[ExpertRecord]:
        if kind not in (None, "routed", "shared", "dense"):
            raise ValueError(f"kind must be routed, shared, dense or None, got {kind!r}")
        return [r for r in self._records if kind is None or r.kind == kind]

    def record(self, layer: int, expert: int, proj: str, kind: str = "routed") -> ExpertRecord:
        try:
            return self._by_key[(kind, layer, expert, proj)]
        except KeyError:
            raise MissingTensorError(f"no {kind} expert (layer {layer}, expert {expert}, "
                                     f"proj {proj!r})", path=self.path) from None

    def view_of(self, rec: ExpertRecord, *, keep_dtype: bool = False) -> LogicalTensor:
        spec = self.spec(rec.name)
        return StoredView(self.index, spec, lead=rec.lead,
                          rows=(rec.row_offset, rec.row_stride, rec.shape[0]),
                          name=f"{rec.name}[{rec.key}]", keep_dtype=keep_dtype)

    def expert_weight(self, layer: int, expert: int, proj: str, kind: str = "routed", *,
                      keep_dtype: bool = False) -> LogicalTensor:
        """Logical BF16 view `[out, in]` of one expert projection (`keep_dtype`: a weight stored
        unpacked keeps its stored dtype, as `tensor(..., keep_dtype=True)`)."""
        return self.view_of(self.record(layer, expert, proj, kind), keep_dtype=keep_dtype)

    def num_experts(self, layer: int) -> int:
        return len({r.expert for r in self._records if r.kind == "routed" and r.layer == layer})

    def stacked_experts(self, layer: int, proj: str, *, keep_dtype: bool = False
                        ) -> LogicalTensor:
        """`[E, out, in]` view of a layer's routed experts; slicing E reads only those experts
        (`keep_dtype` as in `expert_weight`)."""
        recs = [r for r in self._records if r.kind == "routed" and r.layer == layer
                and r.proj == proj]
        if not recs:
            raise MissingTensorError(f"no routed experts for layer {layer}, proj {proj!r}",
                                     path=self.path)
        recs.sort(key=lambda r: r.expert)
        if [r.expert for r in recs] != list(range(len(recs))):
            raise CheckpointError(f"layer {layer} {proj}: experts {[r.expert for r in recs]} are "
                                  "not 0..E-1", path=self.path)
        r0 = recs[0]
        if r0.lead is not None and all(r.name == r0.name for r in recs):
            # one fused 3-D tensor: a single strided view reads the expert range in one request
            return StoredView(self.index, self.spec(r0.name), lead=None,
                              rows=(r0.row_offset, r0.row_stride, r0.shape[0]),
                              name=f"{r0.name}[{proj}]", keep_dtype=keep_dtype)
        return StackView(f"layers.{layer}.experts.{proj}",
                         [self.view_of(r, keep_dtype=keep_dtype) for r in recs])

    def close(self) -> None:
        self.index.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        n = len(self.experts())
        return (f"Checkpoint({str(self.path)!r}, layout={self.layout!r}, "
                f"tensors={len(self._specs)}, routed expert weights={n})")


def raise_all(problems: list[CheckpointError], path: Path) -> None:
    """One problem: raise it (its own subclass); several: one ValidationError listing all."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ValidationError(problems, path=path)


def open_checkpoint(spec: str | os.PathLike | Source, *, remote: RemoteOptions | None = None
                    ) -> Checkpoint:
    """Open and validate a checkpoint; raises a `CheckpointError` subclass on bad input.

    ``spec`` is a folder, a hub id (``org/name[@revision]``, ``hf://...``: the Hugging Face
    cache first, else read by range), a URL (``https://``, ``s3://``: read by range) or a
    resolved `Source` (see `workbench.source.resolve`; a ``Path`` is always a folder).
    ``remote`` says how remote checkpoints are read (cache, retries, progress bar)."""
    try:
        source = resolve(spec)
    except SourceError as e:
        raise MissingFileError(str(e), path=None) from None
    if source.is_local and not source.path.is_dir():
        raise MissingFileError("checkpoint folder does not exist", path=source.path)
    return Checkpoint(source=source, remote=remote)
