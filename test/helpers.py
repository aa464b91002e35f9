"""Reference helpers shared by tests."""
from __future__ import annotations

import torch


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """Reference: transformers greedy generate of one prompt (no padding), stopping at EOS like the engine."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])[0, len(ids):].tolist()
    # HF pads nothing for a single sequence; the EOS token itself is part of both outputs.
    return out


def check_weight_only_matches_dense(path, dtype: str, quantization: str, method_cls, dequantized) -> None:
    """A weight-only quantized engine (its linears `method_cls`, the dense copies dropped) against the dense engine
    whose linears hold those weights dequantized: the same matrices, so only the GEMM's rounding differs. The head is
    per-row int8 in both quantizations (layers/int8.py Int8Head): the dense engine's head (untied from its embedding,
    which stays dense on both sides) holds it dequantized. Prompt and first-token logprobs within 2e-3 (fp32) / 0.1
    (bf16); the first two tokens equal (a later near-tie may flip)."""
    from deepinfer_rt import Engine, SamplingParams
    from deepinfer_rt.layers import int8

    prompts = ["The capital of France is", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,"]
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    with Engine(str(path), dtype=dtype, kv_cache_tokens=1024, quantization=quantization) as quantized:
        linears = {n: m for n, m in quantized.model.named_modules()
                   if isinstance(getattr(m, "method", None), method_cls)}
        assert linears and all(m.weight.numel() == 0 for m in linears.values())
        head = quantized.model.lm_head
        assert isinstance(quantized.model.logits_method, int8.Int8Head) and head.int8_weight.dtype == torch.int8
        got = quantized.generate(prompts, sampling_params=sp)
        with Engine(str(path), dtype=dtype, kv_cache_tokens=1024) as ref:
            with torch.no_grad():
                for name, module in ref.model.named_modules():
                    if name in linears:
                        module.weight.copy_(dequantized(linears[name]))
                ref.model.lm_head.weight = torch.nn.Parameter(int8.dequantized(head).to(ref.model.lm_head.weight.dtype),
                                                              requires_grad=False)
            want = ref.generate(prompts, sampling_params=sp)
    tol = 2e-3 if dtype == "float32" else 0.1
    for a, b in zip(got, want):
        errors = [abs(x - y) for x, y in zip(a.prompt_logprobs[1:] + a.logprobs[:1],
                                             b.prompt_logprobs[1:] + b.logprobs[:1])]
        assert max(errors) < tol, (dtype, max(errors))
        assert a.token_ids[:2] == b.token_ids[:2]


def moe_config(hidden: int, experts: int, top_k: int, inter: int, shared: int = 2):
    """A one-layer DeepSeek-V2 config for MoE-block tests: `experts` routed experts of width `inter`, top_k a
    token, `shared` shared experts."""
    from deepinfer_rt.config import ModelConfig

    return ModelConfig(architecture="DeepseekV2ForCausalLM", vocab_size=32, hidden_size=hidden, intermediate_size=64,
                       num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position=64,
                       tie_word_embeddings=False, eos_token_ids=(0,), bos_token_id=None, n_routed_experts=experts,
                       n_shared_experts=shared, num_experts_per_tok=top_k, moe_intermediate_size=inter)


def prompt_tokens(seed: int, n: int) -> list[int]:
    """n random token ids in [100, 20000), a function of the seed."""
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scattered_slots(pool, n: int, seed: int) -> torch.Tensor:
    """n free slots of `pool` (page size 1) in random order, so no sequence's state is contiguous in it."""
    pages = torch.tensor(pool.allocator.alloc(n))
    return pages[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]


def chunk_batch(chunks, pool=None, backend=None):
    """A ForwardBatch of several sequences' chunks; chunk = (token ids of every position or None, the slots of every
    position, start, end) runs positions start..end-1 over the state of 0..start-1 already in the pool. Without
    token ids the batch's input ids are zeros (for layers fed their inputs directly)."""
    from deepinfer_rt.forward_batch import ForwardBatch

    return ForwardBatch(
        input_ids=torch.cat([torch.zeros(e - s, dtype=torch.long) if t is None else torch.as_tensor(t[s:e])
                             for t, _, s, e in chunks]),
        positions=torch.cat([torch.arange(s, e) for _, _, s, e in chunks]),
        out_slots=torch.cat([slots[s:e] for _, slots, s, e in chunks]),
        q_lens=[e - s for _, _, s, e in chunks], kv_lens=[e for *_, e in chunks],
        kv_slots=[slots[:e] for _, slots, _, e in chunks], pool=pool, backend=backend)


@torch.no_grad()
def forward_chunks(model, pool, chunks) -> list[torch.Tensor]:
    """One forward of `model` over chunk_batch(chunks) through the torch reference attention: each chunk's logits
    (end - start, vocab)."""
    from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend

    backend = TorchRefBackend()
    batch = chunk_batch(chunks, pool, backend)
    backend.prepare(batch)
    model.prepare_batch(batch)
    return list(model.compute_logits(model(batch)).split(batch.q_lens))


def assert_max_abs_close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Same shape and every element within atol (the largest error named)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err = (got - want).abs().max().item()
    assert err <= atol, f"max abs logit error {err:.2e} > {atol:.0e}"


def checkpoint_folder(src, dst, tensors: dict, config: dict | None = None, copy_folders: bool = False):
    """A checkpoint folder `dst` holding `tensors` as its model.safetensors, the other files of `src` (its folders
    too with copy_folders), and `config` as its config.json where given (else src's)."""
    import json
    import shutil

    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors" or (config is not None and f.name == "config.json"):
            continue
        if f.is_file():
            shutil.copy(f, dst / f.name)
        elif f.is_dir() and copy_folders:
            shutil.copytree(f, dst / f.name)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
