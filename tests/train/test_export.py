"""Packed / BF16 export: compressed-tensors as the layout oracle, transformers as the loader,
`workbench.checkpoint.open_checkpoint` for the bit-exact round trip of the trained grid."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TINY

from workbench.formats import dequantize
from workbench.train.export import ct_quantization_config, export_model
from workbench.train.export_folder import MARKER

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
CT_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few real QAT steps per recipe (W=1, in process): model, convert() output, export dir."""
    from workbench.qat import convert
    from workbench.train import distributed
    from workbench.train.args import config_from_args
    from workbench.train.loop import train

    cache = {}

    def get(recipe: str):
        if recipe not in cache:
            out = tmp_path_factory.mktemp(f"qat_{recipe}")
            cfg = config_from_args([*TINY, "--recipe", recipe, "--steps", "3", "--out", str(out),
                                    "--ckpt-every", "0", "--val-every", "0",
                                    "--export", "compressed-tensors"])
            _, model = train(cfg, distributed.setup(), return_model=True)
            cache[recipe] = (model, convert(model), out / "export")
        return cache[recipe]

    return get


def _experts(model):
    from workbench.model import GroupedExperts

    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def _load(path):
    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(path / shard)))
    assert set(out) == set(index["weight_map"])
    return out


@pytest.mark.parametrize("fmt, preset", [("mxfp4", "MXFP4A16"), ("nvfp4", "NVFP4A16")])
def test_quantization_config_is_what_compressed_tensors_writes(tmp_path, fmt, preset):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    targets, ignore = [r"re:.*\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"], ["lm_head"]
    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=targets, **PRESET_SCHEMES[preset])},
        format=f"{fmt}-pack-quantized", quantization_status="compressed", ignore=ignore)
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=qc).update_config(str(tmp_path))
    theirs = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert ct_quantization_config(fmt, targets, ignore) == theirs


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4"])
def test_packed_experts_decode_with_compressed_tensors(trained, recipe):
    """compressed-tensors' own decompressor reads our per-expert tensors as the trained grid."""
    from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    model, packed, path = trained(recipe)
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == f"{recipe}-pack-quantized"
    scheme = QuantizationScheme(targets=cfg["config_groups"]["group_0"]["targets"],
                                **PRESET_SCHEMES[recipe.upper() + "A16"])
    comp = MXFP4PackedCompressor if recipe == "mxfp4" else NVFP4PackedCompressor
    tensors = _load(path)
    for name, mod in _experts(model):
        for w, proj in PROJ.items():
            ours = dequantize(packed[f"{name}.{w}"], torch.float32)
            for e in range(mod.num_experts):
                base = f"{name}.{e}.{proj}"
                parts = {k: tensors[f"{base}.{k}"] for k in comp.compression_param_names(scheme)}
                assert parts["weight_packed"].dtype == torch.uint8
                assert parts["weight_packed"].shape == (ours.shape[1], ours.shape[2] // 2)
                theirs = comp.decompress(parts, scheme)["weight"]  # decoded to bf16
                if recipe == "mxfp4":  # MXFP4 values are exact in bf16
                    assert torch.equal(theirs.float(), ours[e]), base
                else:
                    # They divide by the encode-direction global scale, we multiply by its
                    # reciprocal; after the cast to bf16 the two agree but for rare 1-ulp ties.
                    want = ours[e].bfloat16()
                    torch.testing.assert_close(theirs, want, rtol=2**-7, atol=0)
                    assert (theirs == want).float().mean() > 0.99, base
            assert f"{name}.{mod.num_experts}.{proj}.weight_packed" not in tensors


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4"])
def test_open_checkpoint_reproduces_the_trained_grid(trained, recipe):
    from workbench.checkpoint import open_checkpoint

    model, packed, path = trained(recipe)
    ck = open_checkpoint(path)
    assert ck.layout == "compressed-tensors"
    for name, mod in _experts(model):
        layer = int(name.split(".")[2])
        for w, proj in CT_PROJ.items():
            q = packed[f"{name}.{w}"]
            view = ck.stacked_experts(layer, proj)
            raw = view.raw()
            assert torch.equal(raw["data"], q.data)
            assert torch.equal(raw["scale"].view(torch.uint8), q.scale.view(torch.uint8))
            assert torch.equal(view[:], dequantize(q, torch.bfloat16)), f"{name}.{w}"


def _bf16_dense_(model):
    # The export stores dense tensors in BF16; round ours the same way so logits compare tightly.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." not in n + ".":
                p.copy_(p.bfloat16().float())


def test_transformers_loads_mxfp4_export_and_logits_match(trained):
    from transformers import AutoModelForCausalLM

    model, _, path = trained("mxfp4")
    _bf16_dense_(model)
    export_model(model, path, fmt="compressed-tensors", recipe="mxfp4")  # re-export rounded
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    # compressed-tensors decompresses experts to bf16 whatever dtype was asked; the values are
    # exact (MXFP4 fits bf16), so compute in fp32 like our model to compare tightly.
    experts = [p for n, p in hf.named_parameters() if ".experts." in n]
    assert experts and all(p.dtype == torch.bfloat16 for p in experts)
    for p in experts:
        p.data = p.data.float()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids).logits  # prepared model: fake-quantized experts
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_transformers_nvfp4_experts_bug_is_still_there(trained):
    """transformers 5.24 drops `weight_global_scale` for MoE experts (docs/formats.md): the loaded
    experts are ours times the encode-direction global scale. If this fails, the bug is fixed:
    switch the NVFP4 logits test on like the MXFP4 one."""
    from transformers import AutoModelForCausalLM

    model, packed, path = trained("nvfp4")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tensors = _load(path)
    name, _ = _experts(model)[0]
    loaded = hf.get_parameter(f"{name}.down_proj")[0].float()  # [D, F] of expert 0
    ours = dequantize(packed[f"{name}.w2"], torch.float32)[0]
    gs = tensors[f"{name}.0.down_proj.weight_global_scale"].item()
    assert gs > 1e3
    torch.testing.assert_close(loaded, ours * gs, rtol=1e-2, atol=1e-3)


