"""Confidence scheduling: how many drafts each decoding request verifies this step.

Verifying the first m drafts of a request with confidences c1 .. ck yields 1 + E[accepted] tokens, where
E[accepted] = sum_{i<=m} prod_{j<=i} c_j (draft i counts only if every draft before it is accepted). The gain of
draft i, g_i = prod_{j<=i} c_j, never grows with i, so the best way to spend B verification tokens over the
batch is the B largest gains (each request then verifies a prefix of its drafts). B itself is chosen to
maximise expected tokens per unit of step time, (base tokens + sum of the B gains) / time(T0 + B), with
time(T) measured online for the step's total token count T (`StepTimeModel`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepTimeModel:
    """Step wall time as a function of the step's total token count, learnt from the steps that ran.

    An exponential moving average per token-count bucket (exact below 64 tokens, then 1/16-octave wide),
    and a least-squares line through the buckets for any count. Until two buckets are known the line is the
    prior: time proportional to 1 + T / prior_tokens (decode is memory-bound: extra tokens are cheap).
    """
    prior_tokens: float = 256.0
    decay: float = 0.2
    _buckets: dict[int, tuple[float, float]] = field(default_factory=dict)
    _line: tuple[float, float] | None = None

    def record(self, num_tokens: int, seconds: float) -> None:
        key = num_tokens if num_tokens < 64 else int(16 * math.log2(num_tokens))
        t, s = self._buckets.get(key, (float(num_tokens), seconds))
        self._buckets[key] = (t + self.decay * (num_tokens - t), s + self.decay * (seconds - s))
        self._line = None

    def estimate(self, num_tokens: int) -> float:
        a, b = self._fit()
        return a + b * num_tokens

    def _fit(self) -> tuple[float, float]:
        if self._line is None:
            points = list(self._buckets.values())
            if len(points) < 2:
                base = points[0][1] / (1 + points[0][0] / self.prior_tokens) if points else 1.0
                self._line = (base, base / self.prior_tokens)
            else:
                n = len(points)
                mt = sum(t for t, _ in points) / n
                ms = sum(s for _, s in points) / n
                var = sum((t - mt) ** 2 for t, _ in points)
                slope = sum((t - mt) * (s - ms) for t, s in points) / var if var > 0 else 0.0
                # A step never gets cheaper with more tokens; noise must not make drafts look free-er.
                slope = max(slope, ms / (mt + self.prior_tokens) * 0.05)
                self._line = (max(ms - slope * mt, 1e-9), slope)
        return self._line


def plan_drafts(confidences: list[list[float]], base_tokens: int, budget: int, time_model: StepTimeModel,
                fixed_length: bool) -> list[int]:
    """Drafts to verify per request (a prefix of each request's drafts), within `budget` extra tokens.

    confidences[r]: per-position confidences of request r's proposal; base_tokens: tokens the step computes
    anyway (plain decodes and prefill chunks), each decode producing one token."""
    if fixed_length:
        out = []
        for conf in confidences:
            m = min(len(conf), max(budget, 0))
            out.append(m)
            budget -= m
        return out
    gains = []
    for r, conf in enumerate(confidences):
        g = 1.0
        for i, c in enumerate(conf):
            g *= min(max(c, 0.0), 1.0)
            gains.append((-g, r, i))
    gains.sort()
    num_decodes = len(confidences)
    best_b, best_rate, produced = 0, num_decodes / time_model.estimate(base_tokens), float(num_decodes)
    for b, (neg_gain, _, _) in enumerate(gains[: max(budget, 0)], start=1):
        produced -= neg_gain
        rate = produced / time_model.estimate(base_tokens + b)
        if rate > best_rate:
            best_b, best_rate = b, rate
    out = [0] * len(confidences)
    for _, r, _ in gains[:best_b]:
        out[r] += 1
    return out
