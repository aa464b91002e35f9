"""sglang.lang.choices: select's scoring methods (both call protocols: see ChoicesSamplingMethod)."""
from deepinfer_lang.choices import (  # noqa: F401
    ChoicesDecision,
    ChoicesSamplingMethod,
    GreedyTokenSelection,
    TokenLengthNormalized,
    UnconditionalLikelihoodNormalized,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
