"""Kernel timings at DeepSeek-V2-Lite decode shapes (one layer, 2K context), as achieved bytes/s over the bytes
each kernel must read, beside the device copy bandwidth measured in the same run. Variants of the decode
attention's tile (BLOCK_N) and warps show which to use.

    python benchmark/bench_kernels.py --out benchmark/results/gpu_kernels_h200.json

`--only moe_invariant` times the batch-invariant fused MoE beside the default (autotuned) one at V2-Lite shapes,
T = 1 .. 4096 tokens, with the floor max(bytes of the touched experts / copy bandwidth, FLOPs / bf16 matmul
rate), both ceilings measured in the same run. On CPU (`--device cpu`, under TRITON_INTERPRET=1, tiny shapes: a
smoke run, no timing worth reading) the peer is RoutedExperts' torch path, since the autotuner needs a GPU.

    python benchmark/bench_kernels.py --device cuda --only moe_invariant --out benchmark/results/gpu_moe_invariant_h200.json

`--only router`: the router GEMM as cast + cuBLAS, the FMA kernel and the bf16-pieces tensor-core kernel;
`--only moe_sweep`: the fused MoE's grouped GEMMs at prefill size, one row per tile configuration;
`--only decode_sweep` (rows in bench_decode_sweep.py): GQA decode attention (SmolLM2 shape; batch 1 / 4 up to 256
splits; KV copies past L2) over splits and tiles (`--context 32768`: long contexts; `--batches 1,4`: only those), then
the fused MoE's grouped GEMMs at V2-Lite decode batches over tile configurations (not with --batches);
`--only mxfp4` (rows in bench_mxfp4.py): the fused MXFP4 MoE at V4-Flash's expert shapes (256 experts of 4096 x 2048, top-8),
each candidate configuration and the default side by side, beside the bf16 fused MoE on the same weights dequantized,
as fractions of the read-only bandwidth over the touched experts' bytes (0.53 per weight with the e8m0 scales,
against 2), routings rotated between launches so that L2 holds no previous launch's experts.
`--only mla_prefix`: a V2-Lite-shaped MLA prefill chunk of 8K tokens over an 8K / 24K / 56K cached prefix, flash with
the bottom-right causal mask against layers.mla_prefill.prefix_split_attention, as fractions of the bf16 matmul rate.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch
import triton

from deepinfer_kernels.decode_attention import num_splits_for, paged_decode_attention
from deepinfer_kernels.fused_moe import fused_moe
from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
from deepinfer_rt.layers.moe import RoutedExperts, experts_method


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def print_row(row: dict) -> None:
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def _graph_time(fn) -> float:
    """Seconds of fn replayed from a CUDA graph, as the engine's decode step runs it: eager timing of a
    few-microsecond kernel measures its Python launch instead."""
    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e3


def _decode_inputs(batch: int, context: int, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """(q, k, page table, table rows, lengths) of a decode batch, `context` keys per sequence laid out as the
    engine's pool does (each sequence's slots contiguous; page size 1)."""
    k = torch.randn(batch * context, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(batch * context, device="cuda", dtype=torch.int32).view(batch, context)
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, k, table, rows, lens


def attention_rows(context: int, num_sms: int) -> list[dict]:
    """MLA decode (16 heads, 512 + 64 latent) over `context` keys per sequence, laid out as the engine's pool
    does (each sequence's slots contiguous), for the engine's choice of splits and tile and the variants around
    it."""
    rows = []
    for batch in (1, 16, 64, 256):
        q, k, table, rows_, lens = _decode_inputs(batch, context, 16, 1, 576)
        default_splits = num_splits_for(batch, 1, num_sms, 576)
        for splits in sorted({max(1, default_splits // 2), default_splits, 2 * default_splits, 4 * default_splits}):
            for block_n, warps, stages in itertools.product((16, 32, 64), (4, 8), (1, 2, 3)):
                try:
                    s = _graph_time(lambda: paged_decode_attention(
                        q, k, k[..., :512], table, rows_, lens, 1, 0.1, splits, block_n=block_n,
                        num_warps=warps, num_stages=stages))
                except triton.runtime.errors.OutOfResources:
                    continue  # the tile does not fit shared memory at this depth
                rows.append({"kernel": "mla_decode", "batch": batch, "block_n": block_n, "num_warps": warps,
                             "num_stages": stages, "splits": splits, "engine_choice": splits == default_splits,
                             "us": s * 1e6, "bytes_per_s": k.numel() * 2 / s})
                print(f"mla_decode B={batch} splits={splits} block_n={block_n} warps={warps} stages={stages}: "
                      f"{s * 1e6:.1f} us", flush=True)
        del k, table
    return rows


def moe_rows() -> list[dict]:
    rows = []
    e, hidden, inter, topk = 64, 2048, 1408, 6
    gate_up = torch.randn(e, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
    down = torch.randn(e, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    for batch in (1, 16, 64, 256):
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        weights, ids = torch.rand(batch, e, device="cuda").topk(topk, dim=-1)
        touched = int(ids.unique().numel())
        s = _graph_time(lambda: fused_moe(x, gate_up, down, weights, ids))
        nbytes = touched * (gate_up[0].numel() + down[0].numel()) * 2
        rows.append({"kernel": "fused_moe", "batch": batch, "experts_touched": touched, "us": s * 1e6,
                     "bytes_per_s": nbytes / s})
    return rows


def moe_shared_rows() -> list[dict]:
    """A V2-Lite MoE layer (router, 64 routed + 2 shared experts) with its shared experts joined to the routed
    ones in one fused MoE beside the shared MLP run apart (cuBLAS GEMMs + activation + add), from CUDA graphs:
    where the joining pays (deepinfer_rt.layers.moe.FUSED_SHARED_MAX_TOKENS)."""
    from deepinfer_rt.config import ModelConfig
    from deepinfer_rt.layers import moe as moe_module

    config = ModelConfig(architecture="DeepseekV2ForCausalLM", vocab_size=32, hidden_size=2048,
                         intermediate_size=10944, num_layers=1, num_heads=16, num_kv_heads=16, head_dim=192,
                         rms_norm_eps=1e-6, max_position=64, tie_word_embeddings=False, eos_token_ids=(0,),
                         bos_token_id=None, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                         moe_intermediate_size=1408)
    with torch.device("cuda"), build_context(KernelConfig.from_env("cuda")):
        moe = moe_module.MoE(config).to(torch.bfloat16)
    for p in moe.parameters():
        p.data.normal_(0, 0.02)
    moe.process_weights_after_loading()
    joint, limit = moe.joint_experts, moe_module.FUSED_SHARED_MAX_TOKENS
    rows = []
    for batch in (1, 16, 64, 256, 512, 1024):
        x = torch.randn(batch, 2048, dtype=torch.bfloat16, device="cuda")
        moe_module.FUSED_SHARED_MAX_TOKENS = 1 << 20
        try:
            joined = _graph_time(lambda: moe(x))
            moe.joint_experts = None
            apart = _graph_time(lambda: moe(x))
        finally:
            moe.joint_experts, moe_module.FUSED_SHARED_MAX_TOKENS = joint, limit
        rows.append({"kernel": "moe_shared", "batch": batch, "joined_us": joined * 1e6, "apart_us": apart * 1e6,
                     "engine_joins": batch <= limit})
        print(rows[-1], flush=True)
    return rows


def dense_rows(copy_bw: float) -> list[dict]:
    """V2-Lite's dense decode projections at 1-16 rows: the skinny GEMM kernel beside cuBLAS (F.linear), each
    as weight bytes/s over the copy bandwidth, from CUDA graphs."""
    import torch.nn.functional as F

    from deepinfer_kernels.skinny_gemm import skinny_gemm

    rows = []
    shapes = {"q_proj": (3072, 2048), "kv_a_proj": (576, 2048), "o_proj": (2048, 2048),
              "shared_gate_up": (5632, 2048), "shared_down": (2048, 2816), "lm_head": (102400, 2048)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        for m in (1, 4, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ours = _graph_time(lambda: skinny_gemm(x, w))
            cublas = _graph_time(lambda: F.linear(x, w))
            rows.append({"kernel": "skinny_gemm", "weight": name, "n": n, "k": k, "rows": m, "us": ours * 1e6,
                         "cublas_us": cublas * 1e6, "fraction_of_copy_bw": w.numel() * 2 / ours / copy_bw,
                         "cublas_fraction_of_copy_bw": w.numel() * 2 / cublas / copy_bw})
            print(rows[-1], flush=True)
    return rows


def moe_prefill_rows(mm_rate: float) -> list[dict]:
    """Fused MoE at prefill sizes (4 x 2K tokens), rows per block as the engine picks them and the other sizes,
    as FLOP/s beside the bf16 matmul rate."""
    from deepinfer_kernels import fused_moe as fm

    e, hidden, inter, topk = 64, 2048, 1408, 6
    gate_up = torch.randn(e, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
    down = torch.randn(e, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    rows, engine_choice = [], fm._block_m
    for tokens in (2048, 8192):
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        weights, ids = torch.rand(tokens, e, device="cuda").topk(topk, dim=-1)
        chosen = engine_choice(tokens * topk, e)
        for block_m in (32, 64, 128):
            fm._block_m = lambda num_pairs, num_experts, bm=block_m: bm  # noqa: E731
            try:
                s = _time(lambda: fm.fused_moe(x, gate_up, down, weights, ids))
            finally:
                fm._block_m = engine_choice
            flops = 2 * tokens * topk * 3 * hidden * inter
            rows.append({"kernel": "fused_moe_prefill", "tokens": tokens, "block_m": block_m,
                         "engine_choice": block_m == chosen, "us": s * 1e6, "flop_per_s": flops / s,
                         "fraction_of_matmul_rate": flops / s / mm_rate})
            print(rows[-1], flush=True)
    return rows


def router_rows() -> list[dict]:
    """The router GEMM (fp32 logits of bf16 x) three ways, graph-timed: cast + cuBLAS sgemm (F.linear), the
    fp32 FMA kernel, and the tensor-core kernel over the weight's bf16 pieces; V2-Lite's and V3's shapes."""
    import torch.nn.functional as F

    from deepinfer_kernels.router_gemm import router_logits, router_logits_bf16, split_weight

    rows = []
    for e, h in ((64, 2048), (256, 7168)):
        w = torch.randn(e, h, device="cuda") / h**0.5
        pieces = split_weight(w)
        for t in (1, 16, 64, 256, 1024, 8192):
            x = torch.randn(t, h, device="cuda").bfloat16()
            row = {"kernel": "router", "experts": e, "hidden": h, "rows": t,
                   "cublas_us": _graph_time(lambda: F.linear(x.float(), w)) * 1e6,
                   "fma_kernel_us": _graph_time(lambda: router_logits(x, w)) * 1e6,
                   "pieces_kernel_us": _graph_time(lambda: router_logits_bf16(x, pieces)) * 1e6}
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def _moe_launchers(x, gate_up, down, weights, ids, block_m: int):
    """For one batch sorted by expert at `block_m` rows per block: (BLOCK_N, BLOCK_K, warps, stages[, EVEN_K])
    -> {"gate_up": launch, "down": launch}, the fused MoE's two grouped GEMMs at that tile, outside its
    autotuner (EVEN_K by default as the engine sets it: K a multiple of BLOCK_K)."""
    from deepinfer_kernels import fused_moe as fm

    t, topk = ids.shape
    e, two_i, hidden = gate_up.shape
    inter, pairs = two_i // 2, t * topk
    sp, be, npad = fm._align(ids, e, block_m)
    nb = sp.numel() // block_m
    flat_w = weights.flatten().float()
    h = x.new_empty(pairs, inter)
    y = x.new_empty(pairs, hidden)

    def launch(bn: int, bk: int, warps: int, stages: int, even: bool | None = None) -> dict:
        cfg = dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PER_PAIR=False, IEEE=False, num_warps=warps,
                   num_stages=stages)
        return {
            "gate_up": lambda: fm._gate_up[(nb, triton.cdiv(inter, bn))](
                x, gate_up, h, sp, be, npad, pairs, 0, topk, inter, hidden, x.stride(0), gate_up.stride(0),
                gate_up.stride(1), h.stride(0), EVEN_K=hidden % bk == 0 if even is None else even, **cfg),
            "down": lambda: fm._down[(nb, triton.cdiv(hidden, bn))](
                h, down, y, flat_w, sp, be, npad, pairs, 0, hidden, inter, h.stride(0), down.stride(0),
                down.stride(1), y.stride(0), EVEN_K=inter % bk == 0 if even is None else even, **cfg)}

    return launch


