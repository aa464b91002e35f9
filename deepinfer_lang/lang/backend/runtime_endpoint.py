"""sglang.lang.backend.runtime_endpoint: RuntimeEndpoint (a running server) and Runtime (ours: in-process)."""
from deepinfer_lang.backend import Runtime  # noqa: F401
from deepinfer_lang.endpoint import RuntimeEndpoint  # noqa: F401


def compute_normalized_prompt_logprobs(input_logprobs) -> float:
    """Mean logprob of (logprob, token_id, ...) entries, skipping missing ones."""
    values = [entry[0] for entry in input_logprobs if entry[0]]
    return sum(values) / len(values)
