"""Order in which waiting requests are admitted."""
from __future__ import annotations

from deepinfer_rt.cache.base import PrefixCache
from deepinfer_rt.request import Req


def order_waiting(waiting: list[Req], policy: str, cache: PrefixCache, fallback_len: int) -> list[Req]:
    """'fcfs': arrival order. 'lpm': longest cached prefix first (stable), unless the queue is longer than
    `fallback_len`, where matching every request costs more than it saves and FCFS keeps anyone from starving."""
    if policy == "fcfs" or len(waiting) > fallback_len:
        return list(waiting)
    if policy != "lpm":
        raise ValueError(f"unknown schedule_policy {policy!r}")
    lengths = {id(r): cache.peek(r) for r in waiting}
    return sorted(waiting, key=lambda r: -lengths[id(r)])
