"""Shared by the sampler tests: a tiny request factory and hand-made logits."""
from __future__ import annotations

import torch

from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams

V = 8
EOS = 7


def make_req(rid: int = 0, prompt=(1,), output=(), seed: int = 0, **params) -> Req:
    req = Req(rid, list(prompt), SamplingParams(**params), seed)
    req.token_ids.extend(output)
    return req


def logits_from_probs(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())
