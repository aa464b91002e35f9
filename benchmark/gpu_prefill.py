"""bench_gpu.py's prefill measurements: prompts of one length beside the matmul rate (bench_prefill), the MLA
prefix split off on the same engine (bench_prefill_unsplit, --prefill-split-ab), prompts of many lengths met for the
first time and again (bench_prefill_mixed, --prefill-mixed); and the GPU sync and kernel profile they share with
bench_gpu.py's decode rows."""
from __future__ import annotations

import statistics
import time

import torch

from deepinfer_rt import Engine, SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile(fn, rows: int = 20) -> list[str] | str:
    """The `rows` top kernels of one call by GPU time (kernels inside a graph replay are recorded individually)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync()
        return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70
                                         ).splitlines()
    except Exception as e:  # the profiler is a diagnostic: its failure must not lose the figures
        return f"profile failed: {e!r}"


def prefill_flops(engine: Engine, tokens_per_seq: int, num_seqs: int) -> float:
    """2 * active matmul params (no embeddings, no LM head) * tokens + causal attention (QK and PV over half
    the square) at the model's head dims."""
    mc = engine.model_config
    active = 0
    for name, p in engine.model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or "lm_head" in name:
            continue  # prefill computes logits for the last token of each prompt only
        n = p.numel()
        if ".experts." in name:
            n = n // mc.n_routed_experts * mc.num_experts_per_tok
        active += n
    layout = engine.pool.layout
    qk_dim, v_dim = layout.k_shape[1], layout.v_dim
    if mc.is_mla:  # the model's own head dims, not the absorbed form's latent-wide ones (576 / 512)
        qk_dim, v_dim = mc.qk_nope_head_dim + mc.qk_rope_head_dim, mc.v_head_dim
    attn = 2 * mc.num_layers * mc.num_heads * (qk_dim + v_dim) * tokens_per_seq**2 / 2 * num_seqs
    return 2 * active * tokens_per_seq * num_seqs + attn


def bench_prefill(engine: Engine, context: int, num_seqs: int, matmul_rate: float, vocab: int) -> dict:
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(4):  # the first compiles (and autotunes) the prefill-shaped kernels; the median of the rest
        prompts = torch.randint(0, vocab, (num_seqs, context), generator=g).tolist()
        _sync()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        runs.append(time.perf_counter() - t0)
    seconds = statistics.median(runs[1:])
    flops = prefill_flops(engine, context, num_seqs)
    prompts = torch.randint(0, vocab, (num_seqs, context), generator=g).tolist()  # fresh: no cache hits
    return {"num_seqs": num_seqs, "context": context, "tok_s": num_seqs * context / seconds,
            "run_seconds": runs,
            "flop_per_s": flops / seconds, "fraction_of_matmul_rate": flops / seconds / matmul_rate,
            "profile": _profile(lambda: engine.generate(input_ids=prompts, sampling_params=params))}


def bench_prefill_unsplit(engine: Engine, context: int, ceil: dict, vocab: int) -> dict:
    """bench_prefill with every MLA layer's chunks over a cached prefix in one masked SDPA call (flash) instead of
    prefix_split_attention: the same engine, the A/B of --prefill-split-ab."""
    from deepinfer_rt.layers.mla import MLAttention

    layers = [m for m in engine.model.modules() if isinstance(m, MLAttention)]
    before = [m.prefix_split for m in layers]
    for m in layers:
        m.prefix_split = False
    try:
        return dict(bench_prefill(engine, context, 4, ceil["bf16_matmul_flop_per_s"], vocab), mla_prefix_split=False)
    finally:
        for m, b in zip(layers, before):
            m.prefix_split = b


def bench_prefill_mixed(engine: Engine, count: int, longest: int, vocab: int) -> dict:
    """Prefill of `count` prompts of distinct lengths (uniform over [longest / 8, longest], one at a time, as an
    extraction job over documents of many sizes meets them): wall seconds of a first pass, where every length and
    its chunks' attention shapes are new (cuDNN plans its SDPA per shape), and of a second pass over the same
    lengths with fresh tokens."""
    g = torch.Generator().manual_seed(11)
    lengths = sorted(set(torch.randint(longest // 8, longest + 1, (count,), generator=g).tolist()))
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    passes = []
    for _ in range(2):
        _sync()
        t0 = time.perf_counter()
        for n in lengths:
            engine.generate(input_ids=[torch.randint(0, vocab, (n,), generator=g).tolist()], sampling_params=params)
        _sync()
        passes.append(time.perf_counter() - t0)
    return {"prompts": len(lengths), "tokens": sum(lengths), "first_pass_s": passes[0], "second_pass_s": passes[1],
            "first_pass_tok_s": sum(lengths) / passes[0], "second_pass_tok_s": sum(lengths) / passes[1]}
