"""DeepSeek-V2/V3 (MLA + MoE) against the transformers reference on tiny random checkpoints (CPU, fp32).

Each variant is a checkpoint written by scripts/make_tiny_checkpoint.py (transformers' own save_pretrained),
loaded once by our loader and once by transformers. Prefill, chunked prefill and decode all go through the KV
pool with the torch reference attention backend; every logit row must match HF's full-sequence logits.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.layers.moe import select_experts
from deepinfer_rt.models.loader import build_model, load_model_config
from helpers import forward_chunks as step

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", ROOT / "scripts" / "make_tiny_checkpoint.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
make_tiny_checkpoint = _mod.make_tiny_checkpoint

ATOL = 1e-4
CPU = torch.device("cpu")
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
VARIANTS = {
    "v3": ("deepseek_v3", {}),
    "v3-no-q-lora": ("deepseek_v3", {"q_lora_rank": None}),
    # yarn with mscale != mscale_all_dim exercises both the rotary attention factor and the softmax mscale^2.
    "v3-yarn-no-interleave": ("deepseek_v3", {"rope_parameters": _YARN, "rope_interleave": False}),
    "v2-group-limited": ("deepseek_v2", {}),
    "v2-greedy-no-q-lora": ("deepseek_v2", {"topk_method": "greedy", "q_lora_rank": None}),
}
PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog.",
           "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])"]


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(ModelConfig, our model, HF model, tokenizer) for one variant."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, overrides = VARIANTS[request.param]
    path = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(request.param), seed=0, **overrides)
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, CPU, seed=0)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return config, model, ref, AutoTokenizer.from_pretrained(path)


def new_pool(model, config) -> KVPool:
    return KVPool(model.kv_layout(config), num_pages=512, page_size=1, dtype=torch.float32, device=CPU)


@torch.no_grad()
def hf_logits(ref, tokens: list[int]) -> torch.Tensor:
    return ref(torch.tensor([tokens])).logits[0].float()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"max abs logit error {err:.2e} > {ATOL:.0e}"


def encode(tok, text: str) -> list[int]:
    return [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)


def test_prefill_matches_hf(models):
    config, model, ref, tok = models
    prompts = [encode(tok, p) for p in PROMPTS]
    assert min(map(len, prompts)) < 5 and max(map(len, prompts)) > 30
    expected = [hf_logits(ref, p) for p in prompts]
    pool = new_pool(model, config)
    slots = [torch.tensor(pool.allocator.alloc(len(p))) for p in prompts]
    for p, s, want in zip(prompts, slots, expected):  # one sequence per batch
        (got,) = step(model, pool, [(p, s, 0, len(p))])
        assert_logits_close(got, want)
    # All prompts flattened into one batch, written to fresh slots.
    slots = [torch.tensor(pool.allocator.alloc(len(p))) for p in prompts]
    for got, want in zip(step(model, pool, [(p, s, 0, len(p)) for p, s in zip(prompts, slots)]), expected):
        assert_logits_close(got, want)


def test_chunked_prefill_and_decode_through_pool_match_hf(models):
    """Sequence a: prefill 5, a chunk of 4 over the cached 5, then decode; b: prefill 3, then decode, in the
    same batches. Every step reads the earlier tokens' KV only from the pool."""
    config, model, ref, tok = models
    a = encode(tok, "Multi-head latent attention caches a single compressed vector per token, in every layer.")[:16]
    b = encode(tok, "Tokens go to routed experts and to shared ones.")[:10]
    assert (len(a), len(b)) == (16, 10)
    pool = new_pool(model, config)
    # Interleaved single-slot pages: neither sequence's slots are contiguous.
    pages = pool.allocator.alloc(2 * len(a))
    slots_a, slots_b = torch.tensor(pages[0::2]), torch.tensor(pages[1::2][: len(b)])
    want_a, want_b = hf_logits(ref, a), hf_logits(ref, b)

    got_a, got_b = step(model, pool, [(a, slots_a, 0, 5), (b, slots_b, 0, 3)])
    assert_logits_close(got_a, want_a[0:5])
    assert_logits_close(got_b, want_b[0:3])
    got_a, got_b = step(model, pool, [(a, slots_a, 5, 9), (b, slots_b, 3, 4)])
    assert_logits_close(got_a, want_a[5:9])
    assert_logits_close(got_b, want_b[3:4])
    pos_a, pos_b = 9, 4
    while pos_a < len(a):
        chunks = [(a, slots_a, pos_a, pos_a + 1)] + ([(b, slots_b, pos_b, pos_b + 1)] if pos_b < len(b) else [])
        outs = step(model, pool, chunks)
        assert_logits_close(outs[0], want_a[pos_a : pos_a + 1])
        if len(outs) == 2:
            assert_logits_close(outs[1], want_b[pos_b : pos_b + 1])
        pos_a, pos_b = pos_a + 1, pos_b + 1
    assert pos_b >= len(b)


