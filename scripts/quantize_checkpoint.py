"""Write a 16/32-bit HF DeepSeek checkpoint in a quantized release format.

    python scripts/quantize_checkpoint.py SRC DST --format v3-fp8|v4|v41 [--dtype bfloat16]

v3-fp8 is the DeepSeek-V3/R1/V3.1 release format: every linear weight of attention and MLP / experts (q_proj or
q_a/q_b, kv_a_proj_with_mqa, kv_b, o_proj, dense, shared and routed experts' gate/up/down) becomes
float8_e4m3fn with a float32 `<name>_scale_inv` per 128 x 128 block (scale_inv = block amax / 448, value =
weight / scale_inv rounded to e4m3); embeddings, LM head, norms, the router (`mlp.gate.weight`) and
`e_score_correction_bias` are kept (cast to --dtype if given, the bias always fp32). config.json gains
`quantization_config`; tokenizer and other files are copied.

v4 is the DeepSeek-V4 / V4-Flash release format (layers/quant_formats.py) for a DeepSeek-V4 checkpoint: the
releases' tensor names (layers.N.attn.wq_a.weight / .scale, embed.weight, head.weight, hc_head_fn, ...);
attention wq_a/wq_b/wkv/wo_a/wo_b, the indexer's wq_b and the shared experts' w1/w2/w3 in float8_e4m3fn with
float8_e8m0fnu 128 x 128 block scales (each the power of two just above block amax / 448); the routed experts
MXFP4 (int8 (N, K/2) of e2m1 pairs, e8m0 (N, K/32)); the compressors' wkv/wgate, the indexer's weights_proj, the
embeddings, head and router weight 16-bit (--dtype); the router bias, hyper-connection weights, sinks and
position biases fp32. config.json: quantization_config {fp8, e4m3, dynamic, scale_fmt ue8m0, [128, 128]} and a
top-level expert_dtype 'fp4', as the release has.

v41 is the DeepSeek-V4.1 release format for a deepseek_v41 checkpoint (HF or release names in, the release's
out): attention wq_a/wq_b/wkv/wo_a/wo_b, the shared experts' w1/w2/w3 and the Engram wkv in float8_e4m3fn with
e8m0 32 x 32 block scales; the routed experts MXFP4 as in v4; the Engram tables (layers.N.engram.embed) FP8 with
one e8m0 scale per 32 columns; the compressors, the indexer's wk / weights_proj, embeddings, head, norms and
router 16-bit (--dtype), the router bias, sinks and hyper-connection weights fp32. config.json gains the
top-level quantization_config {fp8, e4m3, dynamic, ue8m0, [32, 32], expert_dtype fp4}; a release
inference/config.json, where SRC has one, says dtype fp8, scale_fmt ue8m0, expert_dtype fp4.
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
from deepinfer_rt.layers.quant_formats import DENSE, ENGRAM, EXPERT, role_layouts  # noqa: E402
from deepinfer_rt.layers.quant_formats import dequantize_by_layout, quantize_by_layout  # noqa: E402
from deepinfer_rt.models.release_names import from_release_name  # noqa: E402

FORMATS = ("v3-fp8", "v4", "v41")
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


# ---- v4 / v41: the V4-family release layouts, by role ----

V4_BLOCK, V41_BLOCK = (128, 128), (32, 32)
V4_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
             "weight_block_size": list(V4_BLOCK)}
V41_CONFIG = {**V4_CONFIG, "weight_block_size": list(V41_BLOCK), "expert_dtype": "fp4"}
_V4_DENSE = re.compile(r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                       r"|engram\.wkv|main_proj|e_proj)\.weight")  # engram, main_proj: V4.1 only; e_proj: V4's MTP
_V4_EXPERT = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
"""The MTP / DSpark stages (mtp.N.*) are quantized like the layers: V4's release ships mtp.0's attention, experts
and e_proj with scales; the stages' Markov and confidence heads stay 16-bit."""
_V41_ENGRAM = re.compile(r"layers\.\d+\.engram\.embed\.weight")
_V4_FP32 = re.compile(r".*(gate\.bias|attn_sink|\.ape|hc_(attn|ffn)_(fn|base|scale)|hc_head_(fn|base|scale))")


def to_release_name(name: str) -> str:
    """Our (HF save_pretrained) name of a V4-family tensor -> the release's (the inverse of from_release_name)."""
    name = from_release_name(name)  # one spelling in, whichever came
    if not name.startswith(("model.", "head.", "mtp.")):
        name = "model." + name  # a release-style name from_release_name leaves alone (hc_head.hc_fn)
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if name in top:
        return top[name]
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name.removeprefix("model.hc_head.hc_")
    return name.removeprefix("model.")


