"""The ported SGLang benchmark programs (benchmark/sglang_programs) run on the tiny model: each completes on two
items, both ways (ours and independent generate calls), and reports its figures."""
from __future__ import annotations

import importlib

import pytest

from benchmark.sglang_programs import PROGRAMS
from benchmark.sglang_programs.harness import format_report, run_benchmark
from deepinfer_rt import Engine


@pytest.fixture(scope="module")
def baseline_engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=65536, enable_prefix_cache=False) as engine:
        yield engine


@pytest.mark.parametrize("name", PROGRAMS)
def test_ported_program_runs_and_reports(name, tiny_engine, baseline_engine):
    module = importlib.import_module(f"benchmark.sglang_programs.{name}")
    report = run_benchmark(module, tiny_engine, baseline_engine, num_items=2)
    ours, independent = report["ours"], report["independent"]
    assert report["num_programs"] == 2 and ours["model_calls"] >= 2
    assert independent["model_calls"] == ours["model_calls"]
    assert ours["programs_per_s"] > 0 and independent["programs_per_s"] > 0 and ours["output_tokens"] > 0
    assert 0.0 <= ours["cache_hit_rate"] <= 1.0
    assert isinstance(report.get("metrics"), dict)
    assert name in format_report(report)


def test_prefix_shared_programs_hit_the_cache(tiny_engine):
    """Few-shot programs share their header: most prompt tokens of the run come from the prefix cache."""
    module = importlib.import_module("benchmark.sglang_programs.mmlu")
    report = run_benchmark(module, tiny_engine, None, num_items=4)
    assert report["ours"]["cache_hit_rate"] > 0.5 and "independent" not in report
