"""Remote checkpoints read by byte range, against a loopback HTTP server that counts what it
sends (range_server.py): one layer of a 40-layer packed checkpoint costs that layer's tensors
plus the headers, the index and config.json, and gives the local copy's table bit for bit;
transient faults are retried, lasting ones and lying files are typed errors naming the file and
the tensor, and nothing half-fetched is used or cached."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from range_server import Fault, RangeServer
from safetensors.torch import load_file, save_file
from writers import write_ct

from workbench.analysis import candidate_errors, inspect_checkpoint
from workbench.checkpoint import (
    CorruptShardError,
    MissingFileError,
    RemoteReadError,
    UnsafePathError,
    open_checkpoint,
)
from workbench.checkpoint.range_cache import RangeCache
from workbench.checkpoint.remote import RemoteOptions, RetryPolicy
from workbench.checkpoint.select import Selection

LAYERS, LAYER = 40, 30
FAST = RetryPolicy(attempts=4, first_wait_s=0.01, max_wait_s=0.02, deadline_s=30)


def opts(cache=None, retry=FAST) -> RemoteOptions:
    return RemoteOptions(cache=cache, retry=retry, progress=False)


def reshard_by_layer(src: Path, dst: Path, layers_per_shard: int) -> Path:
    """``src``'s tensors in shards of consecutive layers, names sorted inside each (as
    transformers' save_pretrained lays a checkpoint out), the rest in the last shard."""
    tensors = load_file(src / "model.safetensors")
    shards = -(-LAYERS // layers_per_shard) + 1

    def shard(name: str) -> str:
        i = int(name.split(".")[2]) // layers_per_shard if name.startswith("model.layers.") \
            else shards - 1
        return f"model-{i + 1:05d}-of-{shards:05d}.safetensors"

    dst.mkdir(parents=True)
    wmap = {n: shard(n) for n in sorted(tensors)}
    for f in sorted(set(wmap.values())):
        save_file({n: tensors[n] for n in sorted(tensors) if wmap[n] == f}, str(dst / f))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                  "weight_map": wmap}))
    shutil.copyfile(src / "config.json", dst / "config.json")
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """40 layers x 4 experts, MXFP4 (compressed-tensors), in six shards of 8 layers (and one of
    the embeddings and head) with an index."""
    base = tmp_path_factory.mktemp("remote")
    one = write_ct(base / "one", "mxfp4", layers=LAYERS, experts=4, shards=1)
    return reshard_by_layer(one, base / "ck", 8)


