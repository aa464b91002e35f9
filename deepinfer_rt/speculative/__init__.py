"""Speculative decoding: drafters propose tokens, the target verifies them exactly in one step.

    drafter.py   the Drafter contract and the prompt-lookup drafter (no weights)
    grammar_draft.py  constrained requests: the grammar's forced text, JSON layout and copied values as drafts
    mtp.py       DeepSeek multi-token-prediction head as a drafter
    dspark.py    DeepSeek-V4.1's DSpark block drafter (network: dspark_model.py)
    planner.py   confidence scheduling: how many drafts each request verifies this step
    verify.py    exact verification (greedy prefix match, rejection sampling)
    decoder.py   the hooks the scheduler, model runner and engine call
"""
from deepinfer_rt.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
