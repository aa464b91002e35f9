"""Every DEEPINFER_* environment variable, typed, in one place.

Read through the accessors below (never os.environ elsewhere), so a variable is documented where declared.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value in (None, "") else int(value)


def _optional_bool(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value in (None, "") else _bool(name, False)


def _str(name: str, default: str) -> str:
    value = os.environ.get(name)
    return default if value in (None, "") else value


@dataclass(frozen=True)
class Env:
    cache_dir: Path
    """DEEPINFER_CACHE: where converted models (the embedded default) are kept. Default ~/.cache/deepinfer."""
    batch_invariant: bool
    """DEEPINFER_BATCH_INVARIANT=1: batch-invariant numerics (outputs independent of batch composition)."""
    log_level: str
    """DEEPINFER_LOG_LEVEL: logging level of the deepinfer loggers (default WARNING)."""
    kv_cache_memory_fraction: float
    """DEEPINFER_KV_CACHE_MEMORY_FRACTION: share of free memory given to the KV pool when its size is not set."""
    kv_cache_max_cpu_gib: float
    """DEEPINFER_KV_CACHE_MAX_CPU_GIB: upper bound of the KV pool on CPU when sized from memory (GiB)."""
    v4_kv_layout: str
    """DEEPINFER_V4_KV_LAYOUT: DeepSeek-V4's KV pool, 'compact' (default: entries once per compression window,
    sliding keys and compressor inputs only for recent tokens and checkpoints) or 'per_token' (every state of
    every token, the earlier layout, kept as the reference)."""
    v4_checkpoint_tokens: int
    """DEEPINFER_V4_CHECKPOINT_TOKENS: compact V4 pool: every this many tokens a sequence keeps its recent
    state (sliding keys, compressor inputs) so a prefix-cache hit can resume there (default 16384; prompt ends and hit points are kept too)."""
    v4_release_margin: int
    """DEEPINFER_V4_RELEASE_MARGIN: compact V4 pool: tokens a sequence keeps beyond what its next step reads
    (default 64: a speculative rewind, and prefix hits a little before a finished sequence's end)."""
    v4_cuda_graphs: bool
    """DEEPINFER_V4_CUDA_GRAPHS=0: decode DeepSeek-V4 / V4.1 eagerly on CUDA instead of through CUDA graphs (the
    fixed-shape step of models/deepseek_v4/graph_batch.py, which needs the compact pool; checked on the H200 by
    test/gpu/test_gpu_v4_graphs.py, and on CPU uncaptured)."""
    v4_recent_fraction: float
    """DEEPINFER_V4_RECENT_FRACTION: compact V4 pool: pages of recent state per page of the main pool
    (default 0.05: a running sequence holds ~R + a page of rows, checkpoints R per K tokens; 1.0 can never
    run short)."""
    grammar_compile_timeout_s: float
    """DEEPINFER_GRAMMAR_COMPILE_TIMEOUT: seconds a grammar may take to compile before its request errors."""
    num_threads: int
    """DEEPINFER_NUM_THREADS: torch intra-op threads on CPU (0 = torch's default)."""
    ep_worker_pool: bool
    """DEEPINFER_EP_WORKER_POOL=1: run ep_size=1 through the expert-parallel worker pool too (one worker)."""
    ep_local_workers: int
    """DEEPINFER_EP_LOCAL_WORKERS: EP ranks the engine starts itself (0 = all); ranks from this one on are
    started elsewhere: `python -m deepinfer_rt.distributed.worker tcp://DEEPINFER_EP_HOST:DEEPINFER_EP_PORT`."""
    ep_host: str
    """DEEPINFER_EP_HOST: address the engine listens on for its EP workers and their rendezvous (127.0.0.1)."""
    ep_port: int
    """DEEPINFER_EP_PORT: the engine's port for EP workers (0 = any free port; fix it for remote workers)."""
    master_addr: str | None
    """MASTER_ADDR (torch.distributed's own name): where the EP ranks' rendezvous listens, when set for the
    engine's process (multi-node: an address every node reaches); else DEEPINFER_EP_HOST."""
    master_port: int
    """MASTER_PORT (torch.distributed's own name): the rendezvous port, when set for the engine's process (0 = a
    free port)."""
    ep_step_timeout_s: float
    """DEEPINFER_EP_STEP_TIMEOUT: seconds a step may take before an EP worker counts as hung (default 30)."""
    ep_start_timeout_s: float
    """DEEPINFER_EP_START_TIMEOUT: seconds EP workers may take to load the model and report ready."""
    ep_cuda_graphs: bool
    """DEEPINFER_EP_CUDA_GRAPHS=0: EP workers at EP > 1 run every step eagerly with the exact (host-sized)
    dispatch/combine, instead of replaying decode CUDA graphs on every rank through the capture-safe exchange
    (distributed/ep.py). Default on; one rank always replays graphs (it has no exchange)."""
    ep_padded_dispatch: bool
    """DEEPINFER_EP_PADDED_DISPATCH=1: every decode step of every rank (EP > 1) runs the capture-safe exchange,
    graphs or not: on the CPU, the graph path's exchange checked eagerly. Default off."""
    ep_capacity_factor: float
    """DEEPINFER_EP_CAPACITY_FACTOR: rows of each (source, destination) block of the capture-safe exchange as a
    multiple of a destination's even share of a rank's T x k pairs (capped at T x k); 0 (default) = T x k, the
    worst case, which never overflows. A step whose routing overflows a block fails with an error."""
    eplb: bool
    """DEEPINFER_EPLB=1: expert-parallel load balancing (redundant copies of hot experts, rearranged)."""
    eplb_window_steps: int
    """DEEPINFER_EPLB_WINDOW: steps of per-expert load the placement policy judges (default 64)."""
    eplb_interval_steps: int
    """DEEPINFER_EPLB_INTERVAL: steps between expert rearrangements (default 32)."""
    eplb_redundant_per_rank: int
    """DEEPINFER_EPLB_REDUNDANT: extra expert slots per rank for copies of hot experts (default 2)."""
    moe_router_skew: float
    """DEEPINFER_MOE_ROUTER_SKEW: benchmarks only; biases MoE routers toward low expert ids (Zipf exponent)."""
    cuda_graph_max_bs: int
    """DEEPINFER_CUDA_GRAPH_MAX_BS: largest decode batch replayed from a CUDA graph (0 = no graphs)."""
    cuda_graph_max_context: int
    """DEEPINFER_CUDA_GRAPH_MAX_CONTEXT: longest context a graph decodes (default: every context the model and
    the KV pool allow; the page table's rows are as wide as the pool lets one request grow)."""
    spec_max_draft: int
    """DEEPINFER_SPEC_MAX_DRAFT: most draft tokens a request verifies per step under speculation (default 5)."""
    overlap: bool | None
    """DEEPINFER_OVERLAP: overlap scheduling (prepare step N+1 while the device runs step N); unset = on for
    CUDA, off on CPU (where the device is the host, so nothing overlaps)."""
    skinny_gemm: bool
    """DEEPINFER_SKINNY_GEMM: large dense projections (the LM head) of at most 16 rows (decode at small batch)
    on CUDA through deepinfer_kernels.skinny_gemm instead of cuBLAS (default on; 0 = cuBLAS). Not in
    batch-invariant mode."""
    fp8_gemm: str
    """DEEPINFER_FP8_GEMM: the block-scaled FP8 GEMM of FP8 linears on CUDA (deepinfer_kernels.fp8_gemm): 'auto'
    (default: per row count and output width, fp8_gemm.auto_path, measured on an H200 and an H100), 'triton' (the
    fused kernel, activations quantized in every N tile, K split over programs at up to 16 rows), 'tiled'
    (activations quantized once, then a Triton GEMM with autotuned large tiles), 'scaled_mm' (torch's cuBLASLt
    block-scaled GEMM on SM90, torch >= 2.10; the tiled path for shapes it does not take), 'gemv' (the CUDA-core
    form, deepinfer_kernels.fp8_gemv, up to 4 rows; auto's path above; auto takes it at one row) or 'w16' (the weight
    tile dequantized in registers times 16-bit activations, deepinfer_kernels.fp8_w16; auto takes it past one row for
    scale blocks narrower than 128 columns (V4.1's) at up to 256 rows; grouped GEMMs take auto's path) or 'dequant'
    (the weight dequantized into scratch in one launch, then torch's 16-bit GEMM: deepinfer_kernels.fp8_dequant;
    grouped GEMMs take auto's path)."""
    fp8_split_sum: str
    """DEEPINFER_FP8_SPLIT_SUM: how the fused FP8 GEMM's K splits (at up to 16 rows) are added: 'kernel' (default: a
    second launch) or 'last_program' (each output tile's last split adds them, the same bits, one launch fewer per
    GEMM; not faster where timed: V2-Lite FP8 at batch 1 on an H100, 360 against 373 tok/s)."""
    fp8_split_rows: int | None
    """DEEPINFER_FP8_SPLIT_ROWS: the most rows at which an FP8 linear's `auto` GEMM takes the fused kernel with K
    split over programs (narrow outputs, 128 x 128 blocks); unset: deepinfer_kernels.fp8_gemm.SPLIT_K_MAX_ROWS."""
    fp8_grouped: bool
    """DEEPINFER_FP8_GROUPED (default on): the grouped output projection (wo_a) of an FP8 model with 128 x 128 blocks
    (V4) stays FP8 on CUDA, one grouped block-scaled GEMM (deepinfer_kernels.fp8_gemm's `groups`; V4.1's 32 x 32
    blocks always dequantize, layers/fp8.py Fp8BlockLinear.takes_groups); 0 dequantizes it at load to the model
    dtype for the grouped product of the model's method (the form before, twice the bytes)."""
    mxfp4_fragment: bool
    """DEEPINFER_MXFP4_FRAGMENT (default on): on CUDA, MXFP4 experts are repacked at load into the order Hopper's
    wgmma fragment takes them and into contiguous 64-row tiles, their scales with them
    (deepinfer_kernels.fused_moe_mxfp4_frag: the same bytes, a cheaper decode, streamed reads; bf16 operands)
    wherever the shapes allow (K and rows multiples of 128); 0 keeps
    the release order and fused_moe_mxfp4's forms (tl.dot_scaled, the GEMV form at one token)."""
    fp8_moe_tiles: bool
    """DEEPINFER_FP8_MOE_TILES (default off until timed on a GPU): on CUDA, FP8 experts (and the shared experts joined
    to them) are reordered at load into contiguous tiles of 64 rows x one scale block of inputs (128 in the
    releases; deepinfer_kernels.fused_moe_fp8 tile_experts: the same bytes, the same sums), so each program of the
    FP8 fused MoE streams its weights front to back; where the widths are not multiples of 64 and of the scale block
    the row layout stays."""
    fp8_kv_dot: str
    """DEEPINFER_FP8_KV_DOT: the dots of the decode attention kernel over an FP8 KV pool with a 16-bit model: 'f16'
    (default: tiles and query in fp16; e4m3 converts to fp16 in one instruction per two values) or 'query' (the
    tiles convert to the query's dtype, bf16 through fp32); deepinfer_kernels.decode_attention.FP8_KV_DOTS."""
    mla_mha_prefill: bool | None
    """DEEPINFER_MLA_MHA_PREFILL: MLA prefill chunks in the standard (expanded K/V) form. Unset = on for the
    Triton backend, for chunks of at least deepinfer_rt.layers.mla_prefill.MHA_MIN_QUERIES new tokens; 1 = every
    chunk of more than one new token, on any backend (CPU tests); 0 = never. Never in batch-invariant mode."""
    mla_prefix_split: bool | None
    """DEEPINFER_MLA_PREFIX_SPLIT: a standard-form MLA prefill chunk over a cached prefix attends as two kernels
    with no mask, the prefix keys and its own keys (causal), merged by their log-sum-exps (cuDNN's SDPA on CUDA,
    which takes no bottom-right causal mask). Unset = on for CUDA in 16-bit dtypes on Hopper or newer (cuDNN >=
    9.3), for chunks whose new and cached token counts are multiples of layers.mla_prefill.PREFIX_SPLIT_ALIGN (cuDNN
    plans one kernel per shape); 1 = every chunk over a prefix, on any device (CPU tests); 0 = one masked SDPA call
    (flash)."""
    v41_yoco_truncation: bool
    """DEEPINFER_V41_YOCO_TRUNCATION=1: DeepSeek-V4.1 prefill chunks run the YOCO consumer layers only for their last
    sliding window of queries (their KV still comes from every token's shared hidden); the other rows' outputs are
    not computed, so prompt logprobs are refused. Default off."""
    v41_engram_host: bool
    """DEEPINFER_V41_ENGRAM_HOST=1: DeepSeek-V4.1's Engram tables stay in host memory (they are large); each step
    gathers the rows of its n-gram hashes there and copies only those to the device. Default off (tables on the
    device)."""
    # ---- the HTTP server's input limits and supervision ----
    max_body_bytes: int
    """DEEPINFER_MAX_BODY_BYTES: largest request body the server reads (default 16 MiB; beyond it: 413, checked
    before the body is read)."""
    json_offload_bytes: int
    """DEEPINFER_JSON_OFFLOAD_BYTES: bodies larger than this are parsed in a worker thread, off the event loop
    (default 256 KiB)."""
    max_json_depth: int
    """DEEPINFER_MAX_JSON_DEPTH: deepest nesting of a request body, and of a JSON schema given to
    SamplingParams (default 64)."""
    max_prompt_chars: int
    """DEEPINFER_MAX_PROMPT_CHARS: longest prompt or message text, in characters, before tokenizing (default
    1,000,000; the model context bounds the tokens)."""
    max_grammar_chars: int
    """DEEPINFER_MAX_GRAMMAR_CHARS: longest regex, EBNF grammar or serialized JSON schema (default 256 KiB)."""
    request_timeout_s: float
    """DEEPINFER_REQUEST_TIMEOUT: seconds a request may take from admission to its last token before it is
    aborted with 504 (or an error event on a stream); 0 = no limit. Default 600."""
    control_timeout_s: float
    """DEEPINFER_CONTROL_TIMEOUT: seconds /get_server_info, /metrics and /flush_cache wait for the engine
    process before answering 503 (default 10)."""
    heartbeat_interval_s: float
    """DEEPINFER_HEARTBEAT_INTERVAL: how often the scheduler process reports that its loop turns (default 1 s)."""
    heartbeat_timeout_s: float
    """DEEPINFER_HEARTBEAT_TIMEOUT: seconds without a heartbeat after which the engine counts as stuck: /health
    answers 503 and new requests are refused until it beats again (default 60; one step may take this long)."""
    cpu_dense_copy: bool
    """DEEPINFER_CPU_DENSE_COPY=0: weight-only int8 / Q4_1 linears dequantize their weight for every call of more
    than 4 rows instead of keeping the dequantized copy (model dtype) made on the first such call: the model's
    16-bit bytes again in memory, for batch and prefill GEMMs 10-15x faster than dequantizing each time."""
    cpu_fast_step: bool
    """DEEPINFER_CPU_FAST_STEP=0: Llama-family models on CPU run their trunk through the modules (the reference
    path) instead of the flat CPU step (models/llama_step.py). Default on."""
    gpu_row_step: bool
    """DEEPINFER_GPU_ROW_STEP=0: Llama-family models on CUDA run steps of a few tokens through the modules instead of
    the fused row step (models/llama_gpu_step.py: six launches a layer). Default on."""
    gpu_pdl: bool
    """DEEPINFER_GPU_PDL (default on): the kernels that take it run as programmatic dependent launches on SM90+ GPUs:
    each may start while the one before it finishes and waits for it in-kernel before touching what other kernels
    touch. They are the Llama row step's products, the decode attention and its merge (timed: SmolLM2 at batch 1
    on an H100, 0.75 -> 0.61 ms a step at 2K context, 1.01 -> 0.90 ms at 32K; batch 16 unchanged), and, not yet
    timed: the FP8 GEMM's fused path and split sum, the fused MoEs (bf16, FP8, MXFP4's GEMV form) with their
    quantizations and slot sums, RMSNorm, MLA's rope-and-store, routing, and V4 / V4.1's Triton kernels (norms,
    rotation, hyper-connections, Sinkhorn, pooling, indexer, sparse attention) and the FP8 KV row writes. 0 turns
    it off."""
    cpu_bf16_gemv: str
    """DEEPINFER_CPU_BF16_GEMV: how the flat CPU step multiplies a lone bf16 row (a single decode stream) by a dense
    weight (models/cpu_row_products.py ROW_PRODUCTS): 'linear' (F.linear, the module path's op), 'mv' (torch.mv),
    'packed' (oneDNN over a copy of each weight packed for one row: the model's bf16 bytes again in memory), 'kernel' (the
    lone-row kernels, kernels/cpu/row_decode.cpp: a whole layer in one call) or 'auto'
    (default: each timed once on the model's gate_up weight at the first step; F.linear kept unless another is at
    least 1.15x faster)."""
    cpu_fp32_row: str
    """DEEPINFER_CPU_FP32_ROW: how the flat CPU step runs a lone fp32 row (a single decode stream): 'kernel' (default:
    one call of the lone-row kernels per layer, kernels/cpu/row_decode.cpp; sums in another order than torch's
    mm, so values differ from the module path's in the last bits; where the kernels cannot be built, 'mm') or
    'mm' (torch's matmul: the module path's bits)."""
    cpu_quant_row: str
    """DEEPINFER_CPU_QUANT_ROW: how the flat CPU step runs decode rows of a weight-only quantized model
    (quantization="q4_1" or "int8") on a CPU with native bf16 (AVX512-BF16 / AMX): 'kernel' (default: up to 3 rows
    through one call of the decode-row kernels per layer reading the 4-bit codes or int8 rows, more rows through
    the same call over the layers' dequantized 16-bit copies; kernels/cpu/row_decode.cpp; where the kernels cannot
    be built, 'torch') or 'torch' (torch's 4-bit / int8 weight-pack matmuls per linear, as on other CPUs)."""
    cpu_compile: bool
    """DEEPINFER_CPU_COMPILE=1: the flat CPU step compiled with torch.compile (inductor's C++ backend) between its
    attention calls (models/llama_compiled.py; dense weights). Default off: a first start compiles for about a
    minute on a small CPU."""
    inductor_cache_dir: Path
    """DEEPINFER_CACHE/inductor: where the compiled CPU step's code is kept, so a second start loads it instead of
    compiling (a TORCHINDUCTOR_CACHE_DIR of the user's, other than torch's default, wins)."""
    engine_max_restarts: int
    """DEEPINFER_ENGINE_MAX_RESTARTS: times the server restarts a dead engine process before it exits non-zero
    (default 3)."""


def get_env() -> Env:
    return Env(
        cache_dir=Path(_str("DEEPINFER_CACHE", str(Path.home() / ".cache" / "deepinfer"))),
        batch_invariant=_bool("DEEPINFER_BATCH_INVARIANT", False),
        v41_yoco_truncation=_bool("DEEPINFER_V41_YOCO_TRUNCATION", False),
        v41_engram_host=_bool("DEEPINFER_V41_ENGRAM_HOST", False),
        log_level=_str("DEEPINFER_LOG_LEVEL", "WARNING"),
        kv_cache_memory_fraction=_float("DEEPINFER_KV_CACHE_MEMORY_FRACTION", 0.85),
        kv_cache_max_cpu_gib=_float("DEEPINFER_KV_CACHE_MAX_CPU_GIB", 2.0),
        v4_kv_layout=_str("DEEPINFER_V4_KV_LAYOUT", "compact"),
        v4_checkpoint_tokens=_int("DEEPINFER_V4_CHECKPOINT_TOKENS", 16384),
        v4_release_margin=_int("DEEPINFER_V4_RELEASE_MARGIN", 64),
        v4_cuda_graphs=_bool("DEEPINFER_V4_CUDA_GRAPHS", True),
        v4_recent_fraction=_float("DEEPINFER_V4_RECENT_FRACTION", 0.05),
        grammar_compile_timeout_s=_float("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT", 30.0),
        num_threads=_int("DEEPINFER_NUM_THREADS", 0),
        ep_worker_pool=_bool("DEEPINFER_EP_WORKER_POOL", False),
        ep_local_workers=_int("DEEPINFER_EP_LOCAL_WORKERS", 0),
        ep_host=_str("DEEPINFER_EP_HOST", "127.0.0.1"),
        ep_port=_int("DEEPINFER_EP_PORT", 0),
        master_addr=os.environ.get("MASTER_ADDR") or None,
        master_port=_int("MASTER_PORT", 0),
        ep_step_timeout_s=_float("DEEPINFER_EP_STEP_TIMEOUT", 30.0),
        ep_start_timeout_s=_float("DEEPINFER_EP_START_TIMEOUT", 600.0),
        ep_cuda_graphs=_bool("DEEPINFER_EP_CUDA_GRAPHS", True),
        ep_padded_dispatch=_bool("DEEPINFER_EP_PADDED_DISPATCH", False),
        ep_capacity_factor=_float("DEEPINFER_EP_CAPACITY_FACTOR", 0.0),
        eplb=_bool("DEEPINFER_EPLB", False),
        eplb_window_steps=_int("DEEPINFER_EPLB_WINDOW", 64),
        eplb_interval_steps=_int("DEEPINFER_EPLB_INTERVAL", 32),
        eplb_redundant_per_rank=_int("DEEPINFER_EPLB_REDUNDANT", 2),
        moe_router_skew=_float("DEEPINFER_MOE_ROUTER_SKEW", 0.0),
        cuda_graph_max_bs=_int("DEEPINFER_CUDA_GRAPH_MAX_BS", 256),
        cuda_graph_max_context=_int("DEEPINFER_CUDA_GRAPH_MAX_CONTEXT", 1 << 30),
        spec_max_draft=_int("DEEPINFER_SPEC_MAX_DRAFT", 5),
        overlap=_optional_bool("DEEPINFER_OVERLAP"),
        skinny_gemm=_bool("DEEPINFER_SKINNY_GEMM", True),
        fp8_gemm=_str("DEEPINFER_FP8_GEMM", "auto").strip().lower(),
        fp8_split_sum=_str("DEEPINFER_FP8_SPLIT_SUM", "kernel").strip().lower(),
        fp8_split_rows=_optional_int("DEEPINFER_FP8_SPLIT_ROWS"),
        fp8_grouped=_bool("DEEPINFER_FP8_GROUPED", True),
        mxfp4_fragment=_bool("DEEPINFER_MXFP4_FRAGMENT", True),
        fp8_moe_tiles=_bool("DEEPINFER_FP8_MOE_TILES", False),
        fp8_kv_dot=_str("DEEPINFER_FP8_KV_DOT", "f16").strip().lower(),
        mla_mha_prefill=_optional_bool("DEEPINFER_MLA_MHA_PREFILL"),
        mla_prefix_split=_optional_bool("DEEPINFER_MLA_PREFIX_SPLIT"),
        max_body_bytes=_int("DEEPINFER_MAX_BODY_BYTES", 16 << 20),
        json_offload_bytes=_int("DEEPINFER_JSON_OFFLOAD_BYTES", 256 << 10),
        max_json_depth=_int("DEEPINFER_MAX_JSON_DEPTH", 64),
        max_prompt_chars=_int("DEEPINFER_MAX_PROMPT_CHARS", 1_000_000),
        max_grammar_chars=_int("DEEPINFER_MAX_GRAMMAR_CHARS", 256 << 10),
        request_timeout_s=_float("DEEPINFER_REQUEST_TIMEOUT", 600.0),
        control_timeout_s=_float("DEEPINFER_CONTROL_TIMEOUT", 10.0),
        heartbeat_interval_s=_float("DEEPINFER_HEARTBEAT_INTERVAL", 1.0),
        heartbeat_timeout_s=_float("DEEPINFER_HEARTBEAT_TIMEOUT", 60.0),
        engine_max_restarts=_int("DEEPINFER_ENGINE_MAX_RESTARTS", 3),
        cpu_dense_copy=_bool("DEEPINFER_CPU_DENSE_COPY", True),
        cpu_fast_step=_bool("DEEPINFER_CPU_FAST_STEP", True),
        gpu_row_step=_bool("DEEPINFER_GPU_ROW_STEP", True),
        gpu_pdl=_bool("DEEPINFER_GPU_PDL", True),
        cpu_bf16_gemv=_str("DEEPINFER_CPU_BF16_GEMV", "auto").strip().lower(),
        cpu_fp32_row=_str("DEEPINFER_CPU_FP32_ROW", "kernel").strip().lower(),
        cpu_quant_row=_str("DEEPINFER_CPU_QUANT_ROW", "kernel").strip().lower(),
        cpu_compile=_bool("DEEPINFER_CPU_COMPILE", False),
        inductor_cache_dir=Path(_str("DEEPINFER_CACHE", str(Path.home() / ".cache" / "deepinfer"))) / "inductor",
    )