def test_bf16_export_loads_in_transformers_and_as_init(tmp_path):
    from transformers import AutoModelForCausalLM

    from workbench.model import MoEForCausalLM, tiny
    from workbench.train.cli import main

    model = MoEForCausalLM(tiny(), seed=3)
    _bf16_dense_(model)
    with torch.no_grad():
        for _, mod in _experts(model):
            for w in PROJ:
                getattr(mod, w).copy_(getattr(mod, w).bfloat16().float())
    path = export_model(model, tmp_path / "bf16", fmt="bf16")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    # --init: the trainer starts from exactly these weights (step-1 loss of the init model)
    out = tmp_path / "run"
    res = main([*TINY, "--steps", "1", "--out", str(out), "--init", str(path), "--ckpt-every",
                "0", "--val-every", "0", "--lr", "1e-9"])
    from workbench.train.data import global_batch, load_corpus

    tok = global_batch(load_corpus().train, seed=0, index=1, batch=4, seq=32)
    with torch.no_grad():
        want = float(model(tok, labels_BS=tok).ce_loss)
    assert res["final_loss"] == pytest.approx(want, rel=1e-5)


def test_export_refuses_a_scope_that_disagrees(tmp_path):
    from workbench.model import MoEForCausalLM, tiny
    from workbench.scope import QuantScope
    from workbench.train.export import ExportError

    model = MoEForCausalLM(tiny(), seed=0)
    with pytest.raises(ExportError, match="q_proj|quantized"):
        export_model(model, tmp_path / "x", fmt="compressed-tensors", recipe="mxfp4",
                     scope=QuantScope.preset("all-linear", "mxfp4"))
    assert not (tmp_path / "x").exists()


