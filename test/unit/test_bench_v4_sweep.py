"""benchmark/bench_v4_sweep.py on CPU: the smoke path end to end (tiny widths, the real V4 / V4.1 structure: layer
fit from meta builds, random compact-pool state, eager and fixed-shape uncaptured decode steps, prefill, sweep) and
the floor check refusing a figure no GPU can reach."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
import bench_v4_sweep  # noqa: E402
import v4_sweep_shapes  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("v4sweep") / "sweep.json"
    bench_v4_sweep.main(["--smoke", "--variants", "v4-bf16", "v41-fp8", "--contexts", "40", "--batches", "1", "2",
                         "--out", str(out), "--no-plot"])
    return json.loads(out.read_text())


def test_smoke_rows_and_sweep(smoke):
    for name in ("v4-bf16", "v41-fp8"):
        section = smoke[name]
        assert "error" not in section, section.get("error")
        assert section["layers"] == 4 and section["plans"][0]["fits"]
        rows = section["decode"]
        assert {(r["mode"], r["batch"]) for r in rows} == {(m, b) for m in ("eager", "graphs") for b in (1, 2)}
        for r in rows:
            assert 0 < r["fraction_of_floor"] <= 1 and r["tok_s"] == pytest.approx(r["batch"] * r["tok_s_per_user"])
            assert r["floor_bytes"] > r["batch"] * r["kv_read_bytes_per_seq"] > 0
            assert 1 <= r["touched_experts_min"] <= 8 and r["expected_touched_experts"] <= 8
        graphed = [r for r in rows if r["mode"] == "graphs"]
        # steps + 1 launched: the clock runs from the first step's tokens to the last's
        assert all(r["graph_steps"] == r["steps"] + 1 and not r["is_captured"] for r in graphed)
        assert all(r["cold_wall_ms_per_step"] > 0 and r["wall_ms_per_step"] > 0 for r in rows)
        assert 0 < section["prefill"]["fraction_of_matmul_rate"] <= 1
        assert section["capacity"]["pool_tokens"] > 0 and section["capacity"]["one_sequence_tokens"] > 0
    assert smoke["v4-bf16"]["kv_cache_dtype"] == "auto" and smoke["v41-fp8"]["kv_cache_dtype"] == "fp8_e4m3"
    series = {(s["variant"], s["mode"]) for s in smoke["sweep"]}
    assert series == {(v, m) for v in ("v4-bf16", "v41-fp8") for m in ("eager", "graphs")}
    assert all(len(s["points"]) == 2 for s in smoke["sweep"])
    full = smoke["full_kv"]
    assert full["v4"]["sglang_fp8_bytes_per_token"] == 7705 and full["v41"]["trtllm_long_range_bytes_per_token"] == 890
    for shape in ("v4", "v41"):
        assert full[shape]["fp8_e4m3"]["long_lived_bytes_per_token"] < full[shape]["auto"]["long_lived_bytes_per_token"]
        assert full[shape]["fp8_e4m3"]["recent_bytes_per_token"] < full[shape]["auto"]["recent_bytes_per_token"]


def test_floor_refuses_an_impossible_figure():
    row = {"variant": "v4-bf16", "mode": "graphs", "batch": 64, "context": 8192, "tok_s": 900.0, "floor_tok_s": 1000.0}
    bench_v4_sweep.check_floor(row)
    with pytest.raises(bench_v4_sweep.MeasurementError, match="above the floor"):
        bench_v4_sweep.check_floor(dict(row, tok_s=1000.5))
    with pytest.raises(bench_v4_sweep.MeasurementError, match="gpu_tok_s"):
        bench_v4_sweep.check_floor(dict(row, gpu_tok_s=2000.0))


def test_floor_bytes():
    # 2 MoE layers of 10-byte experts, 3 of 8 experts touched in one, all 8 in the other; 100 KV bytes per sequence
    floor = v4_sweep_shapes.decode_floor(1000.0, {1: 10.0, 2: 10.0}, {1: 3, 2: 8}, 100, 4, 1e6)
    assert floor["floor_bytes"] == 1000 + 30 + 80 + 400
    assert floor["floor_tok_s"] == pytest.approx(4 / (1510 / 1e6))
    assert v4_sweep_shapes.expected_touched(256, 6, 1) == pytest.approx(6)
    assert v4_sweep_shapes.expected_touched(256, 6, 256) == pytest.approx(256 * (1 - (250 / 256) ** 256))


def test_v41_cut_of_40_layers_is_the_release():
    full = json.loads((v4_sweep_shapes.V41_FLASH / "config.json").read_text())["text_config"]
    cut = v4_sweep_shapes.v41_layers(40)
    for key in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                "n_prefill_layer"):
        assert cut[key] == (full[key][:40] if key == "compress_ratios" else full[key])