MOE_SWEEP_CONFIGS = [(64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4),
                     (64, 64, 4, 5), (128, 32, 8, 5), (64, 128, 8, 3), (256, 64, 8, 3), (256, 32, 8, 4),
                     (128, 128, 8, 3)]
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) tried by `moe_sweep_rows`."""


def moe_sweep_rows(mm_rate: float) -> list[dict]:
    """The fused MoE's two grouped GEMMs at a 4 x 2K-token prefill (V2-Lite: 64 experts, top 6, uniform
    routing), each tile configuration timed alone, with and without the K masks, as FLOP/s over the bf16 matmul
    rate: which configurations the autotuner should be offered."""
    e, hidden, inter, topk, tokens = 64, 2048, 1408, 6, 8192
    gate_up = torch.randn(e, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
    down = torch.randn(e, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    weights, ids = torch.rand(tokens, e, device="cuda").topk(topk, dim=-1)
    pairs = tokens * topk
    flops = {"gate_up": 2 * pairs * hidden * 2 * inter, "down": 2 * pairs * inter * hidden}
    rows = []
    for block_m in (64, 128):
        launch = _moe_launchers(x, gate_up, down, weights, ids, block_m)
        for (bn, bk, warps, stages), even in itertools.product(MOE_SWEEP_CONFIGS, (True, False)):
            for name, fn in launch(bn, bk, warps, stages, even).items():
                try:
                    s = _time(fn)
                except Exception as exc:  # out of shared memory or registers: not a candidate
                    print(name, block_m, bn, bk, warps, stages, even, type(exc).__name__, flush=True)
                    continue
                rows.append({"kernel": f"moe_sweep_{name}", "block_m": block_m, "block_n": bn, "block_k": bk,
                             "num_warps": warps, "num_stages": stages, "even_k": even, "us": s * 1e6,
                             "fraction_of_matmul_rate": flops[name] / s / mm_rate})
                print(f"{name:8s} M{block_m} N{bn} K{bk} w{warps} s{stages} even_k={int(even)}: {s * 1e6:7.1f} us "
                      f"{rows[-1]['fraction_of_matmul_rate']:.3f}", flush=True)
    return rows


def moe_decode_sweep_rows(copy_bw: float) -> list[dict]:
    """The fused MoE's two grouped GEMMs at V2-Lite decode batches (64 routed + 2 shared experts joined, top 6
    + 2, uniform routing), each tile configuration graph-timed alone, as bytes of the touched experts' weights
    over the copy bandwidth: which configurations the autotuner should be offered."""
    from deepinfer_kernels import fused_moe as fm

    e, hidden, inter, topk = 66, 2048, 1408, 8
    gate_up = torch.randn(e, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
    down = torch.randn(e, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    rows = []
    for batch in (64, 256):
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        routed = torch.rand(batch, 64, device="cuda").topk(6, dim=-1).indices
        shared = torch.tensor([64, 65], device="cuda").expand(batch, 2)
        ids = torch.cat([routed.sort(dim=-1).values, shared], dim=1)
        weights = torch.rand(batch, topk, device="cuda")
        touched = int(ids.unique().numel())
        block_m = fm._block_m(batch * topk, e)
        launch = _moe_launchers(x, gate_up, down, weights, ids, block_m)
        for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4,), (2, 3, 4)):
            for name, fn in launch(bn, bk, warps, stages).items():
                try:
                    s = _graph_time(fn)
                except Exception as exc:
                    print(name, batch, bn, bk, warps, stages, type(exc).__name__, flush=True)
                    continue
                weight_bytes = (2 if name == "gate_up" else 1) * inter * hidden * 2  # per touched expert
                frac = touched * weight_bytes / s / copy_bw
                rows.append({"kernel": f"moe_decode_sweep_{name}", "batch": batch, "block_m": block_m,
                             "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
                             "experts_touched": touched, "us": s * 1e6, "fraction_of_copy_bw": frac})
                print(f"{name:8s} B{batch} M{block_m} N{bn} K{bk} w{warps} s{stages}: {s * 1e6:7.1f} us {frac:.3f}",
                      flush=True)
    return rows


def _time_any(fn, device: str) -> float:
    """Seconds per call: CUDA events on the GPU, else the median of 3 wall-clock calls."""
    if device.startswith("cuda"):
        return _time(fn)
    fn()
    return statistics.median(_wall(fn) for _ in range(3))


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ceilings(device: str, numel: int) -> tuple[float, float]:
    """(copy bytes/s, bf16 matmul FLOP/s) measured now on `device`."""
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / _time_any(lambda: dst.copy_(src), device)
    n = 8192 if device.startswith("cuda") else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return copy_bw, 2 * n**3 / _time_any(lambda: a @ a, device)


def moe_invariant_rows(device: str, copy_bw: float, mm_rate: float) -> list[dict]:
    """Batch-invariant fused MoE beside the default fused MoE (the torch path on CPU), uniform random routing."""
    on_cuda = device.startswith("cuda")
    e, hidden, inter, topk = (64, 2048, 1408, 6) if on_cuda else (8, 64, 48, 3)
    dtype = torch.bfloat16 if on_cuda else torch.float32  # the interpreter multiplies bf16 as raw integers
    experts = RoutedExperts(e, hidden, inter).to(device, dtype).requires_grad_(False)
    experts.gate_up_proj.normal_(0, 0.02)
    experts.down_proj.normal_(0, 0.02)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    rows = []
    for batch in (1, 16, 64, 256, 4096) if on_cuda else (1, 16):
        x = torch.randn(batch, hidden, dtype=dtype, device=device)
        weights, ids = torch.rand(batch, e, device=device).topk(topk, dim=-1)
        touched = int(ids.unique().numel())
        invariant = _time_any(lambda: fused_moe(x, gate_up, down, weights, ids, batch_invariant=True), device)
        if on_cuda:
            peer = _time_any(lambda: fused_moe(x, gate_up, down, weights, ids), device)
        else:
            torch_invariant = experts_method(KernelConfig(is_batch_invariant=True))
            peer = _time_any(lambda: torch_invariant.apply(x, gate_up, down, weights, ids), device)
        floor = max(touched * (gate_up[0].numel() + down[0].numel()) * gate_up.element_size() / copy_bw,
                    2 * batch * topk * 3 * hidden * inter / mm_rate)
        rows.append({"kernel": "fused_moe_invariant", "batch": batch, "experts_touched": touched,
                     "us": invariant * 1e6, "peer": "fused_moe" if on_cuda else "torch_invariant",
                     "peer_us": peer * 1e6, "ratio_to_peer": invariant / peer, "floor_us": floor * 1e6,
                     "fraction_of_floor": floor / invariant, "peer_fraction_of_floor": floor / peer})
    return rows


def mla_prefix_rows(mm_rate: float) -> list[dict]:
    """A V2-Lite-shaped MLA prefill chunk (16 heads, q.k 192, v 128) of 8K new tokens over a cached prefix: one
    flash call with the bottom-right causal mask (V padded to 192, as the engine feeds flash) against
    prefix_split_attention (two cuDNN calls merged by log-sum-exp), V padded and at its own 128."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from deepinfer_rt.layers.mla_prefill import prefix_split_attention

    heads, qk, dv, n = 16, 192, 128, 8192
    rows = []
    for prefix in (8192, 24576, 57344):
        g = torch.Generator(device="cuda").manual_seed(prefix)
        q = torch.randn(1, heads, n, qk, dtype=torch.bfloat16, device="cuda", generator=g)
        k = torch.randn(1, heads, prefix + n, qk, dtype=torch.bfloat16, device="cuda", generator=g)
        v = torch.randn(1, heads, prefix + n, dv, dtype=torch.bfloat16, device="cuda", generator=g)
        v_pad = torch.nn.functional.pad(v, (0, qk - dv))
        mask = causal_lower_right(n, prefix + n)

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v_pad, attn_mask=mask, scale=0.1)

        flops = 2 * heads * n * (prefix + n / 2) * (qk + dv)
        ref = flash()[..., :dv].float()
        row = {"kernel": "mla_prefix_chunk", "new_tokens": n, "prefix": prefix, "flops": flops,
               "flash_masked_us": _time(flash) * 1e6}
        for name, vv in (("split_cudnn_padded", v_pad), ("split_cudnn_v128", v)):
            try:
                out = prefix_split_attention(q, k, vv, 0.1)[..., :dv].float()
                row[name + "_max_abs_diff_to_flash"] = (out - ref).abs().max().item()
                row[name + "_us"] = _time(lambda: prefix_split_attention(q, k, vv, 0.1)) * 1e6
            except RuntimeError as e:  # the cuDNN build may not take this head-dim pair
                row[name + "_error"] = str(e).splitlines()[0][:300]
        for key in [k for k in row if k.endswith("_us")]:
            row[key.replace("_us", "_fraction_of_matmul_rate")] = flops / (row[key] / 1e6) / mm_rate
        print_row(row)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_kernels_h200.json")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", help="comma-separated: --only mxfp4 token counts (default 1,16,64,256,2048), "
                                          "decode_sweep batches (default 1,4,16,64,256)")
    parser.add_argument("--mxfp4-configs", help="comma-separated name prefixes of MXFP4_CANDIDATES for --only mxfp4 "
                                                "(default: all)")
    parser.add_argument("--frag-files", nargs="*", default=(),
                        help="--only mxfp4: fused_moe_mxfp4_frag module files (earlier or trial versions) timed "
                             "beside this checkout's")
    parser.add_argument("--only", choices=["kernels", "moe", "dense", "moe_invariant", "router", "moe_sweep",
                                           "decode_sweep", "mxfp4", "mla_prefix"],
                        default="kernels",
                        help="kernels: the default fused MoE (decode and prefill sizes, shared experts joined or "
                             "apart) and the decode attention variants, the dense decode projections; moe / dense: only those")
    args = parser.parse_args()
    if args.only == "moe_invariant":
        if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        copy_bw, mm_rate = ceilings(args.device, 1 << 29 if args.device.startswith("cuda") else 1 << 22)
        rows = moe_invariant_rows(args.device, copy_bw, mm_rate)
        for r in rows:
            print_row(r)
        Path(args.out).write_text(json.dumps({"device": args.device, "copy_bytes_per_s": copy_bw,
                                              "matmul_flop_per_s": mm_rate, "rows": rows}, indent=1))
        return
    copy_bw, mm_rate = ceilings("cuda", 1 << 29)
    if args.only in ("router", "moe_sweep", "decode_sweep", "mxfp4", "mla_prefix"):
        if args.only == "mla_prefix":
            rows = mla_prefix_rows(mm_rate)
        elif args.only == "mxfp4":
            from bench_mxfp4 import mxfp4_moe_rows

            rows = mxfp4_moe_rows(copy_bw, tuple(int(b) for b in (args.batches or "1,16,64,256,2048").split(",")),
                                  tuple(args.mxfp4_configs.split(",")) if args.mxfp4_configs else None,
                                  tuple(args.frag_files))
        elif args.only == "decode_sweep":
            from bench_decode_sweep import gqa_decode_sweep_rows

            rows = gqa_decode_sweep_rows(args.context, copy_bw, tuple(int(b) for b in (args.batches or
                                                                                      "1,4,16,64,256").split(",")))
            rows += moe_decode_sweep_rows(copy_bw) if args.batches is None else []
        else:
            rows = router_rows() if args.only == "router" else moe_sweep_rows(mm_rate)
        Path(args.out).write_text(json.dumps({"copy_bytes_per_s": copy_bw, "matmul_flop_per_s": mm_rate,
                                              "rows": rows}, indent=1))
        return
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = moe_rows() if args.only in ("kernels", "moe") else []
    if args.only == "kernels":
        rows += attention_rows(args.context, num_sms)
    for r in rows:
        r["fraction_of_copy_bw"] = r["bytes_per_s"] / copy_bw
        print_row(r)
    if args.only in ("kernels", "dense"):
        rows += dense_rows(copy_bw)
    if args.only in ("kernels", "moe"):
        rows += moe_shared_rows() + moe_prefill_rows(mm_rate)
    Path(args.out).write_text(json.dumps({"copy_bytes_per_s": copy_bw, "matmul_flop_per_s": mm_rate,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
