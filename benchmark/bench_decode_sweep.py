"""The GQA decode attention sweep of `bench_kernels.py --only decode_sweep`: SmolLM2's shape over split counts and
tiles, each timed call reading KV copies past L2 (as a model's layers read theirs)."""
from __future__ import annotations

import itertools

import torch

from bench_kernels import _decode_inputs, _graph_time
from deepinfer_kernels.decode_attention import num_splits_for, paged_decode_attention
L2_FLUSH_BYTES = 160 << 20
"""Distinct KV bytes a timed call reads at least (past the L2 of the GPUs here)."""


def gqa_decode_sweep_rows(context: int, copy_bw: float, batches=(1, 4, 16, 64, 256)) -> list[dict]:
    """GQA decode attention at SmolLM2's shape (9 query heads, 3 KV heads, 64 dims), `context` keys per
    sequence, over split counts and tiles, graph-timed, as KV bytes over the copy bandwidth."""
    rows = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in batches:
        q, k, table, rows_, lens = _decode_inputs(batch, context, 9, 3, 64)
        v = torch.randn_like(k)
        # A timed call attends over enough copies of the KV that none is still in L2 from the previous one (at 32K
        # tokens one layer's K and V are 25 MB, half an H100's L2): as a model's 30 layers read theirs.
        copies = max(1, -(-L2_FLUSH_BYTES // (2 * k.numel() * k.element_size())))
        kvs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
        engine = num_splits_for(batch, 3, num_sms, 64)
        split_counts = (1, 2, 4, 8, 16, 32) + ((64, 128, 256) if batch <= 4 else ())  # one long request: more splits
        for splits, block_n, stages in itertools.product(split_counts, (32, 64, 128), (2, 3)):
            def attend_all(splits=splits, block_n=block_n, stages=stages):
                for kc, vc in kvs:
                    paged_decode_attention(q, kc, vc, table, rows_, lens, 1, 0.125, splits, block_n=block_n,
                                           num_stages=stages)
            try:
                s = _graph_time(attend_all) / copies
            except Exception as exc:  # out of shared memory at this depth: not a candidate
                print("gqa", batch, splits, block_n, stages, type(exc).__name__, flush=True)
                continue
            frac = 2 * k.numel() * 2 / s / copy_bw
            engine_choice = splits == engine and block_n == 64 and stages == 3
            rows.append({"kernel": "gqa_decode_sweep", "batch": batch, "splits": splits, "block_n": block_n,
                         "kv_copies": copies, "num_stages": stages, "engine_choice": engine_choice,
                         "us": s * 1e6, "fraction_of_copy_bw": frac})
            print(f"gqa B{batch} splits={splits} block_n={block_n} stages={stages}: {s * 1e6:6.1f} us {frac:.3f}"
                  f"{' (engine)' if engine_choice else ''}", flush=True)
        del k, v, table, kvs
    return rows
