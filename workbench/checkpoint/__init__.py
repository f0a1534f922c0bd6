"""Checkpoint I/O: lazy sharded safetensors, quantization_config, validation, logical views.

```python
from workbench.checkpoint import open_checkpoint, CheckpointError
ck = open_checkpoint(path)      # validates everything at open; CheckpointError subclasses
ck = open_checkpoint("org/name@rev")   # a hub id: the HF cache first, else read by range
ck = open_checkpoint("https://host/folder")   # any server with Range support, s3://, ...
ck.layout                       # "compressed-tensors" | "gpt-oss" | "modelopt" | "fp8-block" | "dense"
ck.scope.is_quantized(name)     # QuantScope built from the stored metadata, with .reason(name)
ck.experts()                    # routed records: .layer .expert .proj .kind .name .shape
ck.expert_weight(layer, expert, proj)[rows, cols]   # decoded bf16, reads only needed blocks
ck.stacked_experts(layer, proj)[e0:e1]              # [E, out, in] view
```
Errors: everything wrong at open time is collected; one problem raises its own
`CheckpointError` subclass, several raise one `ValidationError` whose `.errors` lists each (every
error carries `.path` and `.tensor`). No transformers import here: safetensors + json + torch
(+ workbench.formats to decode).
"""

from .checkpoint import Checkpoint, open_checkpoint
from .config import ConfigGroup, QuantConfig, WeightArgs, load_quant_config
from .errors import (
                     CheckpointError,
                     ConfigError,
                     CorruptShardError,
                     DtypeMismatchError,
                     FormatMismatchError,
                     MissingCompanionError,
                     MissingFileError,
                     MissingTensorError,
                     RemoteReadError,
                     ShapeMismatchError,
                     UncoveredTensorError,
                     UnknownFormatError,
                     UnsafePathError,
                     ValidationError,
)
from .experts import ExpertRecord
from .index import ShardIndex, TensorEntry
from .layouts import LogicalSpec
from .range_cache import RangeCache
from .remote import FetchStats, RemoteOptions, RetryPolicy
from .select import Selection
from .views import LogicalTensor, StackView, StoredView

__all__ = [
    "Checkpoint", "CheckpointError", "ConfigError", "ConfigGroup", "CorruptShardError",
    "DtypeMismatchError", "ExpertRecord", "FetchStats", "FormatMismatchError", "LogicalSpec",
    "LogicalTensor", "MissingCompanionError", "MissingFileError", "MissingTensorError",
    "QuantConfig", "RangeCache", "RemoteOptions", "RemoteReadError", "RetryPolicy", "Selection",
    "ShapeMismatchError", "ShardIndex", "StackView", "StoredView", "TensorEntry",
    "UncoveredTensorError", "UnknownFormatError", "UnsafePathError", "ValidationError",
    "WeightArgs", "load_quant_config", "open_checkpoint",
]