def _brute_force_select(logits, top_k, scoring_func, topk_method, n_group, topk_group, bias, norm, scale):
    """Per-token Python loops over plain floats, straight from the routing definitions."""
    ids_out, weights_out = [], []
    per_group = logits.shape[1] // n_group
    for row in logits.tolist():
        if scoring_func == "softmax":
            m = max(row)
            exps = [math.exp(x - m) for x in row]
            scores = [x / sum(exps) for x in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-x)) for x in row]
        choice = [s + bb for s, bb in zip(scores, bias)] if topk_method == "noaux_tc" else scores
        allowed = range(len(row))
        if topk_method != "greedy":
            groups = [choice[g * per_group : (g + 1) * per_group] for g in range(n_group)]
            rank = [max(g) if topk_method == "group_limited_greedy" else sum(sorted(g)[-2:]) for g in groups]
            best = sorted(range(n_group), key=lambda g: -rank[g])[:topk_group]
            allowed = [e for e in allowed if e // per_group in best]
        chosen = sorted(sorted(allowed, key=lambda e: -choice[e])[:top_k])
        w = [scores[e] for e in chosen]
        if norm:
            w = [x / sum(w) for x in w]
        ids_out.append(chosen)
        weights_out.append([x * scale for x in w])
    return torch.tensor(ids_out), torch.tensor(weights_out)


@pytest.mark.parametrize("scoring_func,topk_method,norm", [
    ("softmax", "greedy", False), ("softmax", "group_limited_greedy", False),
    ("softmax", "group_limited_greedy", True), ("sigmoid", "noaux_tc", True), ("sigmoid", "noaux_tc", False),
    ("sigmoid", "greedy", True)])
def test_select_experts_matches_brute_force(scoring_func, topk_method, norm):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=gen) * 2
    bias = (torch.randn(16, generator=gen) * 0.3).tolist()
    kwargs = dict(scoring_func=scoring_func, topk_method=topk_method, n_group=4, topk_group=2,
                  norm_topk_prob=norm, routed_scaling_factor=2.5)
    weights, ids = select_experts(logits, 3, correction_bias=torch.tensor(bias), **kwargs)
    want_ids, want_weights = _brute_force_select(logits, 3, scoring_func, topk_method, 4, 2, bias, norm, 2.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    if topk_method != "greedy":  # the group limit must actually bind on this data
        ungrouped = select_experts(logits, 3, correction_bias=torch.tensor(bias),
                                   **dict(kwargs, n_group=1, topk_group=1))[1]
        assert not torch.equal(ids, ungrouped)


@pytest.mark.parametrize("kind,topk_method", [
    ("deepseek_v3", "noaux_tc"), ("deepseek_v2", "greedy"), ("deepseek_v2", "group_limited_greedy")])
@torch.no_grad()
def test_select_experts_matches_hf_router(kind, topk_method):
    """HF's V3 router always scores by sigmoid with noaux_tc; its V2 router by softmax, greedy or
    group_limited_greedy, never renormalising."""
    import transformers

    if kind == "deepseek_v3":
        hf_config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                                  n_group=4, topk_group=2, routed_scaling_factor=2.5)
        router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(hf_config)
        kwargs = dict(scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
    else:
        hf_config = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                                  n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                                  topk_method=topk_method)
        router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(hf_config)
        kwargs = dict(scoring_func="softmax", topk_method=topk_method, norm_topk_prob=False)
    gen = torch.Generator().manual_seed(3)
    router.weight.copy_(torch.randn(16, 32, generator=gen) * 0.3)
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:
        bias.copy_(torch.randn(16, generator=gen) * 0.1)
    hidden = torch.randn(256, 32, generator=gen)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, 3, n_group=4, topk_group=2, correction_bias=bias,
                                  routed_scaling_factor=2.5, **kwargs)
    hf_ids, order = hf_ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.gather(1, order), atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_tiny_checkpoint_routing_is_not_trivial(models):
    """The e2e comparisons only test routing if the tiny checkpoint spreads tokens over experts and, for
    noaux_tc, the correction bias changes choices."""
    config, model, _, tok = models
    captured = []
    moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(moe_layers) >= 2
    hooks = [m.gate.register_forward_hook(lambda mod, inp, out: captured.append(out)) for m in moe_layers]
    prompt = encode(tok, PROMPTS[2])
    pool = new_pool(model, config)
    step(model, pool, [(prompt, torch.tensor(pool.allocator.alloc(len(prompt))), 0, len(prompt))])
    for h in hooks:
        h.remove()
    for logits, moe in zip(captured, moe_layers):
        kwargs = dict(scoring_func=config.scoring_func, topk_method=config.topk_method, n_group=config.n_group,
                      topk_group=config.topk_group, correction_bias=moe.gate.e_score_correction_bias)
        ids = select_experts(logits, config.num_experts_per_tok, **kwargs)[1]
        counts = torch.bincount(ids.flatten(), minlength=config.n_routed_experts)
        assert (counts > 0).sum() >= config.n_routed_experts // 2 and counts.max() < len(prompt)
        if config.topk_method == "noaux_tc":
            unbiased = select_experts(logits, config.num_experts_per_tok,
                                      **dict(kwargs, correction_bias=torch.zeros(config.n_routed_experts)))[1]
            assert not torch.equal(ids, unbiased)