# -- a crash anywhere in the export's folder swap leaves a state the next export recovers from --
# The swap: write .tmp-export, rename export -> .old-export, rename .tmp-export -> export,
# remove .old-export. Each case below is what a SIGKILL at one point of it leaves behind.

def _swap_model():
    from workbench.model import MoEForCausalLM, tiny

    return MoEForCausalLM(tiny(), seed=1)


def _export_files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("crash", ["while-writing-tmp", "between-renames", "after-second-rename",
                                   "while-removing-old"])
def test_export_recovers_from_a_crash_in_the_swap(tmp_path, crash):
    model = _swap_model()
    first = export_model(model, tmp_path / "export")  # the previous, complete export
    want = _export_files(first)
    old, tmp = tmp_path / ".old-export", tmp_path / ".tmp-export"
    marker = (first / MARKER).read_bytes()  # written first into every export folder of ours
    if crash == "while-writing-tmp":
        tmp.mkdir()
        (tmp / MARKER).write_bytes(marker)
        (tmp / "model-00001-of-00001.safetensors").write_bytes(b"half")
    elif crash == "between-renames":  # export moved aside, the new one not yet in place
        os.rename(first, old)
        tmp.mkdir()
        (tmp / MARKER).write_bytes(marker)
        (tmp / "config.json").write_text("{}")
    elif crash == "after-second-rename":  # both complete; the old one not yet removed
        import shutil

        shutil.copytree(first, old)
    else:  # part of .old-export already removed (its marker goes last)
        old.mkdir()
        (old / MARKER).write_bytes(marker)
        (old / "config.json").write_text("{}")
    if crash == "between-renames":
        from workbench.train.export_folder import recover_swap

        recover_swap(tmp_path / "export")  # what readers get back before any new export
        assert _export_files(tmp_path / "export") == want and not old.exists()
        os.rename(tmp_path / "export", old)  # put the crash state back for the export below
    path = export_model(model, tmp_path / "export")
    assert _export_files(path) == want  # same model, same bytes: the new export is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left over


