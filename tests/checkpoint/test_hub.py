"""Hub ids resolved from a Hugging Face cache made by hand (hub_cache.py), without a network:
``org/name`` and ``org/name@revision`` for inspect, compare, plan, the tokenizer and the Python
API; a local folder of the same spelling wins; ``HF_HUB_OFFLINE=1`` with a missing id is one
``error:`` line and exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hub_cache import add_snapshot, commit_of, repo_folder
from writers import write_ct

from workbench.checkpoint import MissingFileError, RemoteReadError, open_checkpoint
from workbench.cli import main
from workbench.source import Source, SourceError, parse_hub_id, resolve

ROOT = Path(__file__).parents[2]
C1, C2 = commit_of(1), commit_of(2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hub")
    return {"packed": write_ct(base / "packed", "mxfp4", layers=3, experts=4, shards=2),
            "other": write_ct(base / "other", "nvfp4", layers=3, experts=4, shards=1)}


@pytest.fixture
def home(tmp_path, monkeypatch, folders) -> Path:
    """HF_HOME with org/tiny at C1 (main) and C2 (tag v2, the nvfp4 copy); offline."""
    home = tmp_path / "hf home"
    add_snapshot(home, "org/tiny", folders["packed"], C1, refs=("main",))
    add_snapshot(home, "org/tiny", folders["other"], C2, refs=("v2",))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WORKBENCH_RANGE_CACHE", "off")
    return home


def env(home: Path) -> dict:
    return {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def test_ids_and_revisions_resolve_to_their_snapshots(home):
    snaps = repo_folder(home, "org/tiny") / "snapshots"
    for spec, commit in (("org/tiny", C1), (f"org/tiny@{C1}", C1), ("org/tiny@main", C1),
                         ("org/tiny@v2", C2), (f"hf://org/tiny@{C2}", C2)):
        src = resolve(spec)
        assert (src.kind, src.path, src.revision, src.url) == ("hub", snaps / commit, commit,
                                                                None), spec
        assert src.record()["repo_id"] == "org/tiny"
    assert resolve("org/tiny@v2").requested == "v2" and resolve("org/tiny").requested is None


def test_the_api_opens_ids_and_reads_the_same_bytes(home, folders):
    ck, local = open_checkpoint("org/tiny"), open_checkpoint(folders["packed"])
    assert ck.is_local and ck.source.revision == C1 and ck.layout == local.layout
    a = ck.expert_weight(2, 3, "down").materialize()
    assert a.equal(local.expert_weight(2, 3, "down").materialize())
    assert open_checkpoint("org/tiny@v2").recipe_of(ck.experts()[0].name).fmt == "nvfp4"


def test_a_local_folder_wins_over_an_id_of_the_same_spelling(home, folders, tmp_path,
                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(folders["other"], tmp_path / "org" / "tiny")
    src = resolve("org/tiny")
    assert src.kind == "local" and src.path == Path("org/tiny")
    assert open_checkpoint("org/tiny").recipe_of(
        open_checkpoint("org/tiny").experts()[0].name).fmt == "nvfp4"


def test_offline_and_missing_is_one_clear_error(home):
    with pytest.raises(SourceError, match=r"org/none is not in the Hugging Face cache .*"
                                          r"HF_HUB_OFFLINE=1"):
        resolve("org/none")
    with pytest.raises(SourceError, match="org/tiny@v9 is not in the Hugging Face cache"):
        resolve("org/tiny@v9")
    with pytest.raises(MissingFileError, match="HF_HUB_OFFLINE"):
        open_checkpoint("org/none")


def test_an_incomplete_snapshot_names_what_is_missing(home, folders):
    """Offline, a partial snapshot (the shards one rank downloaded, say) opens: what it holds
    is read there; a shard it lacks is an error naming it, at open (its header) unless the
    range cache holds the header."""
    add_snapshot(home, "org/part", folders["packed"], C1,
                 skip=("model-00002-of-00002.safetensors",))
    src = resolve("org/part")
    assert src.path == repo_folder(home, "org/part") / "snapshots" / C1
    assert src.url == f"hf://org/part@{C1}"
    with pytest.raises(RemoteReadError, match="HF_HUB_OFFLINE=1 allows no download") as e:
        open_checkpoint("org/part")
    assert e.value.path == f"hf://org/part@{C1}/model-00002-of-00002.safetensors"
    # a blob deleted from the cache leaves a dangling link: missing, never a crash
    (repo_folder(home, "org/tiny") / "snapshots" / C1 / "config.json").resolve().unlink()
    with pytest.raises(SourceError, match="without config.json"):
        resolve("org/tiny")


@pytest.mark.parametrize("spec", ["org/tiny@", "org/tiny@a b", "org/tiny@../x"])
def test_bad_revisions_are_refused(spec):
    with pytest.raises(SourceError, match="is not a revision"):
        parse_hub_id(spec)


@pytest.mark.parametrize("spec,kind", [("runs/x/export", "local"), ("./org/tiny", "local"),
                                       ("tiny", "local"), ("https://h/x", "url"),
                                       ("s3://b/k", "url"), ("org--x/y", "local"),
                                       ("-org/x", "local")])
def test_what_is_not_a_hub_id(spec, kind, home):
    assert resolve(spec).kind == kind


def test_inspect_cli_on_an_id_matches_the_folder(home, folders, tmp_path, capsys):
    def run(spec, out):
        return main(["inspect", spec, "--layers", "1-2", "--experts", "1,3", "--out", str(out),
                     "--device", "cpu"])

    assert run("org/tiny@main", tmp_path / "a") == 0
    assert run(str(folders["packed"]), tmp_path / "b") == 0
    a, b = pd.read_csv(tmp_path / "a" / "experts.csv"), pd.read_csv(tmp_path / "b" / "experts.csv")
    assert len(a) and a.equals(b)
    assert set(zip(a.layer, a.expert)) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    summary = (tmp_path / "a" / "summary.txt").read_text()
    assert f"checkpoint source: hub org/tiny commit {C1} (asked for main), cache " in summary
    assert "selection: layers 1-2, routed experts 1,3" in summary


def test_cli_offline_missing_id_is_one_error_line(home, tmp_path, capsys):
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect", "org/none", "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=env(home), check=False)
    want = (f"workbench inspect: error: org/none is not in the Hugging Face cache "
            f"({home / 'hub'}) and HF_HUB_OFFLINE=1 allows no download: fetch it first (hf "
            "download org/none) or unset HF_HUB_OFFLINE")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [want], r.stderr
    for argv in (["compare", "org/none", "ptq:mxfp4", "--reference", "org/tiny"],
                 ["compare", "ptq:mxfp4@org/none@v1", "ptq:nvfp4@org/tiny"],
                 ["plan", "org/none", "--gpus", "1"],
                 ["inspect", "org/tiny", "--layers", "7", "--out", str(tmp_path / "o")],
                 ["inspect", "org/tiny", "--experts", "x", "--out", str(tmp_path / "o")]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"workbench {argv[0]}: error: "), \
            (argv, lines)


def test_compare_cli_takes_ids_and_ptq_of_an_id(home, folders, tmp_path, capsys):
    assert main(["compare", "ptq:mxfp4@org/tiny", "ptq:nvfp4@org/tiny@main", "--layers", "2",
                 "--out", str(tmp_path / "c"), "--device", "cpu"]) == 0
    t = pd.read_csv(tmp_path / "c" / "compare.csv")
    assert len(t) and set(t.layer) == {2}
    summary = (tmp_path / "c" / "summary.txt").read_text()
    assert summary.count(f"source: hub org/tiny commit {C1}") == 2


def test_plan_cli_reads_an_ids_config(home, tmp_path, capsys):
    tr = pytest.importorskip("transformers")
    folder = tmp_path / "cfg"
    tr.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2, vocab_size=256,
                      head_dim=16).save_pretrained(folder)
    add_snapshot(home, "org/cfg", folder, C1)
    capsys.readouterr()
    rc_id = main(["plan", "org/cfg", "--gpus", "1"])
    by_id = capsys.readouterr().out
    rc_folder = main(["plan", str(folder), "--gpus", "1"])
    by_folder = capsys.readouterr().out
    assert rc_id in (0, 1) and rc_id == rc_folder
    first, rest = by_id.split("\n", 1)
    assert first == f"source: hub org/cfg commit {C1}, cache " + \
        str(repo_folder(home, "org/cfg") / "snapshots" / C1)
    assert rest == by_folder


def test_the_tokenizer_resolves_an_id(home, tmp_path):
    pytest.importorskip("tokenizers")
    from workbench.train.tokenizer import TokenizerError, load_tokenizer, train_bpe

    folder = train_bpe(["hello world, hello hub"] * 50, tmp_path / "tok", vocab_size=300)
    add_snapshot(home, "org/tok", folder, C1)
    a, b = load_tokenizer("org/tok"), load_tokenizer(str(folder))
    assert a.digest == b.digest and a.encode("hello hub") == b.encode("hello hub")
    assert a.source.repo_id == "org/tok" and a.source.revision == C1
    with pytest.raises(TokenizerError, match="--tokenizer org/none: org/none is not in the "
                                             "Hugging Face cache"):
        load_tokenizer("org/none")
    with pytest.raises(TokenizerError, match="without tokenizer.json"):
        load_tokenizer("org/tiny")  # a checkpoint without tokenizer files


def test_source_records_round_trip():
    s = Source("org/x@main", "hub", Path("/c/snap"), None, "org/x", C1, "main")
    assert s.record() == {"spec": "org/x@main", "kind": "hub", "path": "/c/snap", "url": None,
                          "repo_id": "org/x", "revision": C1, "requested_revision": "main"}
    assert s.label() == f"org/x@{C1[:12]}"
