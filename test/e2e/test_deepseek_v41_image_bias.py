"""DeepSeek-V4.1's image-token router correction bias (`layers.N.ffn.gate.bias_vl`, in multimodal release
checkpoints): a checkpoint carrying it loads (release and HF names), keeps it in fp32 on a bf16 model, and gives the
same outputs as without it (it acts only on image-span rows, which this text-only engine refuses); a wrong shape is
refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5 + i for i in range(n)] for n in (3, 17)]
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=True, ignore_eos=True)


def _with_image_bias(src: Path, dst: Path, num_experts: int | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """src's checkpoint plus a random bias_vl on every layer (its other files linked)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    weights = load_file(src / "model.safetensors")
    prefix = "model.layers." if any(k.startswith("model.layers.") for k in weights) else "layers."
    layers = sorted({int(k[len(prefix):].split(".")[0]) for k in weights if k.startswith(prefix)})
    gen = torch.Generator().manual_seed(0)
    added = {}
    for layer in layers:
        e = num_experts or weights[f"{prefix}{layer}.ffn.gate.bias"].shape[0]
        added[f"{prefix}{layer}.ffn.gate.bias_vl"] = torch.randn(e, generator=gen, dtype=torch.float32)
    save_file({**weights, **added}, str(dst / "model.safetensors"))
    return dst, added


def _outputs(path: Path, dtype: str):
    with Engine(str(path), dtype=dtype, kv_cache_tokens=512) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        params = {n: p.detach().clone() for n, p in engine.model.named_parameters() if n.endswith("bias_vl")}
    return [(o.token_ids, o.logprobs) for o in outs], params


@pytest.mark.parametrize("variant, dtype", [("b", "float32"), ("a", "bfloat16")])
def test_checkpoint_with_image_bias_loads_and_outputs_are_unchanged(tiny_v41_paths, tmp_path, variant, dtype):
    path, added = _with_image_bias(tiny_v41_paths[variant], tmp_path / "with-bias")
    got, params = _outputs(path, dtype)
    want, none = _outputs(tiny_v41_paths[variant], dtype)
    assert got == want
    assert not none and len(params) == len(added)
    for name, tensor in added.items():
        loaded = params["model." + name if not name.startswith("model.") else name]
        assert loaded.dtype == torch.float32 and torch.equal(loaded, tensor)


def test_wrong_image_bias_shape_is_refused(tiny_v41_paths, tmp_path):
    path, _ = _with_image_bias(tiny_v41_paths["b"], tmp_path / "bad", num_experts=3)
    with pytest.raises(ValueError, match=r"ffn\.gate\.bias_vl: checkpoint shape \(3,\)"):
        Engine(str(path), dtype="float32", kv_cache_tokens=512)
