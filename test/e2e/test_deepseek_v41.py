"""DeepSeek-V4.1 against the plain oracle (test/reference/deepseek_v41_ref.py) on the two tiny random checkpoints
(CPU, fp32): logits through the KV pool for whole prefills, mixed-length batches, unaligned chunks and decode;
the config descriptor; the checkpoint's release names; refusals.

Between them the two configs hold every layer kind (scripts/tiny_deepseek_v41.py): ratio 0 / 1 / 2, KV sources and
readers, index sources and top-k reusers, the candidate source and a later index source inside its blocks,
Engram layers, YOCO consumers (one a KV source), shifted and non-shifted mHC. Sliding window 4, top-k 3 and
candidate blocks of 2 x 2 entries are far below the prompt lengths (up to 120), so every selection matters.
"""
from __future__ import annotations

import json

import pytest
import torch

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.models.deepseek_v41.config import V41Config
from deepinfer_rt.models.loader import build_model, load_model_config
from helpers import assert_max_abs_close, scattered_slots
from helpers import forward_chunks as step
from helpers import prompt_tokens as prompt

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["a", "b"])
def models(request, tiny_v41_paths, v41_oracles):
    path = tiny_v41_paths[request.param]
    config, _ = load_model_config(path)
    return config, build_model(config, path, "auto", torch.float32, CPU, seed=0), v41_oracles[request.param]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_max_abs_close(got, want, ATOL)


def new_pool(model, config, num_slots: int = 600) -> KVPool:
    return KVPool(model.kv_layout(config), num_pages=num_slots, page_size=1, dtype=torch.float32, device=CPU)


def test_prefill_mixed_lengths_in_one_batch(models):
    config, model, oracle = models
    prompts = [prompt(i, n) for i, n in enumerate((1, 9, 37, 120))]
    pool = new_pool(model, config)
    slots = [scattered_slots(pool, len(p), i) for i, p in enumerate(prompts)]
    got = step(model, pool, [(p, s, 0, len(p)) for p, s in zip(prompts, slots)])
    for p, g in zip(prompts, got):
        assert_close(g, oracle.logits(p))


def test_unaligned_chunks_and_decode(models):
    """A 45-token prompt in chunks of 7 (cutting ratio-2 windows and candidate blocks) beside another sequence's
    decode steps; every chunk's logits equal the oracle's rows for those positions."""
    config, model, oracle = models
    long, short = prompt(7, 45), prompt(8, 12)
    pool = new_pool(model, config)
    s_long, s_short = scattered_slots(pool, len(long), 1), scattered_slots(pool, len(short), 2)
    want_long, want_short = oracle.logits(long), oracle.logits(short)
    step(model, pool, [(short, s_short, 0, 6)])
    for k, start in enumerate(range(0, len(long), 7)):
        end = min(start + 7, len(long))
        chunks = [(long, s_long, start, end)]
        if 6 + k < len(short):
            chunks.append((short, s_short, 6 + k, 7 + k))
        got = step(model, pool, chunks)
        assert_close(got[0], want_long[start:end])
        if len(got) > 1:
            assert_close(got[1], want_short[6 + k : 7 + k])


def test_descriptor_roles(tiny_v41_paths):
    cfg = V41Config.from_raw(json.loads((tiny_v41_paths["a"] / "config.json").read_text()))
    roles = [(s.ratio, s.rope, s.kv_source, s.index_source, s.candidate_source, s.is_candidate_source,
              s.engram_slot, s.is_yoco_consumer) for s in cfg.layers]
    assert roles == [
        (0, "main", None, None, None, False, None, False), (0, "main", None, None, None, False, 0, False),
        (1, "compress", 2, 2, None, False, None, False), (1, "compress", 2, 3, None, False, 1, False),
        (1, "compress", 2, 3, None, False, None, False), (2, "compress", 5, 5, None, True, None, False),
        (2, "compress", 5, 5, None, False, None, True), (2, "compress", 5, 7, 5, False, None, True)]
    assert cfg.hc_shifted and cfg.yoco_capture_layer == 6 and cfg.rms_norm_eps != cfg.hc_eps


def test_yoco_starts_at_the_first_ratio_1_layer_by_default(tiny_v41_paths):
    raw = json.loads((tiny_v41_paths["a"] / "config.json").read_text())
    del raw["text_config"]["n_prefill_layer"]
    raw["text_config"]["engram_layer_ids"], raw["text_config"]["engram_num_embeddings"] = [1], [152]
    cfg = V41Config.from_raw(raw)
    assert cfg.n_prefill_layer == cfg.yoco_capture_layer == 2
    assert [s.is_yoco_consumer for s in cfg.layers] == [False, False] + [True] * 6