def test_activation_scheme_is_what_compressed_tensors_writes(tmp_path):
    """A `+mxfp8` recipe: MXFP4 weights (MXFP4A16) with the dynamic MX activations of
    compressed-tensors' own MXFP8 preset, serialised by ModelCompressor itself."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    targets, ignore = [r"re:.*\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"], ["lm_head"]
    scheme = dict(PRESET_SCHEMES["MXFP4A16"],
                  input_activations=PRESET_SCHEMES["MXFP8"]["input_activations"])
    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=targets, **scheme)},
        format="mxfp4-pack-quantized", quantization_status="compressed", ignore=ignore)
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=qc).update_config(str(tmp_path))
    theirs = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert ct_quantization_config("mxfp4", targets, ignore, "mxfp8_e4m3") == theirs
    from workbench.train.export import ExportError

    with pytest.raises(ExportError, match="mxfp8_e5m2"):  # CT writes no E5M2 activation scheme
        ct_quantization_config("mxfp4", targets, ignore, "mxfp8_e5m2")


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4+mxfp8", "nvfp4+mxfp8"])
def test_export_states_the_trained_recipe(trained, recipe):
    """The export's config, read back by compressed-tensors' own parser, states the run's weight
    format and (for `+mxfp8`) its dynamic MX activations; nothing is claimed that was not trained."""
    from compressed_tensors.quantization import QuantizationConfig

    _, _, path = trained(recipe)
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(raw)
    (scheme,) = qc.config_groups.values()
    w_fmt, _, a_fmt = recipe.partition("+")
    # Expected values from the formats' definitions (OCP MX: 32-element E8M0 blocks; NVFP4:
    # 16-element E4M3 blocks under a per-tensor scale), not from the exporter's tables.
    block = {"mxfp4": 32, "nvfp4": 16}[w_fmt]
    assert (scheme.weights.num_bits, scheme.weights.type, scheme.weights.group_size) == \
        (4, "float", block)
    assert scheme.weights.dynamic is False
    assert qc.format == f"{w_fmt}-pack-quantized"
    if a_fmt:
        acts = scheme.input_activations
        assert acts is not None, "a +mxfp8 run exported as weight-only"
        assert (acts.num_bits, acts.type, acts.group_size, acts.strategy) == \
            (8, "float", 32, "group")
        assert acts.dynamic is True and str(acts.scale_dtype) == "torch.uint8"  # E8M0 bytes
    else:
        assert scheme.input_activations is None
    assert scheme.output_activations is None
    # Every other field, against compressed-tensors' own presets and llm-compressor's MoE style
    # (class target, lm_head and router gates ignored), not the exporter's tables.
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    # (model_dump: pydantic's == also compares which fields were set explicitly)
    assert scheme.weights.model_dump() == \
        PRESET_SCHEMES[w_fmt.upper() + "A16"]["weights"].model_dump()
    if a_fmt:
        assert scheme.input_activations.model_dump() == \
            PRESET_SCHEMES["MXFP8"]["input_activations"].model_dump()
    assert scheme.targets == ["Linear"] and scheme.format is None
    assert qc.ignore[:2] == ["lm_head", "re:.*mlp.gate$"]
    # the rest of ignore is the attention projections, the only other dense Linears of the tiny
    # Qwen3-MoE (all its layers are sparse, none is dense MLP)
    assert sorted(qc.ignore[2:]) == sorted(f"re:.*self_attn.{p}_proj$" for p in "qkvo")
    assert qc.quantization_status == QuantizationStatus.COMPRESSED
    assert qc.quant_method == "compressed-tensors" and qc.kv_cache_scheme is None
    assert qc.global_compression_ratio is None and qc.moe_sparsity_config is None
    assert list(qc.config_groups) == ["group_0"]
    # the keys ModelCompressor.update_config writes beside QuantizationConfig's own fields
    assert set(raw) - set(type(qc).model_fields) == {"sparsity_config", "transform_config",
                                                     "version"}
    assert raw["sparsity_config"] == {} and raw["transform_config"] == {}


def test_reader_package_imports_no_trainer():
    """The exporter lives with the trainer: importing every module of the checkpoint (reader)
    package loads neither workbench.model, workbench.qat nor workbench.train."""
    import subprocess
    import sys
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[2] / "workbench" / "checkpoint"
    mods = [f"workbench.checkpoint.{p.stem}" for p in sorted(pkg.glob("*.py")) if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['workbench', 'model'], ['workbench', 'qat'], ['workbench', 'train'])))")
    env = {**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env, timeout=300).stdout.strip().splitlines()[-1]
    assert out == "[]"


def _checkpoint_layout_skeleton(shapes):
    """The module tree a per-expert reader (vLLM, compressed-tensors itself) builds from the
    export's names: every 2-D weight (or `weight_packed`) an `nn.Linear`, `embed_tokens` an
    `nn.Embedding`, on the meta device. Classes come from the stored shapes, not the exporter."""
    from torch import nn

    root = nn.Module()
    for name, shape in shapes.items():
        module, _, param = name.rpartition(".")
        if param not in ("weight", "weight_packed") or len(shape) != 2:
            continue
        cls = nn.Embedding if module.endswith("embed_tokens") else nn.Linear
        parent = root
        *path, leaf = module.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, cls(2, 2, device="meta"))
    if not hasattr(root, "lm_head"):  # tied: transformers still builds the Linear
        root.add_module("lm_head", nn.Linear(2, 2, device="meta"))
    return root


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4"])
def test_transformers_reload_matches_targets_and_ignore(trained, recipe, caplog, monkeypatch):
    """The export's targets/ignore, in llm-compressor's style, match on load: transformers (offline,
    no remote code) applies them to its fused Qwen3-MoE without a "Could not match" from
    compressed-tensors and quantizes no dense module; on the per-expert layout compressed-tensors'
    own matcher selects exactly the packed experts (router gates and lm_head ignored)."""
    import logging

    from compressed_tensors.utils.match import match_named_modules
    from loguru import logger as loguru_logger
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, _, path = trained(recipe)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    targets, ignore = qc["config_groups"]["group_0"]["targets"], qc["ignore"]
    assert "lm_head" in ignore and r"re:.*mlp.gate$" in ignore

    said = []  # compressed-tensors logs through both loguru and stdlib logging
    sink = loguru_logger.add(lambda m: said.append(str(m)), level="WARNING")
    try:
        with caplog.at_level(logging.WARNING):
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                      local_files_only=True,
                                                      trust_remote_code=False)
    finally:
        loguru_logger.remove(sink)
    said += [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "Could not match" in m], said
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    schemed = [n for n, m in hf.named_modules() if getattr(m, "quantization_scheme", None)]
    assert schemed == [], f"dense modules quantized on load: {schemed}"

    index = json.loads((path / "model.safetensors.index.json").read_text())
    shapes = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), "pt") as f:
            names = f.keys()  # safe_open is no dict: `in f` does not iterate its names
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in names})
    packed = {k.rpartition(".")[0] for k in shapes if k.endswith(".weight_packed")}
    assert packed  # every expert projection of every layer
    with caplog.at_level(logging.WARNING, logger="compressed_tensors"):
        caplog.clear()
        matched = {n for n, _ in match_named_modules(_checkpoint_layout_skeleton(shapes), targets,
                                                     ignore, warn_on_fail=True)}
    assert matched == packed
    assert not [r for r in caplog.records if "Could not match" in r.getMessage()]


def test_targets_ignore_cover_dense_layers_and_a_tied_head(tmp_path, caplog):
    """A dense MLP layer and a tied lm_head (stored once, as the embedding): ignore names the dense
    layer's projections and lm_head, so neither transformers nor the per-expert matcher quantizes
    them, and nothing fails to match."""
    import dataclasses
    import logging

    from compressed_tensors.utils.match import match_named_modules
    from loguru import logger as loguru_logger
    from transformers import AutoModelForCausalLM

    from workbench.model import MoEForCausalLM, tiny

    cfg = dataclasses.replace(tiny(), mlp_only_layers=(0,), dense_ffn=64, tie_embeddings=True)
    path = export_model(MoEForCausalLM(cfg, seed=0), tmp_path / "x", fmt="compressed-tensors",
                        recipe="mxfp4")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index and "re:.*mlp.down_proj$" in qc["ignore"]
    tensors = _load(path)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    packed = {k.rpartition(".")[0] for k in shapes if k.endswith(".weight_packed")}
    assert packed and not any(".layers.0." in m for m in packed)
    skeleton = _checkpoint_layout_skeleton(shapes)
    assert {n for n, _ in match_named_modules(skeleton, ["Linear"], qc["ignore"])} == packed
    said = []
    sink = loguru_logger.add(lambda m: said.append(str(m)), level="WARNING")
    try:
        with caplog.at_level(logging.WARNING):
            hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    finally:
        loguru_logger.remove(sink)
    said += [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "Could not match" in m], said
    assert [n for n, m in hf.named_modules() if getattr(m, "quantization_scheme", None)] == []


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
@pytest.mark.parametrize("fmt", ["bf16", "compressed-tensors"])
def test_export_files_get_the_users_umask(tmp_path, fmt, umask):
    """An export on a shared cluster file system must be readable by whoever the umask lets read
    the user's files (vLLM often runs as another user): every file, shards included, gets the
    mode a plain open() would give, 0o666 less the umask. (safetensors writes 0o600.)"""
    from workbench.model import MoEForCausalLM, tiny

    old = os.umask(umask)
    try:
        path = export_model(MoEForCausalLM(tiny(), seed=0), tmp_path / "x", fmt=fmt,
                            **({"recipe": "mxfp4"} if fmt != "bf16" else {}))
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()}
    assert any(n.endswith(".safetensors") for n in modes), modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), {n: oct(m) for n, m in modes.items()}
