"""Every layout and expert naming opens, lists its experts, and serves logical BF16 views whose
slices are bit-identical to decoding the whole stored tensor (read independently with
`safetensors.torch.load_file`) and then slicing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from writers import write_ct, write_fp8_block, write_gpt_oss, write_modelopt, write_te

from workbench.checkpoint import open_checkpoint
from workbench.formats import QuantizedTensor, dequantize

CASES = {
    # name: (writer, layout, routed records, shared, dense)
    "ct-mxfp4": (lambda d: write_ct(d, "mxfp4"), "compressed-tensors", 24, 0, 0),
    "ct-nvfp4-kimi": (lambda d: write_ct(d, "nvfp4", naming="kimi", shared=True,
                                         dense_layer0=True), "compressed-tensors", 12, 3, 3),
    "ct-mxfp8": (lambda d: write_ct(d, "mxfp8", shards=1, text_config=True),
                 "compressed-tensors", 24, 0, 0),
    "ct-int4": (lambda d: write_ct(d, "int4", shards=3), "compressed-tensors", 24, 0, 0),
    "gpt-oss": (write_gpt_oss, "gpt-oss", 24, 0, 0),
    "modelopt-nvfp4": (write_modelopt, "modelopt", 24, 0, 0),
    "modelopt-mxfp4-hfq": (lambda d: write_modelopt(d, "MXFP4", in_config=False), "modelopt",
                           24, 0, 0),
    "modelopt-mxfp8": (lambda d: write_modelopt(d, "MXFP8"), "modelopt", 24, 0, 0),
    "fp8-block": (write_fp8_block, "fp8-block", 24, 0, 0),
    "te-ep": (write_te, "dense", 24, 0, 0),
    "hy3": (lambda d: write_te(d, style="hy3"), "dense", 24, 0, 0),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {name: case[0](root / name) for name, case in CASES.items()}


def stored(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        rank = f.stem.split("-ep")[1] if "-ep" in f.stem else None  # model-ep{r} (write_te)
        for k, v in load_file(str(f)).items():
            out[f"{k}@ep{rank}" if rank is not None and ".experts." in k else k] = v
    return out


def bits(t):
    assert t.dtype == torch.bfloat16
    return t.contiguous().view(torch.int16)


def full_decode(ck, t: dict[str, torch.Tensor], base: str) -> torch.Tensor:
    """Independent whole-tensor decode from the stored tensors (no views, no index)."""
    lay = ck.layout
    if lay == "dense":
        return t[base].to(torch.bfloat16)
    if lay == "fp8-block":
        w, s = t[base].float(), t[base + "_scale_inv"]
        R, C = w.shape
        return (w * s.repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :C]).bfloat16()
    if lay == "gpt-oss":
        # transformers' own gpt-oss decoder (Mxfp4Config(dequantize=True)); it returns [E, K, N]
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        return convert_moe_packed_tensors(t[base + "_blocks"], t[base + "_scales"]).transpose(1, 2)
    if lay == "modelopt":
        d, s = t[base], t[base + "_scale"]
        if d.dtype == torch.float8_e4m3fn:
            fmt, gs = "mxfp8_e4m3", None
        elif s.dtype == torch.float8_e4m3fn:
            fmt, gs = "nvfp4", t[base + "_scale_2"].float().reshape(())
        else:
            fmt, gs = "mxfp4", None
        K = d.shape[-1] * (1 if fmt == "mxfp8_e4m3" else 2)
        return dequantize(QuantizedTensor(fmt, "modelopt-export", d, s, gs, (d.shape[0], K)))
    return ct_decompress(ck, t, base)


def ct_decompress(ck, t, base):
    """compressed-tensors' own decompressors (the real library) on the whole stored weight."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fmt = ck.quant_config.format
    w = ck.quant_config.groups[0].weights
    args = QuantizationArgs(num_bits=w.num_bits, type=w.type, strategy=w.strategy,
                            group_size=w.group_size, symmetric=True,
                            scale_dtype=torch.uint8 if fmt.startswith("mx") else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    sd = {k[len(base) - len("weight"):]: v for k, v in t.items()
          if k.startswith(base[: -len("weight")]) and k[len(base) - len("weight"):].startswith("weight")}
    if fmt == "nvfp4-pack-quantized":
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor as C
    elif fmt == "mxfp4-pack-quantized":
        from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor as C
    elif fmt == "mxfp8-quantized":
        from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor as C
    else:
        from compressed_tensors.compressors.pack_quantized.base import (
            PackedQuantizationCompressor as C,
        )
    return C.decompress(sd, scheme)["weight"].to(torch.bfloat16)


def expert_full(ck, t, rec) -> torch.Tensor:
    full = full_decode(ck, t, rec.name)
    if rec.lead is not None:
        full = full[rec.lead]
    rows = torch.arange(rec.shape[0]) * rec.row_stride + rec.row_offset
    return full[rows]


@pytest.mark.parametrize("case", list(CASES))
def test_open_layout_and_records(ckpts, case):
    _, layout, n_routed, n_shared, n_dense = CASES[case]
    ck = open_checkpoint(ckpts[case])
    assert ck.layout == layout
    routed = ck.experts()
    assert len(routed) == n_routed
    assert len(ck.expert_records("shared")) == n_shared
    assert len(ck.expert_records("dense")) == n_dense
    keys = {(r.layer, r.expert, r.proj) for r in routed}
    assert len(keys) == len(routed)
    layers = sorted({r.layer for r in routed})
    for layer in layers:
        E = ck.num_experts(layer)
        assert E >= 2
        assert {(layer, e, p) for e in range(E) for p in ("gate", "up", "down")} <= keys
        g, d = ck.expert_weight(layer, 0, "gate"), ck.expert_weight(layer, 0, "down")
        assert g.shape[1] == d.shape[0] and g.shape[0] == d.shape[1]  # [F, H] and [H, F]
        assert ck.expert_weight(layer, 0, "up").shape == g.shape
    for r in routed:
        assert ck.scope.is_quantized(r.name) == (layout != "dense"), ck.scope.reason(r.name)


SLICES = [
    (slice(None), slice(None)),
    (slice(3, 11), slice(5, 40)),
    (slice(None), slice(17, 18)),
    (5, slice(None)),
    (slice(1, 30, 3), -1),
    (-2, 30),
    (slice(0, 64), slice(31, 33)),
    (slice(7, 7), slice(0, 5)),
    (slice(None, None, 2), slice(60, None)),
]


@pytest.mark.parametrize("case", list(CASES))
def test_expert_slices_bit_exact_with_full_decode(ckpts, case):
    ck = open_checkpoint(ckpts[case])
    t = stored(ckpts[case])
    recs = ck.experts()
    for rec in recs[:: max(1, len(recs) // 7)] + recs[-3:]:
        want = expert_full(ck, t, rec)
        view = ck.expert_weight(rec.layer, rec.expert, rec.proj)
        assert tuple(view.shape) == tuple(want.shape) == tuple(rec.shape)
        assert torch.equal(bits(view.materialize()), bits(want)), rec.key
        for key in SLICES:
            got = view[key]
            assert got.shape == want[key].shape, (rec.key, key)
            assert torch.equal(bits(got), bits(want[key])), (rec.key, key)


@pytest.mark.parametrize("case", ["ct-nvfp4-kimi", "gpt-oss", "te-ep", "fp8-block"])
def test_stacked_experts(ckpts, case):
    ck = open_checkpoint(ckpts[case])
    t = stored(ckpts[case])
    layer = ck.experts()[-1].layer
    for proj in ("gate", "up", "down"):
        st = ck.stacked_experts(layer, proj)
        E = ck.num_experts(layer)
        want = torch.stack([expert_full(ck, t, ck.record(layer, e, proj)) for e in range(E)])
        assert tuple(st.shape) == tuple(want.shape)
        for key in [(slice(None),), (slice(1, 3), slice(2, 9), slice(30, 50)), (1,),
                    (slice(2, 2), 3), (slice(1, 3), slice(4, 4)),
                    (slice(None, None, 2), 0), (-1, slice(None), 3)]:
            assert torch.equal(bits(st[key]), bits(want[key])), (proj, key)


def test_shared_and_dense_records_are_separate(ckpts):
    ck = open_checkpoint(ckpts["ct-nvfp4-kimi"])
    shared = ck.expert_records("shared")
    dense = ck.expert_records("dense")
    assert {r.proj for r in shared} == {r.proj for r in dense} == {"gate", "up", "down"}
    assert all("shared_experts" in r.name for r in shared)
    assert all(r.layer == 0 and ".mlp." in r.name for r in dense)
    assert not any("shared" in r.name for r in ck.experts())
    # Kimi naming: w1 = gate, w3 = up, w2 = down
    assert ck.record(1, 2, "up").name == "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    assert ck.record(1, 2, "down").name.endswith("experts.2.w2.weight")
    assert len(ck.expert_records()) == 12 + 3 + 3


def test_te_global_expert_numbering_from_file_rank(ckpts):
    """model-ep{r}.safetensors holds local experts k: global = r * local + k; fc1 = gate | up."""
    ck = open_checkpoint(ckpts["te-ep"])
    from writers import gen

    F = 32
    for layer in range(2):
        for g in range(4):
            fc1 = gen((2 * F, 64), seed=1000 * layer + g)
            fc2 = gen((64, F), seed=5000 + 1000 * layer + g)
            assert torch.equal(ck.expert_weight(layer, g, "gate").materialize(), fc1[:F])
            assert torch.equal(ck.expert_weight(layer, g, "up").materialize(), fc1[F:])
            assert torch.equal(ck.expert_weight(layer, g, "down").materialize(), fc2)
    assert ck.record(1, 3, "gate").name.endswith("linear_fc1.weight1@ep1")


def test_reads_touch_only_the_needed_blocks(ckpts):
    ck = open_checkpoint(ckpts["ct-mxfp4"])
    st = ck.index.stats
    st.reset()
    view = ck.expert_weight(1, 2, "down")  # [64, 32] -> one 32-block per row
    view[3:7, 5:20]
    assert st.bytes_read == 4 * (16 + 1)
    st.reset()
    ck.expert_weight(1, 2, "gate")[3:7, 20:40]  # [32, 64]: columns 20..39 -> blocks 0 and 1
    assert st.bytes_read == 4 * (2 * 16 + 2)
    assert set(st.per_tensor) == {"model.layers.1.mlp.experts.2.gate_proj.weight_packed",
                                  "model.layers.1.mlp.experts.2.gate_proj.weight_scale"}
    st.reset()
    ck.stacked_experts(0, "up")[1:3, :2]  # 2 experts x 2 rows x 2 blocks
    assert {n.split(".experts.")[1].split(".")[0] for n in st.per_tensor} == {"1", "2"}
    assert st.bytes_read == 2 * 2 * (2 * 16 + 2)


def test_gpt_oss_reads_only_selected_rows_and_experts(ckpts):
    ck = open_checkpoint(ckpts["gpt-oss"])
    st = ck.index.stats
    st.reset()
    ck.expert_weight(0, 1, "up")[2:5, 33:34]  # stored rows 5, 7, 9 of expert 1; block 1 only
    assert st.bytes_read == 3 * (16 + 1)
    st.reset()
    ck.stacked_experts(1, "gate")[2:4, :, :32]
    E, F, nb = 2, 32, 1
    assert st.bytes_read == E * F * nb * (16 + 1)
    full = sum(math.prod(e.shape) for n, e in ck.index.entries.items() if "gate_up_proj_" in n
               and "layers.1" in n and "bias" not in n)
    assert st.bytes_read < full / 4


def test_fp8_block_reads_only_needed_tiles(ckpts):
    ck = open_checkpoint(ckpts["fp8-block"])
    st = ck.index.stats
    st.reset()
    ck.expert_weight(0, 0, "gate")[130:140, 5:9]  # [200, 160]: one scale tile (row 1, col 0)
    assert st.bytes_read == 10 * 4 + 1 * 1 * 4


def test_raw_gives_stored_parts(ckpts):
    ck = open_checkpoint(ckpts["ct-nvfp4-kimi"])
    t = stored(ckpts["ct-nvfp4-kimi"])
    rec = ck.record(1, 0, "gate")
    raw = ck.expert_weight(1, 0, "gate").raw()
    base = rec.name[: -len("weight")]
    assert set(raw) == {"data", "scale", "global_scale"}
    assert torch.equal(raw["data"], t[base + "weight_packed"])
    assert torch.equal(raw["scale"].view(torch.uint8), t[base + "weight_scale"].view(torch.uint8))
    ck2 = open_checkpoint(ckpts["gpt-oss"])
    t2 = stored(ckpts["gpt-oss"])
    r = ck2.stacked_experts(0, "down").raw(experts=slice(1, 3))
    assert torch.equal(r["data"], t2["model.layers.0.mlp.experts.down_proj_blocks"][1:3])


def test_recipe_of_and_dense_dtype(ckpts):
    ck = open_checkpoint(ckpts["ct-nvfp4-kimi"])
    rec = ck.experts()[0]
    r = ck.recipe_of(rec.name)
    assert (r.fmt, r.profile) == ("nvfp4", "compressed-tensors")
    assert ck.recipe_of("model.norm.weight") is None
    norm = ck.tensor("model.norm.weight")
    assert norm.shape == (64,) and norm[3:5].dtype == torch.bfloat16
    ck8 = open_checkpoint(ckpts["fp8-block"])
    assert ck8.recipe_of(ck8.experts()[0].name) == "fp8-block"
    ck4 = open_checkpoint(ckpts["ct-int4"])
    assert ck4.recipe_of(ck4.experts()[0].name) == "int4"


def test_dense_keeps_stored_dtype_when_asked(tmp_path):
    from writers import save_sharded

    w = torch.randn(6, 10, dtype=torch.float32)
    save_sharded(tmp_path, {"model.layers.0.mlp.experts.0.up_proj.weight": w,
                            "model.layers.0.mlp.experts.0.gate_proj.weight": w.clone(),
                            "model.layers.0.mlp.experts.0.down_proj.weight": w.T.clone()})
    ck = open_checkpoint(tmp_path)
    v = ck.tensor("model.layers.0.mlp.experts.0.up_proj.weight", keep_dtype=True)
    assert v.dtype == torch.float32 and torch.equal(v[1:3, 2:4], w[1:3, 2:4])
    assert torch.equal(ck.expert_weight(0, 0, "up")[1:3], w[1:3].bfloat16())


def test_bad_indices(ckpts):
    ck = open_checkpoint(ckpts["ct-mxfp4"])
    v = ck.expert_weight(0, 0, "gate")
    with pytest.raises(IndexError):
        v[32]
    with pytest.raises(IndexError):
        v[:, ::2]
    with pytest.raises(IndexError):
        v[1, 2, 3]
    with pytest.raises(TypeError):
        v["a"]
    with pytest.raises(KeyError):
        ck.expert_weight(0, 99, "gate")


def _gpt_oss_specials(tmp_path, bytes_):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from writers import save_sharded

    E, N, K = 2, 4, 64
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.tensor((bytes_ * 16)[:16], dtype=torch.uint8).reshape(E, N, K // 32)
    p = "model.layers.0.mlp.experts"
    save_sharded(tmp_path, {f"{p}.down_proj_blocks": blocks, f"{p}.down_proj_scales": scales},
                 config={"quantization_config": {"quant_method": "mxfp4"}})
    got = open_checkpoint(tmp_path).stacked_experts(0, "down").materialize()
    want = convert_moe_packed_tensors(blocks, scales).transpose(1, 2)
    return got, want


def test_gpt_oss_extreme_scale_bytes_decode_like_transformers(tmp_path):
    """E8M0 bytes 0 (2^-127, a subnormal), 1, 254 (overflow to inf for large codes)."""
    got, want = _gpt_oss_specials(tmp_path, [0, 1, 127, 254, 126, 128, 3, 253])
    assert torch.equal(bits(got), bits(want))
    assert torch.isinf(got).any() and (got.abs() < 1e-37).any()


def test_gpt_oss_byte_255_decodes_like_transformers(tmp_path):
    got, want = _gpt_oss_specials(tmp_path, [255, 128])
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all()


def test_megatron_sequential_and_single_file_grouped_naming(tmp_path):
    from safetensors.torch import save_file
    from writers import gen

    F, H = 8, 32
    seq = tmp_path / "seq"
    seq.mkdir()
    for r in range(2):  # per-rank files, SequentialMLP local experts + a shared expert
        t = {}
        for k in range(3):
            p = f"decoder.layers.0.mlp.experts.local_experts.{k}"
            t[f"{p}.linear_fc1.weight"] = gen((2 * F, H), seed=10 * r + k)
            t[f"{p}.linear_fc2.weight"] = gen((H, F), seed=100 + 10 * r + k)
        t["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"] = gen((2 * F, H), seed=7)
        t["decoder.layers.0.mlp.shared_experts.linear_fc2.weight"] = gen((H, F), seed=8)
        save_file(t, str(seq / f"ep_rank_{r:02d}.safetensors"))
    ck = open_checkpoint(seq)
    assert ck.num_experts(0) == 6
    assert torch.equal(ck.expert_weight(0, 4, "up").materialize(), gen((2 * F, H), seed=11)[F:])
    assert torch.equal(ck.expert_weight(0, 5, "down").materialize(), gen((H, F), seed=112))
    shared = ck.expert_records("shared")
    assert [(r.expert, r.proj) for r in shared] == [(0, "gate"), (0, "up"), (0, "down")]
    assert torch.equal(ck.expert_weight(0, 0, "up", kind="shared").materialize(),
                       gen((2 * F, H), seed=7)[F:])

    one = tmp_path / "hy3"
    one.mkdir()
    t = {f"model.layers.3.mlp.experts.fc1.weight{k}": gen((2 * F, H), seed=k) for k in range(4)}
    t.update({f"model.layers.3.mlp.experts.fc2.weight{k}": gen((H, F), seed=50 + k)
              for k in range(4)})
    save_file(t, str(one / "model.safetensors"))
    ck = open_checkpoint(one)
    assert [r.layer for r in ck.experts()] == [3] * 12 and ck.num_experts(3) == 4
    assert torch.equal(ck.expert_weight(3, 2, "gate").materialize(), gen((2 * F, H), seed=2)[:F])
    assert torch.equal(ck.stacked_experts(3, "down")[3], gen((H, F), seed=53))


def test_index_handle_cache_is_bounded(ckpts):
    from workbench.checkpoint import ShardIndex

    ix = ShardIndex(ckpts["ct-int4"], max_open=1)  # three shards
    names = sorted(ix.names())
    files = {ix.entry(n).file for n in names}
    assert len(files) == 3
    for n in names[:6]:
        assert ix.read(n).shape == ix.entry(n).shape
        assert len(ix._handles) == 1
    assert ix.stats.requests == 6
    assert ix.stats.bytes_read == sum(ix.entry(n).nbytes for n in names[:6])


def test_bf16_gpt_oss_fused_experts_as_transformers_stores_them(tmp_path):
    """transformers' GptOssExperts keep gate_up_proj [E, H, 2F] (x @ W, gate = even columns)
    and down_proj [E, F, H]; the views expose Linear-convention [out, in] weights."""
    from writers import gen, save_sharded

    E, H, F = 3, 32, 24
    gu, dn = gen((E, H, 2 * F), seed=1), gen((E, F, H), seed=2)
    p = "model.layers.0.mlp.experts"
    save_sharded(tmp_path, {f"{p}.gate_up_proj": gu, f"{p}.gate_up_proj_bias": gen((E, 2 * F)),
                            f"{p}.down_proj": dn, f"{p}.down_proj_bias": gen((E, H), seed=3)})
    ck = open_checkpoint(tmp_path)
    x = gen((5, H), seed=4).float()
    for e in range(E):
        gate, up = ck.expert_weight(0, e, "gate"), ck.expert_weight(0, e, "up")
        assert gate.shape == (F, H) and ck.expert_weight(0, e, "down").shape == (H, F)
        # the model computes x @ gate_up_proj[e] and splits even / odd columns
        ref = x @ gu[e].float()
        assert torch.equal(x @ gate.materialize().float().T, ref[:, 0::2])
        assert torch.equal(x @ up.materialize().float().T, ref[:, 1::2])
        assert torch.equal(ck.expert_weight(0, e, "down")[3:9, 2:5], dn[e].T[3:9, 2:5])
    st = ck.stacked_experts(0, "up")
    assert torch.equal(st[1:3, 4:10:2, 7], gu[1:3, 7, 1::2][:, 4:10:2])


def test_every_codec_and_layout_is_one_consistent_record():
    """Each codec the config parser can name has one record, each layout one record, and what
    the records claim holds: MX/NVFP4 codecs decode through a workbench.formats format whose
    profiles include each layout's decoder profile."""
    from workbench.checkpoint.config import CT_FORMATS, MODELOPT_ALGOS, QuantConfig
    from workbench.checkpoint.registry import CODECS, LAYOUT_OF_METHOD, LAYOUTS
    from workbench.formats import format_spec

    assert set(CT_FORMATS.values()) | set(MODELOPT_ALGOS.values()) | {"fp8-block"} == set(CODECS)
    for c in CODECS.values():
        assert next(iter(c.roles)) == "data" and "scale" in c.roles, c.name
        if c.fmt is not None:
            assert c.block == format_spec(c.fmt).block, c.name
    for method in ("compressed-tensors", "mxfp4", "modelopt", "fp8", "dense"):
        QuantConfig(method, None)  # every method the config knows ...
        assert method in LAYOUT_OF_METHOD  # ... has exactly one layout
    assert len(LAYOUTS) == len(LAYOUT_OF_METHOD)
    for lay in LAYOUTS.values():
        if lay.profile is not None:
            fmts = {c.fmt for c in CODECS.values() if c.fmt is not None}
            assert any(lay.profile in format_spec(f).profiles for f in fmts), lay.name
        # suffixes are unambiguous inside a layout
        sfx = [s for s in lay.suffixes.values() if s]
        assert len(sfx) == len(set(sfx)), lay.name