def header_of(path: Path) -> tuple[int, dict]:
    """(header length, header) read by hand from the file: the oracle of what a shard's
    header costs and where its tensors lie."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def expected_bytes(folder: Path, prefix: str) -> tuple[int, int, int]:
    """(bytes of the tensors whose names start with ``prefix``, bytes of all tensors of layer
    LAYER, bytes of the headers + index + config.json)."""
    wanted = layer = 0
    meta = (folder / "model.safetensors.index.json").stat().st_size + \
        (folder / "config.json").stat().st_size
    for shard in sorted(folder.glob("*.safetensors")):
        n, header = header_of(shard)
        meta += 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            size = info["data_offsets"][1] - info["data_offsets"][0]
            wanted += size if name.startswith(prefix) else 0
            layer += size if name.startswith(f"model.layers.{LAYER}.") else 0
    return wanted, layer, meta


def table(ck, layers=LAYER):
    return inspect_checkpoint(ck, select=Selection.of(layers=layers), device="cpu",
                              progress=False).tables


def test_one_layer_costs_that_layer_and_matches_the_local_table(ckpt):
    local = table(open_checkpoint(ckpt))
    wanted, layer, meta = expected_bytes(ckpt, f"model.layers.{LAYER}.mlp.experts.")
    with RangeServer(ckpt) as srv:
        ck = open_checkpoint(srv.url, remote=opts())
        assert not ck.is_local and srv.log.served == meta  # headers, index, config only
        got = table(ck)
        served = srv.log.served
    # the stated bound, and the exact figure: the layer's expert tensors, nothing else
    assert served <= layer + meta
    assert served == wanted + meta
    assert ck.fetch_stats.fetched == served
    for a, b in ((local.experts, got.experts), (local.scales, got.scales)):
        assert len(a) and a.to_csv() == b.to_csv()  # bit for bit, as the CSV writes them
    assert set(got.experts.layer) == {LAYER}


@pytest.mark.parametrize("reader", ["window", "preadv", "safetensors"])
def test_every_reader_fetches_only_the_layer(ckpt, reader):
    """Whatever stack reader a plan asks for, a remote checkpoint's reads are the tensors' own
    ranges (the window reader, which reads through the bytes between tensors, is not used)."""
    from workbench import analysis

    sel = Selection.of(layers="29-30", experts="1-2")  # two runs with other tensors between
    wanted = sum(expected_bytes(ckpt, f"model.layers.{L}.mlp.experts.{e}.")[0]
                 for L in (29, 30) for e in (1, 2))
    _, _, meta = expected_bytes(ckpt, "-")
    with RangeServer(ckpt) as srv:
        ck = open_checkpoint(srv.url, remote=opts())
        plan = analysis.plan("candidate_errors", ck, ["nvfp4"], select=sel, device="cpu",
                             path="batched", reader=reader)
        assert plan.reads.reader == ("safetensors" if reader == "safetensors" else "preadv")
        got = candidate_errors(ck, ["nvfp4"], select=sel, plan=plan, progress=False)
        assert srv.log.served == wanted + meta
    want = candidate_errors(open_checkpoint(ckpt), ["nvfp4"], select=sel, device="cpu",
                            progress=False)
    assert got.experts.to_csv() == want.experts.to_csv()


def test_selection_of_layers_and_experts_reads_only_those(ckpt):
    sel = Selection.of(layers="0-1,39", experts="2-3")
    wanted = sum(expected_bytes(ckpt, f"model.layers.{L}.mlp.experts.{e}.")[0]
                 for L in (0, 1, 39) for e in (2, 3))
    _, _, meta = expected_bytes(ckpt, "-")
    with RangeServer(ckpt) as srv:
        ck = open_checkpoint(srv.url, remote=opts())
        got = candidate_errors(ck, ["nvfp4"], select=sel, device="cpu", progress=False)
        assert srv.log.served == wanted + meta
    local = candidate_errors(open_checkpoint(ckpt), ["nvfp4"], select=sel, device="cpu",
                             progress=False)
    assert local.experts.to_csv() == got.experts.to_csv()
    assert sorted(set(zip(got.experts.layer, got.experts.expert))) == \
        [(L, e) for L in (0, 1, 39) for e in (2, 3)]


def test_a_selection_that_keeps_nothing_says_what_exists(ckpt):
    with pytest.raises(ValueError, match=r"layers 40.*selects no expert weight.*layers 0-39"):
        table(open_checkpoint(ckpt), layers=40)


def test_the_range_cache_serves_a_second_read(ckpt, tmp_path):
    cache = RangeCache(tmp_path / "cache", 1 << 30)
    with RangeServer(ckpt) as srv:
        first = table(open_checkpoint(srv.url, remote=opts(cache)))
        srv.reset()
        ck = open_checkpoint(srv.url, remote=opts(cache))
        again = table(ck)
        # a plain server's files may change: the index, config and each shard's first 8
        # bytes (its size and ETag) are asked again, every range comes from the cache
        small = (ckpt / "model.safetensors.index.json").stat().st_size + \
            (ckpt / "config.json").stat().st_size + 8 * len(list(ckpt.glob("*.safetensors")))
        assert srv.log.served == small
        assert ck.fetch_stats.cached > 0
    assert first.experts.to_csv() == again.experts.to_csv()


def test_a_corrupted_cache_entry_is_fetched_again(ckpt, tmp_path):
    cache = RangeCache(tmp_path / "cache", 1 << 30)
    with RangeServer(ckpt) as srv:
        want = table(open_checkpoint(srv.url, remote=opts(cache)))
        for _, _, p in cache.entries():  # flip one byte in the data of every entry
            raw = bytearray(p.read_bytes())
            raw[-1] ^= 0xFF
            p.write_bytes(bytes(raw))
        srv.reset()
        got = table(open_checkpoint(srv.url, remote=opts(cache)))
        _, _, meta = expected_bytes(ckpt, "-")
        assert srv.log.served >= meta  # everything came over the network again
    assert want.experts.to_csv() == got.experts.to_csv()


def test_a_500_then_success_is_retried(ckpt):
    shard = "model-00004-of-00006.safetensors"  # layers 24-31
    with RangeServer(ckpt) as srv:
        srv.faults = [Fault(shard, "500", times=2), Fault("model.safetensors.index.json",
                                                          "503", times=1)]
        ck = open_checkpoint(srv.url, remote=opts())
        got = table(ck)
        assert ck.fetch_stats.retries == 3
        statuses = [s for _, f, _, s in srv.log.requests if f == shard]
        assert statuses[:3] == [500, 500, 206]
    assert got.experts.to_csv() == table(open_checkpoint(ckpt)).experts.to_csv()


def _first_expert_part(ckpt: Path) -> tuple[str, str]:
    """(shard, tensor) of layer LAYER's first stored expert part, from the index."""
    wmap = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = min(n for n in wmap if n.startswith(f"model.layers.{LAYER}.mlp.experts.0."))
    return wmap[name], name