def release_role(name: str) -> str | None:
    """DENSE, EXPERT or ENGRAM for a V4-family release weight name, None for a tensor kept unquantized."""
    if _V4_EXPERT.fullmatch(name):
        return EXPERT
    if _V4_DENSE.fullmatch(name):
        return DENSE
    if _V41_ENGRAM.fullmatch(name):
        return ENGRAM
    return None


def _quantize_release_tensor(name: str, t: torch.Tensor, block: tuple[int, int], dtype: torch.dtype | None
                             ) -> list[tuple[str, torch.Tensor]]:
    name = to_release_name(name)
    role = release_role(name)
    if role is not None:
        q, scale = quantize_by_layout(role_layouts(block, "fp4")[role], t)
        return [(name, q), (name.removesuffix(".weight") + ".scale", scale)]
    if _V4_FP32.fullmatch(name):
        return [(name, t.float())]
    return [(name, t if dtype is None or not t.is_floating_point() else t.to(dtype))]


def quantize_v4_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None = None
                       ) -> list[tuple[str, torch.Tensor]]:
    """One tensor of a 16/32-bit V4 checkpoint (HF or release name) in the V4 release format: [(release name,
    tensor)] plus `<module>.scale` for a quantized weight."""
    return _quantize_release_tensor(name, t, V4_BLOCK, dtype)


def quantize_v41_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None = None
                        ) -> list[tuple[str, torch.Tensor]]:
    """As quantize_v4_tensor in V4.1's layout: 32 x 32 dense blocks; Engram tables (layers.N.engram.embed)
    FP8 with one e8m0 scale per 32 columns."""
    return _quantize_release_tensor(name, t, V41_BLOCK, dtype)


def dequantize_release_tensors(tensors: dict[str, torch.Tensor], block: tuple[int, int] = V4_BLOCK,
                               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The inverse, for references: a V4-family release checkpoint's tensors -> our names, every quantized
    weight dequantized (value x its e8m0 scale, in fp32) to `dtype`, the rest cast to it (integers kept; a weight
    of a quantized role stored 16-bit without a scale is cast too)."""
    layouts = role_layouts(block, "fp4")
    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale") and release_role(name.removesuffix(".scale") + ".weight") is not None:
            continue
        role, scale = release_role(name), name.removesuffix(".weight") + ".scale"
        if role is not None and (scale in tensors or t.dtype in (torch.float8_e4m3fn, torch.int8)):
            t = dequantize_by_layout(layouts[role], t, tensors[scale], dtype, name)
        out[from_release_name(name)] = t.to(dtype) if t.is_floating_point() else t
    return out


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str = "v3-fp8",
                        dtype: torch.dtype | None = None) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')!r})")
    want = {"deepseek_v4": "v4", "deepseek_v41": "v41", "deepseek_v41_text": "v41"}.get(config.get("model_type"),
                                                                                          "v3-fp8")
    if fmt != want:
        raise ValueError(f"--format {fmt} does not fit {src} (model_type {config.get('model_type')!r}): v4 is for "
                         "deepseek_v4 checkpoints, v41 for deepseek_v41, v3-fp8 for DeepSeek-V2/V3")
    dst.mkdir(parents=True, exist_ok=True)
    if fmt in ("v4", "v41"):
        one = quantize_v4_tensor if fmt == "v4" else quantize_v41_tensor
        tensors = {n: q.contiguous() for name, t in iter_tensors(src) for n, q in one(name, t, dtype)}
    else:
        tensors = {name: t.contiguous() for name, t in quantize_tensors(iter_tensors(src), dtype)}
    if not any(t.dtype == torch.float8_e4m3fn for t in tensors.values()):
        raise ValueError(f"no linear weight of {src} matches the {fmt} names (not a DeepSeek checkpoint?)")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if fmt == "v4":
        config["quantization_config"] = dict(V4_CONFIG)
        config["expert_dtype"] = "fp4"
    elif fmt == "v41":
        config["quantization_config"] = dict(V41_CONFIG)
        _write_v41_release_config(src, dst)
    else:
        config["quantization_config"] = dict(V3_FP8_CONFIG)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dst


def _write_v41_release_config(src: Path, dst: Path) -> None:
    """The release's inference/config.json (reference names), where SRC has one, saying FP8 weights."""
    release = src / "inference" / "config.json"
    if release.exists():
        raw = json.loads(release.read_text())
        raw.update(dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4")
        (dst / "inference").mkdir(exist_ok=True)
        (dst / "inference" / "config.json").write_text(json.dumps(raw, indent=1))


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