def test_release_config_and_names_load(tiny_v41_paths):
    """Variant b is written with the release's tensor names; its inference/config.json (reference names) parses
    to the same descriptor and sizes as the HF composite."""
    path = tiny_v41_paths["b"]
    hf = V41Config.from_raw(json.loads((path / "config.json").read_text()))
    release = V41Config.from_raw(json.loads((path / "inference" / "config.json").read_text()))
    assert release.layers == hf.layers and release.rope_compress == hf.rope_compress
    assert (release.hidden_size, release.engram_num_embeddings, release.hc_shifted) == \
        (hf.hidden_size, hf.engram_num_embeddings, False)


def _composite(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    (lambda c: c["text_config"].update(compress_ratios=[0, 0, 1, 1, 1, 4, 2, 2]), "ratios are 0, 1 or 2"),
    (lambda c: c["text_config"].update(kv_source_layer_ids=[0, 5]), "compress ratio 0"),
    (lambda c: c["text_config"].update(kv_source_layer_ids=[5]), "no kv/index source"),
    (lambda c: c["text_config"].update(index_source_layer_ids=[2, 3, 7]), "candidate_source_layer_id"),
    (lambda c: c["text_config"].update(engram_layer_ids=[1, 7], engram_num_embeddings=[1, 2]), "YOCO"),
    (lambda c: c["text_config"].update(engram_num_embeddings=[5]), "engram_num_embeddings"),
    (lambda c: c["text_config"].update(scoring_func="sigmoid"), "sqrtsoftplus"),
    (lambda c: c["text_config"].update(some_new_field=1), "unsupported fields"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8", "scale_fmt": "ue8m0",
                                             "weight_block_size": [128, 128]}), r"dense blocks are \[32, 32\]"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32]}), "e8m0"),
    (lambda c: c.update(quantization_config={"quant_method": "int4", "weight_block_size": [32, 32]}), "quant_method"),
])
def test_config_errors_are_clear(tiny_v41_paths, change, message):
    raw = _composite(tiny_v41_paths["a"])
    change(raw)
    with pytest.raises(ValueError, match=message):
        V41Config.from_raw(raw)


def test_image_inputs_are_refused(tiny_v41_paths):
    raw = _composite(tiny_v41_paths["a"])
    raw.update(vision_config={"model_type": "deepseek_v41_vision"}, image_token_id=128815)
    cfg = V41Config.from_raw(raw)
    assert cfg.has_vision
    cfg.check_prompt([5, 6, 7])
    with pytest.raises(ValueError, match="image"):
        cfg.check_prompt([5, 128815, 7])



def test_yoco_prefill_truncation_is_exact_for_kept_rows(tiny_v41_paths, v41_oracles, monkeypatch):
    """DEEPINFER_V41_YOCO_TRUNCATION=1: the consumer layers compute only the last sliding window of each prefill
    chunk; those rows' logits move by no more than float rounding (every consumer's KV comes from the shared hidden
    of all rows), decode after a truncated prefill is exact too, and the skipped rows read NaN. Config 'a' reuses
    a pre-consumer index selection in a consumer, which truncation refuses."""
    monkeypatch.setenv("DEEPINFER_V41_YOCO_TRUNCATION", "1")
    path = tiny_v41_paths["b"]
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, CPU, seed=0)
    assert model.model.truncate_prefill
    p, window = prompt(5, 60), model.v41.sliding_window
    want = v41_oracles["b"].logits(p)
    pool = new_pool(model, config)
    slots = scattered_slots(pool, len(p), 0)
    got = step(model, pool, [(p, slots, 0, 50)])[0]
    assert torch.isnan(got[: 50 - window]).all()
    assert_close(got[50 - window :], want[50 - window : 50])
    for pos in range(50, 60):  # decode steps over the truncated prefill's state
        assert_close(step(model, pool, [(p, slots, pos, pos + 1)])[0], want[pos : pos + 1])
    config_a, _ = load_model_config(tiny_v41_paths["a"])
    with pytest.raises(ValueError, match="reuses the index selection of layer 5"):
        build_model(config_a, tiny_v41_paths["a"], "auto", torch.float32, CPU, seed=0)
