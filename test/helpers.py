"""Reference helpers shared by tests."""
from __future__ import annotations

import torch


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """Reference: transformers greedy generate of one prompt (no padding), stopping at EOS like the engine."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])[0, len(ids):].tolist()
    # HF pads nothing for a single sequence; the EOS token itself is part of both outputs.
    return out
