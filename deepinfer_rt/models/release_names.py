"""The DeepSeek releases' own tensor names (the reference code's, `inference/convert.py` style) -> ours.

V4 / V4-Flash and V4.1 ship them (V3/R1 ship HF names):

    embed.weight                  model.embed_tokens.weight
    norm.weight                   model.norm.weight
    head.weight                   head.weight (the V4 family keeps the reference's head name)
    hc_head_{fn,base,scale}       model.hc_head.hc_{fn,base,scale}
    layers.N.<rest>               model.layers.N.<rest>
    <module>.scale                <module>.weight_scale_inv (a quantized linear's block scales, any encoding)
    mtp.N.<rest>                  as is (multi-token-prediction layers: a model decides whether it reads them)

Names already in our form pass unchanged, so one loader reads both spellings.
"""
from __future__ import annotations

import re

_TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_HC_HEAD = re.compile(r"hc_head_(fn|base|scale)")
_SCALE = re.compile(r"(?P<module>.+\.(?:w\w*|experts\.\d+\.w\d|\w+_proj|embed))\.scale")
"""`.scale` of a linear-like module (wq_a, wo_b, w1, shared_experts.w2, experts.E.w3, weights_proj, engram
embed); norms and hyper-connection fields named *_scale are left alone."""


def from_release_name(name: str) -> str:
    """Our name for a release tensor name (identity for names that are ours already)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _HC_HEAD.fullmatch(name)
    if m:
        return f"model.hc_head.hc_{m[1]}"
    if name.startswith("layers."):
        name = "model." + name
    m = _SCALE.fullmatch(name)
    if m:
        return m["module"] + ".weight_scale_inv"
    return name
