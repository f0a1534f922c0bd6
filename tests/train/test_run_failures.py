"""What a user can fix is one line and exit code 2, once per run (not once per rank), never a
traceback: a fresh run over a run, a batch the world does not divide, a bad --init, a full disk
in every writer of the trainer, JSON no reader can take, a rank that stopped answering, and
`workbench plan` given nonsense. Multi-rank cases run one process per rank (their exit codes and
stderr one by one) or under torchrun (as users launch them). The full disks are injected where
the bytes are written (tests/train/fault_worker.py), and once for real on a small tmpfs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, command, env, one_error_line, rank_processes

from workbench.cli import main as workbench_cli
from workbench.train.checkpointing import list_complete

ARGS = [*TINY, "--recipe", "bf16", "--val-every", "0"]
WORKER = Path(__file__).with_name("fault_worker.py")


def _ranks(n: int, args: list[str], extra_env: dict | None = None, timeout: float = 400
           ) -> list[subprocess.CompletedProcess]:
    """The trainer (with fault_worker's injections) in `n` processes, one per rank."""
    return rank_processes(WORKER, n, args, extra_env, timeout)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    import realdata

    folder = tmp_path_factory.mktemp("hf") / "model"
    return realdata.model_with_tokenizer(folder, realdata.corpus_texts(60))


@pytest.fixture(scope="module")
def text_jsonl(tmp_path_factory) -> Path:
    import realdata

    return realdata.write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl",
                                realdata.corpus_texts(80))


# -- the configuration and the run folder ------------------------------------------------------


def test_a_fresh_run_into_an_existing_run_is_one_line(tmp_path):
    out = tmp_path / "run"
    assert _ranks(1, [*ARGS, "--steps", "1", "--out", str(out)])[0].returncode == 0
    line = one_error_line(_ranks(1, [*ARGS, "--steps", "2", "--out", str(out)]))
    assert f"--out {out} already holds checkpoints of a run (newest step 1)" in line
    assert "pass --resume to continue it" in line


@pytest.mark.distributed
def test_a_batch_the_world_does_not_divide_is_one_line_per_run(tmp_path):
    line = one_error_line(_ranks(2, [*ARGS, "--steps", "1", "--batch", "3",
                                        "--out", str(tmp_path / "run")]))
    assert "global batch 3 must be a multiple of the world size 2" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.distributed
def test_a_refused_command_line_is_one_line_per_run(tmp_path):
    line = one_error_line(_ranks(2, [*ARGS, "--recipe", "foo", "--out", str(tmp_path / "r")]))
    assert "unknown format 'foo'" in line


