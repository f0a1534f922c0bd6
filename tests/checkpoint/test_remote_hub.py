"""A hub id missing from the cache, online: the loopback server plays the Hub (HF_ENDPOINT), so
the revision is resolved to its commit through huggingface_hub, tensors are read by range from
``/resolve/<commit>/``, a training rank's shards are downloaded into the Hugging Face cache
before it reads them, and afterwards the same id works offline."""

from __future__ import annotations

import json

import pytest
import torch
from hub_cache import commit_of, repo_folder
from range_server import Fault, RangeServer
from writers import write_ct

from workbench.checkpoint import RemoteReadError, open_checkpoint
from workbench.checkpoint.fetch import open_prefetched, prefetch, rank_files, rank_tensors
from workbench.checkpoint.range_cache import RangeCache
from workbench.checkpoint.remote import RemoteOptions, RetryPolicy
from workbench.checkpoint.select import Selection
from workbench.source import resolve

COMMIT = commit_of(7)
FAST = RetryPolicy(attempts=3, first_wait_s=0.01, max_wait_s=0.02, deadline_s=30)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_ct(tmp_path_factory.mktemp("hubck") / "ck", "mxfp4", layers=4, experts=8,
                    shards=4)


@pytest.fixture
def hub(ckpt, tmp_path, monkeypatch):
    """The server as the Hub for org/moe at COMMIT (main), an empty cache, online."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants as hc
    with RangeServer(ckpt, hub_repo="org/moe", commit=COMMIT) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("WORKBENCH_RANGE_CACHE", str(tmp_path / "ranges"))
        # huggingface_hub reads HF_HUB_OFFLINE once, at its import (the suite imports it
        # offline); the workbench passes the endpoint and cache folder it resolves itself
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        yield srv


def opts(**kw) -> RemoteOptions:
    return RemoteOptions(retry=FAST, progress=False, **kw)


def test_an_uncached_id_is_read_by_range_at_its_commit(hub, ckpt):
    src = resolve("org/moe@main")
    assert (src.kind, src.revision, src.url, src.path) == ("hub", COMMIT,
                                                          f"hf://org/moe@{COMMIT}", None)
    ck = open_checkpoint("org/moe", remote=opts())
    local = open_checkpoint(ckpt)
    assert not ck.is_local and str(ck.path) == f"hf://org/moe@{COMMIT}"
    for layer, e in ((0, 0), (3, 7)):
        assert torch.equal(ck.expert_weight(layer, e, "up").materialize(),
                           local.expert_weight(layer, e, "up").materialize())
    assert all(f is None or f.endswith((".json", ".safetensors"))
               for _, f, _, _ in hub.log.requests)


def test_offline_after_an_online_read_serves_what_was_fetched(hub, ckpt, monkeypatch, tmp_path):
    """The range cache keeps the headers and the ranges read; offline, with the config files in
    the cache, the same question needs no network and a new one is a clear error."""
    import huggingface_hub.constants as hc

    resolve("org/moe", need="config")  # config.json into the cache (a partial snapshot)
    sel = Selection.of(layers=2)
    ck = open_checkpoint("org/moe", remote=opts())
    want = [ck.expert_weight(2, e, "gate").materialize() for e in range(8)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    hub.reset()
    ck = open_checkpoint("org/moe", remote=opts())  # the index and headers: range cache
    got = [ck.expert_weight(2, e, "gate").materialize() for e in range(8)]
    assert hub.log.requests == [] and all(torch.equal(a, b) for a, b in zip(want, got))
    with pytest.raises(RemoteReadError, match="HF_HUB_OFFLINE=1") as e:
        ck.expert_weight(1, 0, "down").materialize()
    assert e.value.tensor.startswith("model.layers.1.mlp.experts.0.down_proj")
    assert sel.layers == frozenset({2})


def test_prefetch_downloads_only_the_ranks_shards(hub, ckpt):
    ck = open_checkpoint(ckpt)
    mine = range(4, 8)  # rank 1 of EP2
    files = rank_files(ck, mine)
    # the oracle, from the index by hand: shards of every tensor but other ranks' experts
    wmap = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    others = {f".experts.{e}." for e in range(4)}
    want = sorted({f for n, f in wmap.items() if not any(o in n for o in others)})
    assert files == want
    names = rank_tensors(ck, mine)
    assert not any(".experts.1." in n for n in names) and any(".experts.5." in n for n in names)

    src = prefetch("org/moe", experts=mine, options=opts())
    snap = repo_folder(hub_home(), "org/moe") / "snapshots" / COMMIT
    assert src.path == snap and src.url == f"hf://org/moe@{COMMIT}"
    assert sorted(p.name for p in snap.glob("*.safetensors")) == want
    hub.reset()
    ck = open_prefetched("org/moe", experts=mine, options=opts())
    # opening again downloads nothing: the snapshot holds the rank's shards
    assert all(f is None or not f.endswith(".safetensors") or r is not None
               for _, f, r, _ in hub.log.requests)
    hub.reset()
    for layer in range(4):
        for e in mine:
            assert torch.equal(ck.expert_weight(layer, e, "down").materialize(),
                               open_checkpoint(ckpt).expert_weight(layer, e, "down").materialize())
    assert hub.log.served == 0  # training reads touch no network


def hub_home():
    import os
    from pathlib import Path

    return Path(os.environ["HF_HOME"])


def test_a_url_prefetch_resumes_and_refuses_unplanned_reads(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    shard = "model-00002-of-00004.safetensors"
    size = (ckpt / shard).stat().st_size
    with RangeServer(ckpt) as srv:
        # the first attempt dies in the middle of the shard (every retry cut short)...
        piece = 4096
        srv.faults = [Fault(shard, "truncate", min_begin=2 * piece, times=FAST.attempts)]
        with pytest.raises(RemoteReadError):
            prefetch(srv.url, experts=range(4), options=opts(cache=None, piece_bytes=piece))
        from workbench.checkpoint.fetch import download_folder

        part = download_folder(srv.url) / (shard + ".incomplete")
        assert part.is_file() and part.stat().st_size == 2 * piece < size
        kept = part.stat().st_size
        # ...the second continues from there: the shard's first bytes are not asked again
        srv.faults = []
        srv.reset()
        src = prefetch(srv.url, experts=range(4), options=opts(cache=None, piece_bytes=piece))
        ranges = [r for _, f, r, _ in srv.log.requests if f == shard]
        last = len(ranges) - 1 - ranges[::-1].index("bytes=0-7")  # the download's first ask
        assert ranges[last + 1:] and all(int(r.split("=")[1].split("-")[0]) >= kept
                                         for r in ranges[last + 1:])
        assert (src.path / shard).read_bytes() == (ckpt / shard).read_bytes()
        ck = open_prefetched(src, experts=range(4), options=opts(cache=None))
        assert torch.equal(ck.expert_weight(0, 1, "gate").materialize(),
                           open_checkpoint(ckpt).expert_weight(0, 1, "gate").materialize())


def test_the_range_cache_cap_is_kept(tmp_path):
    cache = RangeCache(tmp_path / "c", 10_000)
    for i in range(40):
        cache.put(f"k{i}", bytes([i]) * 1000)
    assert cache.size() <= 10_000
    assert cache.get("k39") == bytes([39]) * 1000  # the newest survive
    assert cache.get("k0") is None
    cache.clear()
    assert cache.size() == 0 and cache.get("k39") is None
