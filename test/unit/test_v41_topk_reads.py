"""DeepSeek-V4.1's selection as top-k entry indices (models/deepseek_v41/attention.py `_select`, methods.py
picked_mask / picked_rows), on CPU without running a Triton kernel.

The index form's readings: picked_mask scatters (G, Q, k) picks (-1 = none) into the (G, Q, E) mask the torch forms
attend with, picked_rows gathers them into a KeySource's per-query rows. At model level the tiny model 'a' runs its
V4.1 attention through V41TritonMethod with the kernels' torch references in place of the kernels (same calls,
same KeySources): every long-range call hands the attention a per-query entry source of at most index_topk rows and
no mask, a decode row reads index_topk (3) of the 11 or more entries it sees, and the logits equal V41Method's (the masked
torch reference) within 1e-5 over a prefill chunk and two decode steps, on the 16-bit, the FP8 and the MXFP4
('fp4_e2m1') compact pool."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")


def test_picked_mask_and_rows():
    from deepinfer_rt.models.deepseek_v41.methods import picked_mask, picked_rows

    picks = torch.tensor([[[2, 0, -1], [4, 1, 3]]])  # (G=1, Q=2, k=3): the first query has 2 candidates
    slots = torch.tensor([[10, 11, 12, 13, 14]])  # (G, E)
    mask = picked_mask(picks, 5)
    assert mask.tolist() == [[[True, False, True, False, False], [False, True, False, True, True]]]
    assert picked_rows(slots, picks).tolist() == [[[12, 10, -1], [14, 11, 13]]]
    empty = torch.zeros(1, 2, 0, dtype=torch.long)  # no entries yet (a ratio-2 source's first token)
    assert picked_mask(empty, 0).shape == (1, 2, 0) and picked_rows(slots[:, :0], empty).shape == (1, 2, 0)


def _run(model, config, tokens, steps, kv):
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend

    layout = model.kv_layout(config)
    pool = KVPool(layout.with_kv_dtype(kv), 64, 4, torch.float32, torch.device("cpu"))
    out = []
    for s, e in steps:
        backend = TorchRefBackend()
        batch = ForwardBatch(input_ids=tokens[s:e], positions=torch.arange(s, e), out_slots=torch.arange(s, e),
                             q_lens=[e - s], kv_lens=[e], kv_slots=[torch.arange(0, e)], pool=pool, backend=backend)
        backend.prepare(batch)
        model.prepare_batch(batch)
        with torch.no_grad():
            out.append(model.compute_logits(model(batch)))
    return torch.cat(out)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp4_e2m1"])
def test_kernel_forms_read_only_the_picked_entries(tiny_v41_paths, kv):
    from deepinfer_kernels import v4_attention as va
    from deepinfer_kernels import v4_indexer as vi
    from deepinfer_kernels.reference import stable_topk_keys
    from deepinfer_rt.models.deepseek_v41.methods import V41Method, V41TritonMethod
    from deepinfer_rt.models.loader import build_model, load_model_config

    path = Path(tiny_v41_paths["a"])
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, torch.device("cpu"), seed=0)
    topk = model.model.cfg.index_topk
    tokens = torch.randint(100, 20000, (24,), generator=torch.Generator().manual_seed(1))
    steps = [(0, 22), (22, 23), (23, 24)]
    reference = _run(model, config, tokens, steps, kv)
    entry_dtype = {"auto": torch.float32, "fp8_e4m3": torch.float8_e4m3fn, "fp4_e2m1": torch.uint8}[kv]

    reads = []  # per long-range attention call: (query rows, entries each query reads, entries of its group)

    def attention(q, sources, sink, sm_scale, fixed_splits=False, pdl=False):
        assert not fixed_splits
        if len(sources) == 2:
            entries = sources[1]
            assert entries.mask is None and entries.rows.dim() == 3 and entries.rows.shape[-1] <= topk
            assert entries.buf.dtype == entry_dtype
            reads.append((q.shape[0] * q.shape[1], (entries.rows >= 0).sum(-1).flatten()))
        return va.sparse_mqa_attention_ref(q, sources, sink, sm_scale)

    def index_scores(q, weights, buf, rows, visible, scale, scales=None, fixed_order=False, as_keys=False, pdl=False):
        assert not fixed_order and buf.dtype == entry_dtype
        scores = vi.index_scores_ref(q, weights, buf, rows, visible, scale, scales)
        return stable_topk_keys(scores) if as_keys else scores  # the kernel's keys form: checked against this

    fake = SimpleNamespace(attention=SimpleNamespace(KeySource=va.KeySource, sparse_mqa_attention=attention),
                           indexer=SimpleNamespace(index_scores=index_scores))
    swapped = 0
    for mod in model.modules():
        if type(getattr(mod, "method", None)) is V41Method:
            mod.method = V41TritonMethod(mod.method.v4)
            mod.method.kernels = fake
            swapped += 1
    assert swapped
    got = _run(model, config, tokens, steps, kv)
    rows = got.isfinite().all(dim=-1)  # YOCO prefill truncation leaves early prefill rows without logits
    assert rows[-2:].all() and rows.sum() >= 3
    torch.testing.assert_close(got[rows], reference[rows], rtol=1e-5, atol=1e-5)
    decode = [per_query for n, per_query in reads if n == 1]
    assert decode and reads
    # a decode query at position 22 or 23 has 11 or more entries on every long-range layer; it reads topk of them
    assert topk < 11 and all(int(r.max()) == topk for r in decode), decode
