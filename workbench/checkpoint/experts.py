"""Expert records from logical weight names, whatever the naming.

One record per (layer, expert, proj in gate/up/down), with `kind` "routed", "shared" or "dense"
(shared experts and dense MLPs are never mixed into routed experts):

| naming | projections |
|---|---|
| `layers.{l}.*.experts.{e}.{gate,up,down}_proj.weight` (Qwen3-MoE, DeepSeek, Mixtral-style) | as named |
| `layers.{l}.block_sparse_moe.experts.{e}.w1/w3/w2.weight` (Kimi K2/K3) | w1 gate, w3 up, w2 down |
| `layers.{l}.mlp.experts.gate_up_proj` / `down_proj`, fused (gpt-oss packed `[E, N, K]`, or BF16 `[E, K, N]` as transformers stores it, exposed transposed) | gate = even rows, up = odd rows |
| `layers.{l}.*.experts.linear_fc1.weight{k}` / `linear_fc2.weight{k}` (Megatron / TE) | fc1 = gate rows then up rows |
| `layers.{l}.*.experts.local_experts.{k}.linear_fc1.weight` (Megatron SequentialMLP) | same |
| `layers.{l}.*.experts.fc1.weight{k}` / `fc2.weight{k}` (Hy3-style) | same as TE |
| `*.shared_expert(s)[.{i}].{proj}.weight` | kind "shared" |
| `layers.{l}.{mlp,feed_forward,ffn}.{proj}.weight` | kind "dense" |

Megatron / TE local expert numbering: `k` is the index inside one expert-parallel rank. The rank
comes from the shard file name (`ep3`, `ep_rank_3`, `ep-03`; see `index.EP_FILE`), which the
index records by qualifying those tensor names with `@ep{rank}`; the global expert is
`ep_rank * local_count + k`, with `local_count` = the number of local experts of that layer on a
rank (largest k + 1 over the layer's ranks). Without an ep rank in the file name, k is global.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
        "w2": "down"}
_L = r"(?:^|.*\.)layers\.(?P<layer>\d+)\."
_EP = r"(?:@ep(?P<ep>\d+))?$"
PER_EXPERT = re.compile(_L + r"(?:[^.]+\.)?experts\.(?P<e>\d+)\.(?P<p>gate_proj|up_proj|down_proj"
                        r"|w1|w2|w3)\.weight" + _EP)
FUSED = re.compile(_L + r"(?:[^.]+\.)?experts\.(?P<p>gate_up_proj|down_proj)" + _EP)
GROUPED = re.compile(_L + r"(?:[^.]+\.)?experts\.(?P<p>linear_fc1|linear_fc2|fc1|fc2)"
                     r"\.weight(?P<k>\d+)" + _EP)
SEQUENTIAL = re.compile(_L + r"(?:[^.]+\.)?experts\.local_experts\.(?P<k>\d+)\."
                        r"(?P<p>linear_fc1|linear_fc2)\.weight" + _EP)
SHARED = re.compile(_L + r"(?:[^.]+\.)?(?:shared_experts?)(?:\.(?P<e>\d+))?\.(?P<p>gate_proj|up_proj"
                    r"|down_proj|w1|w2|w3|linear_fc1|linear_fc2)\.weight" + _EP)
DENSE = re.compile(_L + r"(?:mlp|feed_forward|ffn)\.(?P<p>gate_proj|up_proj|down_proj|w1|w2|w3"
                   r"|linear_fc1|linear_fc2)\.weight" + _EP)


@dataclass(frozen=True)
class ExpertRecord:
    """`name` is the logical weight holding this projection; `lead` the expert index inside a
    fused 3-D tensor (else None); rows `row_offset + row_stride * i` for i < shape[0]."""

    layer: int
    expert: int
    proj: str  # "gate" | "up" | "down"
    kind: str  # "routed" | "shared" | "dense"
    name: str
    shape: tuple[int, int]
    lead: int | None = None
    row_offset: int = 0
    row_stride: int = 1

    @property
    def key(self) -> str:
        return f"L{self.layer}.{self.kind}.E{self.expert}.{self.proj}"


def _split_fc1(out_rows: int, name: str) -> tuple[int, int]:
    if out_rows % 2:
        raise ValueError(f"{name}: fc1 has {out_rows} rows, not gate+up halves")
    return out_rows // 2, out_rows // 2


def expert_records(shapes: dict[str, tuple[int, ...]], interleaved: set[str]
                   ) -> list[ExpertRecord]:
    """shapes: logical name -> logical shape; interleaved: the fused 3-D `gate_up_proj`-style
    names whose rows alternate gate, up (gpt-oss; other fused 3-D tensors are ambiguous and get
    no records). Returns records sorted by kind, layer, expert."""
    recs: list[ExpertRecord] = []
    grouped: list[tuple[int, int, int | None, str, str, tuple]] = []
    for name, shape in shapes.items():
        if len(shape) not in (2, 3):
            continue
        if m := PER_EXPERT.match(name):
            recs.append(ExpertRecord(int(m["layer"]), int(m["e"]), PROJ[m["p"]], "routed", name,
                                     tuple(shape)))
        elif (m := FUSED.match(name)) and len(shape) == 3 and name in interleaved:
            E, N, K = shape
            for e in range(E):
                if m["p"] == "down_proj":
                    recs.append(ExpertRecord(int(m["layer"]), e, "down", "routed", name, (N, K),
                                             lead=e))
                else:
                    for i, p in enumerate(("gate", "up")):
                        recs.append(ExpertRecord(int(m["layer"]), e, p, "routed", name,
                                                 (N // 2, K), lead=e, row_offset=i, row_stride=2))
        elif (m := GROUPED.match(name) or SEQUENTIAL.match(name)) and len(shape) == 2:
            ep = int(m["ep"]) if m["ep"] is not None else None
            grouped.append((int(m["layer"]), int(m["k"]), ep, m["p"], name, tuple(shape)))
        elif (m := SHARED.match(name)) and len(shape) == 2:
            recs += _mlp(int(m["layer"]), int(m["e"] or 0), m["p"], "shared", name, shape)
        elif (m := DENSE.match(name)) and len(shape) == 2:
            recs += _mlp(int(m["layer"]), 0, m["p"], "dense", name, shape)
    local: dict[int, int] = {}
    for layer, k, _ep, _p, _n, _s in grouped:
        local[layer] = max(local.get(layer, 0), k + 1)
    for layer, k, ep, p, name, shape in grouped:
        e = (ep or 0) * local[layer] + k if ep is not None else k
        recs += _mlp(layer, e, p, "routed", name, shape)
    order = {"routed": 0, "shared": 1, "dense": 2}
    recs.sort(key=lambda r: (order[r.kind], r.layer, r.expert, ("gate", "up", "down").index(r.proj)))
    return recs


def _mlp(layer, e, p, kind, name, shape) -> list[ExpertRecord]:
    if p in ("linear_fc1", "fc1"):
        f, _ = _split_fc1(shape[0], name)
        return [ExpertRecord(layer, e, "gate", kind, name, (f, shape[1])),
                ExpertRecord(layer, e, "up", kind, name, (f, shape[1]), row_offset=f)]
    if p in ("linear_fc2", "fc2"):
        return [ExpertRecord(layer, e, "down", kind, name, tuple(shape))]
    return [ExpertRecord(layer, e, PROJ[p], kind, name, tuple(shape))]
