"""Write a 16/32-bit HF DeepSeek-V2/V3 checkpoint in a quantized release format.

    python scripts/quantize_checkpoint.py SRC DST --format v3-fp8 [--dtype bfloat16]

v3-fp8 is the DeepSeek-V3/R1/V3.1 release format: every linear weight of attention and MLP / experts (q_proj or
q_a/q_b, kv_a_proj_with_mqa, kv_b, o_proj, dense, shared and routed experts' gate/up/down) becomes
float8_e4m3fn with a float32 `<name>_scale_inv` per 128 x 128 block (scale_inv = block amax / 448, value =
weight / scale_inv rounded to e4m3); embeddings, LM head, norms, the router (`mlp.gate.weight`) and
`e_score_correction_bias` are kept (cast to --dtype if given, the bias always fp32). config.json gains
`quantization_config`; tokenizer and other files are copied.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".pypath"))
sys.path.insert(0, str(ROOT))

from deepinfer_kernels.reference import quantize_fp8_blocks  # noqa: E402

FORMATS = ("v3-fp8",)
BLOCK = (128, 128)
V3_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(BLOCK)}
_QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))"
    r"\.weight")
_FUSED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")


def is_quantized_weight(name: str) -> bool:
    """Whether the release format stores this tensor in FP8 (a per-expert or HF v5 fused-experts name)."""
    return bool(_QUANTIZED.fullmatch(name) or _FUSED_EXPERTS.fullmatch(name))


def scale_name(name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`; fused experts `experts.gate_up_proj` -> `experts.gate_up_proj_scale_inv`."""
    return name + "_scale_inv"


def iter_tensors(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def quantize_tensors(tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """v3-fp8: quantized weights with their scales; the rest kept (or cast to dtype; the bias stays fp32)."""
    for name, t in tensors:
        if is_quantized_weight(name):
            if _FUSED_EXPERTS.fullmatch(name) and name.endswith("gate_up_proj"):
                # gate and up rows quantize as the two projections they are (a block never spans both).
                gate, up = t.chunk(2, dim=1)
                (qg, sg), (qu, su) = quantize_fp8_blocks(gate, BLOCK), quantize_fp8_blocks(up, BLOCK)
                q, s = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)
            else:
                q, s = quantize_fp8_blocks(t, BLOCK)
            yield name, q
            yield scale_name(name), s
        elif name.endswith("e_score_correction_bias"):
            yield name, t.float()
        else:
            yield name, t if dtype is None or not t.is_floating_point() else t.to(dtype)


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str = "v3-fp8",
                        dtype: torch.dtype | None = None) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')!r})")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in quantize_tensors(iter_tensors(src), dtype)}
    if not any(t.dtype == torch.float8_e4m3fn for t in tensors.values()):
        raise ValueError(f"no linear weight of {src} matches the v3-fp8 names (not a DeepSeek-V2/V3 checkpoint?)")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = dict(V3_FP8_CONFIG)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--format", choices=FORMATS, default="v3-fp8")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="dtype of the tensors kept unquantized (default: as in SRC)")
    args = parser.parse_args()
    print(quantize_checkpoint(args.src, args.dst, args.format, getattr(torch, args.dtype) if args.dtype else None))


if __name__ == "__main__":
    main()