def test_init_of_a_truncated_download_or_of_links_out_is_one_line(hf_model, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(hf_model, cut)
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    line = one_error_line(_ranks(1, [*ARGS, "--preset", "checkpoint", "--steps", "1",
                                        "--init", str(cut), "--out", str(tmp_path / "a")]))
    assert line.startswith("error: --init:") and str(cut / "model.safetensors") in line, line
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in hf_model.iterdir():
        (linked / f.name).symlink_to(f)
    line = one_error_line(_ranks(1, [*ARGS, "--preset", "checkpoint", "--steps", "1",
                                        "--init", str(linked), "--out", str(tmp_path / "b")]))
    assert "outside the checkpoint folder" in line and str(linked) in line, line


# -- data no reader can take ---------------------------------------------------------------------


@pytest.mark.parametrize("record, words", [
    (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"text": "a lone \\ud800 surrogate"}', "lone surrogate '\\ud800'"),
])
def test_json_no_reader_can_take_is_one_line_naming_the_line(hf_model, text_jsonl, tmp_path,
                                                              record, words):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(text_jsonl.read_bytes() + record + b"\n")
    n = text_jsonl.read_bytes().count(b"\n") + 1
    line = one_error_line(_ranks(1, [*ARGS, "--preset", "checkpoint", "--steps", "1",
                                        "--init", str(hf_model), "--data", str(data),
                                        "--out", str(tmp_path / "run")]))
    assert f"{data}:{n}:" in line and words in line, line


# -- a full disk, in each writer ---------------------------------------------------------------


def _no_space(line: str, path: str) -> None:
    assert line.startswith("error: no space left on ") and f" while writing {path}" in line, line


@pytest.mark.distributed
def test_disk_full_in_the_metrics_is_one_line_per_run(tmp_path):
    out = tmp_path / "run"
    ps = _ranks(2, [*ARGS, "--steps", "6", "--ckpt-every", "2", "--out", str(out)],
                {"ENOSPC": "metrics", "ENOSPC_STEP": "3"})
    _no_space(one_error_line(ps), str(out / "metrics.jsonl"))
    assert [f.step for f in list_complete(out)] == [2]  # stopped at the next step boundary


@pytest.mark.distributed
def test_disk_full_in_one_ranks_export_shard_leaves_no_export(tmp_path):
    out = tmp_path / "run"
    ps = _ranks(2, [*ARGS, "--steps", "2", "--export", "bf16", "--out", str(out)],
                {"ENOSPC": "export", "ENOSPC_RANK": "1"})
    _no_space(one_error_line(ps), str(out / ".tmp-export" / "model-00002-of-00002.safetensors"))
    assert not (out / "export").exists() and not (out / "result.json").exists()
    # the run is resumable, and its export then complete
    ps = _ranks(2, [*ARGS, "--steps", "2", "--export", "bf16", "--resume", "--out", str(out)])
    assert all(p.returncode == 0 for p in ps), ps[0].stderr[-3000:]
    assert sorted(p.name for p in (out / "export").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_disk_full_copying_the_tokenizer_keeps_the_previous_export(hf_model, text_jsonl,
                                                                    tmp_path):
    """A tokenizer that cannot be copied fails the export before its swap into place: the
    export of the previous attempt stays, whole, and nothing looks like a finished new one."""
    out = tmp_path / "run"
    common = [*ARGS, "--preset", "checkpoint", "--init", str(hf_model), "--data",
              str(text_jsonl), "--export", "bf16", "--out", str(out)]
    assert _ranks(1, [*common, "--steps", "1"])[0].returncode == 0
    before = {p.name: p.read_bytes() for p in (out / "export").iterdir()}
    assert "tokenizer.json" in before
    ps = _ranks(1, [*common, "--steps", "2", "--resume", "--allow-config-change", "steps"],
                {"ENOSPC": "tokenizer"})
    _no_space(one_error_line(ps), str(out / ".tmp-export" / "tokenizer.json"))
    assert {p.name: p.read_bytes() for p in (out / "export").iterdir()} == before


def test_disk_full_in_the_token_cache_is_one_line(hf_model, text_jsonl, tmp_path):
    cache = tmp_path / "cache"
    ps = _ranks(1, [*ARGS, "--preset", "checkpoint", "--steps", "1", "--init", str(hf_model),
                    "--data", str(text_jsonl), "--token-cache", str(cache),
                    "--out", str(tmp_path / "run")], {"ENOSPC": "token-cache"})
    line = one_error_line(ps)
    assert line.startswith("error: no space left on ") and f"while writing {cache}/" in line
    assert line.endswith("/tokens.bin"), line


def _unshare_tmpfs() -> list[str] | None:
    """A command prefix that runs in a private mount namespace as (mapped) root, where a tmpfs
    can be mounted; None where the kernel or the sandbox forbids it."""
    if shutil.which("unshare") is None:
        return None
    p = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    return ["unshare", "-rm"] if p.returncode == 0 else None


def test_a_checkpoint_on_a_really_full_disk_names_the_device_and_keeps_the_older(tmp_path):
    """A 3 MiB tmpfs holds one checkpoint of the tiny model, not two: the second fails inside
    DCP's zip writer, which turns ENOSPC into "unexpected pos"; the line says what happened."""
    prefix = _unshare_tmpfs()
    if prefix is None:
        pytest.skip("needs a private mount namespace (unshare -rm) to mount a small tmpfs")
    fs = tmp_path / "fs"
    fs.mkdir()
    out = fs / "run"
    train = command(1, [*ARGS, "--steps", "2", "--ckpt-every", "1", "--keep", "2",
                        "--out", str(out)])
    script = ('mount -t tmpfs -o size=3m tmpfs "$0" || exit 99; "$@"; rc=$?; '
              'ls -a "$0/run/checkpoints"; exit $rc')
    p = subprocess.run([*prefix, "sh", "-c", script, str(fs), *train], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=300, check=False)
    if p.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    line = one_error_line([p])
    assert line.startswith(f"error: no space left on tmpfs (mounted at {fs}") and \
        f"while writing {out / 'checkpoints' / '.tmp-step_00000002'}" in line, line
    assert "older checkpoints are kept" in line
    assert p.stdout.split()[-3:] == [".", "..", "step_00000001"], p.stdout[-500:]


# -- a rank that stops answering ---------------------------------------------------------------


@pytest.mark.distributed
def test_a_frozen_rank_is_named_in_one_line_within_the_distributed_timeout(tmp_path):
    """Rank 1 sleeps before step 3 far past --dist-timeout 0.05 min (3 s): under torchrun the
    job ends (torchrun's own summary aside) with one line naming rank 1, instead of waiting
    torch's 30 minutes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(WORKER), *ARGS, "--steps", "6", "--dist-timeout", "0.05",
           "--out", str(tmp_path / "run")]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
                       env={**env(), "HANG_RANK": "1", "HANG_STEP": "3", "HANG_S": "200"})
    text = p.stdout + p.stderr
    assert p.returncode != 0
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert lines == [("error: rank 1 stopped answering: the other ranks waited --dist-timeout "
                     "(0.05 min) in a collective; it is hung or died")], text[-4000:]
    # torchrun prints a traceback of its own agent; none comes from a rank's code
    assert not re.search(r'File "[^"]*/workbench/', text), text[-4000:]


# -- workbench plan ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "0"], "--gpus must be at least 1, got 0"),
    (["--gpus", "2", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    (["--gpus", "1", "--recipe", "foo"], "unknown format 'foo'"),
    (["--gpus", "1", "--batch", "0"], "--batch must be at least 1"),
])
def test_plan_refuses_nonsense_in_one_line(argv, words, capsys):
    assert workbench_cli(["plan", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and words in err, err