def test_a_truncated_reply_is_retried_then_used_whole(ckpt):
    shard, _ = _first_expert_part(ckpt)
    with RangeServer(ckpt) as srv:
        ck = open_checkpoint(srv.url, remote=opts())
        srv.faults = [Fault(shard, "truncate", times=1)]
        got = table(ck)
        assert ck.fetch_stats.retries == 1
    assert got.experts.to_csv() == table(open_checkpoint(ckpt)).experts.to_csv()


@pytest.mark.parametrize("kind", ["truncate", "short206", "wrong_range", "ignore_range", "500"])
def test_a_lasting_bad_reply_is_a_typed_error_naming_file_and_tensor(ckpt, tmp_path, kind):
    shard, _ = _first_expert_part(ckpt)
    cache = RangeCache(tmp_path / "cache", 1 << 30)
    with RangeServer(ckpt) as srv:
        ck = open_checkpoint(srv.url, remote=opts(cache))
        srv.reset()
        srv.faults = [Fault(shard, kind, times=1000)]
        with pytest.raises(RemoteReadError) as e:
            table(ck)
        assert e.value.path == f"{srv.url}/{shard}"
        assert e.value.tensor.startswith(f"model.layers.{LAYER}.mlp.experts.")
        # retried only when trying again may help, and then as often as the policy says (the
        # range that raised; reads of other ranges in flight meanwhile may be fewer tries in)
        tries = [r for _, f, r, _ in srv.log.requests if f == shard]
        per_range = {r: tries.count(r) for r in tries}
        want = FAST.attempts if kind in ("truncate", "500") else 1
        assert max(per_range.values()) == want
        # nothing of a failed range was kept: once the server behaves, the same cache gives
        # the local table
        srv.faults = []
        again = table(open_checkpoint(srv.url, remote=opts(cache)))
    assert again.experts.to_csv() == table(open_checkpoint(ckpt)).experts.to_csv()


def test_a_header_claiming_more_bytes_than_the_file(ckpt, tmp_path):
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    shard = bad / "model-00003-of-00006.safetensors"
    _, header = header_of(shard)
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    shard.write_bytes(shard.read_bytes()[:-5])  # the header still claims the full length
    with RangeServer(bad) as srv, pytest.raises(CorruptShardError, match="ends past") as e:
        open_checkpoint(srv.url, remote=opts())
    assert e.value.path == f"{srv.url}/{shard.name}" and e.value.tensor == last
    with pytest.raises(CorruptShardError, match="ends past"):  # the local reader agrees
        open_checkpoint(bad)


def test_a_header_length_past_the_end_of_the_file(ckpt, tmp_path):
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    shard = bad / "model-00001-of-00006.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw))
    shard.write_bytes(bytes(raw))
    with RangeServer(bad) as srv:
        with pytest.raises(CorruptShardError, match="does not fit") as e:
            open_checkpoint(srv.url, remote=opts())
        assert e.value.path == f"{srv.url}/{shard.name}"
        # the lying length was never fetched: only the 8 bytes that told it
        assert srv.log.per_file.get(shard.name) == 8


@pytest.mark.parametrize("name", ["../other/model.safetensors", "https://evil.example/x.safetensors",
                                  "/etc/passwd", "sub/../../x.safetensors", "a%2F..%2Fb"])
def test_a_remote_index_naming_a_shard_outside_the_repo(ckpt, tmp_path, name):
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    idx = bad / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    victim = min(doc["weight_map"])
    doc["weight_map"][victim] = name
    idx.write_text(json.dumps(doc))
    with RangeServer(bad) as srv:
        with pytest.raises(UnsafePathError) as e:
            open_checkpoint(srv.url, remote=opts())
        asked = {f for _, f, _, _ in srv.log.requests}
    assert e.value.tensor == victim and e.value.path.endswith("model.safetensors.index.json")
    assert not any(".." in (f or "") or "evil" in (f or "") or "passwd" in (f or "")
                   for f in asked)


