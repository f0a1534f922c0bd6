"""Session-scoped oracle checkpoints, each written once per test session by a third-party library.

Every fixture skips (with the package name) only when the writing library is not installed.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")


@pytest.fixture(scope="session")
def oracle_root(tmp_path_factory):
    return tmp_path_factory.mktemp("oracles")


def _need(*modules: str) -> None:
    for mod in modules:
        pytest.importorskip(mod, reason=f"{mod} writes this oracle checkpoint (.[dev] extra)")


@pytest.fixture(scope="session")
def ct_mxfp4(oracle_root):
    _need("transformers", "compressed_tensors")
    from oracles import write_compressed_tensors

    return write_compressed_tensors(oracle_root / "ct-mxfp4", "MXFP4A16", seed=1)


@pytest.fixture(scope="session")
def ct_nvfp4(oracle_root):
    _need("transformers", "compressed_tensors")
    from oracles import write_compressed_tensors

    return write_compressed_tensors(oracle_root / "ct-nvfp4", "NVFP4A16", seed=2)


@pytest.fixture(scope="session")
def ct_mxfp4_8(oracle_root):
    """8 experts per layer, so 4 expert-parallel ranks hold 2 each; several shards + index, as
    transformers' save_pretrained writes them."""
    _need("transformers", "compressed_tensors")
    from oracles import write_compressed_tensors

    return write_compressed_tensors(oracle_root / "ct-mxfp4-8e", "MXFP4A16", seed=6, num_experts=8,
                                    max_shard_size="100KB")


@pytest.fixture(scope="session")
def gpt_oss(oracle_root):
    _need("transformers")
    from oracles import write_gpt_oss

    return write_gpt_oss(oracle_root / "gpt-oss", seed=3)


@pytest.fixture(scope="session", params=["nvfp4", "mxfp4", "mxfp8"])
def modelopt_ckpt(request, oracle_root):
    _need("modelopt.torch.quantization.qtensor", "transformers")
    from oracles import write_modelopt

    return write_modelopt(oracle_root / f"modelopt-{request.param}", request.param, seed=4)


@pytest.fixture(scope="session")
def modelopt_nvfp4(oracle_root):
    """The NVFP4 member of `modelopt_ckpt`, for tests that need one ModelOpt checkpoint."""
    _need("modelopt.torch.quantization.qtensor", "transformers")
    from oracles import write_modelopt

    return write_modelopt(oracle_root / "modelopt-nvfp4-single", "nvfp4", seed=7)


@pytest.fixture(scope="session")
def fp8_block(oracle_root):
    from oracles import write_fp8_block

    return write_fp8_block(oracle_root / "fp8-block", seed=5)