def test_loads_fused_experts_and_skips_mtp_layers(tmp_path):
    """The fused HF v5 expert layout (experts.gate_up_proj / experts.down_proj) loads to the same weights as
    the per-expert one; tensors of layers past num_layers (multi-token prediction) are ignored."""
    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "per_expert", seed=1, num_hidden_layers=2)
    config, _ = load_model_config(path)
    per_expert = build_model(config, path, "auto", torch.float32, CPU, seed=0)

    tensors = load_file(path / "model.safetensors")
    prefix = "model.layers.1.mlp.experts"
    e = range(config.n_routed_experts)
    gate = torch.stack([tensors.pop(f"{prefix}.{i}.gate_proj.weight") for i in e])
    up = torch.stack([tensors.pop(f"{prefix}.{i}.up_proj.weight") for i in e])
    tensors[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
    tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{i}.down_proj.weight") for i in e])
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP tensor
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, fused_dir / "model.safetensors")
    fused = build_model(config, fused_dir, "auto", torch.float32, CPU, seed=0)

    ours, theirs = dict(per_expert.named_parameters()), dict(fused.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_router_stays_fp32_when_model_is_cast(tmp_path):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=2, num_hidden_layers=2)
    config, _ = load_model_config(path)
    fp32 = build_model(config, path, "auto", torch.float32, CPU, seed=0)
    bias = fp32.model.layers[1].mlp.gate.e_score_correction_bias.detach().clone()
    model = build_model(config, path, "auto", torch.bfloat16, CPU, seed=0)
    gate = model.model.layers[1].mlp.gate
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, bias)


def test_kv_layout_is_latent_plus_rope(models):
    config, model, _, _ = models
    layout = model.kv_layout(config)
    assert (layout.num_layers, layout.k_shape, layout.v_shape, layout.v_dim) == (
        config.num_layers, (1, config.kv_lora_rank + config.qk_rope_head_dim), None, config.kv_lora_rank)


def test_shared_experts_join_the_routed_ones():
    """The shared MLP as S extra experts of weight 1 (MoE.process_weights_after_loading's layout, run here
    through the torch grouped path) gives the MoE's routed + shared output."""
    from helpers import moe_config

    from deepinfer_rt.layers.moe import MoE, RoutedExperts, joint_expert_weights

    config = moe_config(hidden=32, experts=6, top_k=2, inter=8)
    gen = torch.Generator().manual_seed(0)
    moe = MoE(config)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(5, 32, generator=gen)
    weights, ids = select_experts(moe.gate(x), 2, n_shared=2)
    assert ids[:, 2:].tolist() == [[6, 7]] * 5 and weights[:, 2:].eq(1).all()
    joint = RoutedExperts(8, 32, 8)
    joint.gate_up_proj.data, joint.down_proj.data = joint_expert_weights(moe.experts, moe.shared_experts, 2)
    torch.testing.assert_close(joint(x, weights, ids), moe(x), rtol=1e-5, atol=1e-6)


def test_rope_tables_are_shared_between_layers():
    """The GPU kernels' cos/sin tables: one pair per distinct rope, not one per layer."""
    from types import SimpleNamespace

    from deepinfer_rt.layers.rotary import RotaryEmbedding

    config = SimpleNamespace(rope_scaling=None, rope_theta=10000.0, max_position=64)
    first, second, other = RotaryEmbedding(config, 16), RotaryEmbedding(config, 16), RotaryEmbedding(config, 8)
    cpu = torch.device("cpu")
    assert first.tables(cpu)[0] is second.tables(cpu)[0]
    assert other.tables(cpu)[0].shape == (64, 4) and first.tables(cpu)[0].shape == (64, 8)