def test_a_missing_shard_and_a_missing_folder(ckpt, tmp_path):
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    (bad / "model-00004-of-00006.safetensors").unlink()
    with RangeServer(bad) as srv:
        with pytest.raises(MissingFileError) as e:
            open_checkpoint(srv.url, remote=opts())
        assert e.value.path == f"{srv.url}/model-00004-of-00006.safetensors"
        with pytest.raises(MissingFileError, match="cannot list"):
            open_checkpoint(srv.url + "/nothing-here", remote=opts())


def test_views_read_the_same_values_remotely(ckpt):
    """Every way a view indexes (an expert, strided rows, a column window, a scalar) gives the
    local bytes."""
    local = open_checkpoint(ckpt)
    with RangeServer(ckpt) as srv:
        ck = open_checkpoint(srv.url, remote=opts())
        for key in [(slice(None), slice(None)), (slice(1, 30, 3), slice(32, 64)),
                    (5, slice(None)), (slice(0, 0), slice(None))]:
            a = local.expert_weight(LAYER, 1, "down")[key]
            b = ck.expert_weight(LAYER, 1, "down")[key]
            assert torch.equal(a, b), key
        name = next(n for n in local.logical_names() if "layernorm" in n)
        assert torch.equal(local.tensor(name).materialize(), ck.tensor(name).materialize())
        e = next(iter(ck.index.entries))
        assert torch.equal(local.index.read(e, (slice(2, 9, 3),)), ck.index.read(e, (slice(2, 9, 3),)))


def test_an_fsspec_url_reads_the_same_table(ckpt):
    """Other schemes go through fsspec (s3://, gs://, ...): its in-memory file system stands in,
    with the same header checks."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/wb-remote-{id(ckpt)}"
    try:
        for f in ckpt.iterdir():
            fs.pipe(f"{root}/{f.name}", f.read_bytes())
        ck = open_checkpoint(f"memory:/{root}", remote=opts())
        assert not ck.is_local
        assert table(ck).experts.to_csv() == table(open_checkpoint(ckpt)).experts.to_csv()
        shard = "model-00003-of-00006.safetensors"
        fs.pipe(f"{root}/{shard}", (ckpt / shard).read_bytes()[:-5])
        with pytest.raises(CorruptShardError, match="ends past") as e:
            open_checkpoint(f"memory:/{root}", remote=opts())
        assert e.value.path == f"memory:/{root}/{shard}"
        fs.rm(f"{root}/model.safetensors.index.json")  # no index: the listing names the shards
        fs.pipe(f"{root}/{shard}", (ckpt / shard).read_bytes())
        assert open_checkpoint(f"memory:/{root}", remote=opts()).layout == "compressed-tensors"
    finally:
        fs.rm(root, recursive=True)


def test_a_file_changed_on_the_server_is_never_mixed(ckpt, tmp_path):
    """Open, then the server's shard changes (same size, new content, new ETag): a read is an
    error naming it, and a fresh open reads the new version, not cached bytes of the old."""
    folder = shutil.copytree(ckpt, tmp_path / "live")
    shard, name = _first_expert_part(folder)
    cache = RangeCache(tmp_path / "cache", 1 << 30)
    with RangeServer(folder) as srv:
        ck = open_checkpoint(srv.url, remote=opts(cache))
        before = ck.index.read(name)
        raw = bytearray((folder / shard).read_bytes())
        e = ck.index.entry(name)
        raw[e.begin:e.end] = bytes(255 - x for x in raw[e.begin:e.end])
        (folder / shard).write_bytes(bytes(raw))
        other = next(n for n, x in ck.index.entries.items() if x.file == e.file and n != name)
        with pytest.raises(RemoteReadError, match="changed on the server") as err:
            ck.index.read(other)
        assert err.value.path == f"{srv.url}/{shard}" and err.value.tensor == other
        again = open_checkpoint(srv.url, remote=opts(cache)).index.read(name)
    assert torch.equal(again.view(torch.uint8), (255 - before.view(torch.uint8)))


def test_the_test_server_logs_a_request_before_the_client_has_its_reply(tmp_path, monkeypatch):
    """The tests reset the server's log and then assert "no request since": a reply the client
    already had (a 404's headers are all of it) must never be logged after that reset."""
    import http.server
    import time
    import urllib.error
    import urllib.request

    real = http.server.BaseHTTPRequestHandler.end_headers

    def slow_after_headers(self):  # the server thread loses the CPU once the reply is out
        real(self)
        time.sleep(0.5)

    monkeypatch.setattr(http.server.BaseHTTPRequestHandler, "end_headers", slow_after_headers)
    with RangeServer(tmp_path) as srv:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{srv.url}/missing.json", timeout=30)
        assert e.value.code == 404
        assert srv.log.requests == [("GET", "missing.json", None, 404)]
