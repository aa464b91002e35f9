"""Speculation counters as reported per output and per engine."""
from __future__ import annotations


def spec_stats(num_drafted: int, num_accepted: int, num_verify_steps: int) -> dict:
    """Drafted and accepted tokens, acceptance rate, and mean accepted drafts per verification step."""
    return {"drafted": num_drafted, "accepted": num_accepted,
            "acceptance_rate": num_accepted / num_drafted if num_drafted else 0.0,
            "mean_accepted_length": num_accepted / num_verify_steps if num_verify_steps else 0.0}
