"""Confidence scheduling: the greedy plan is optimal (brute force on small cases), fixed-length mode ignores
the rest of the batch, and the step-time model learns a linear cost."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_rt.speculative.planner import StepTimeModel, plan_drafts


def objective(conf, counts, base, model) -> float:
    tokens = len(conf)
    for c, m in zip(conf, counts):
        g = 1.0
        for x in c[:m]:
            g *= x
            tokens += g
    return tokens / model.estimate(base + sum(counts))


def linear_model(a: float, b: float) -> StepTimeModel:
    model = StepTimeModel()
    for t in (1, 4, 9, 20, 40):
        for _ in range(30):
            model.record(t, a + b * t)
    return model


@settings(max_examples=60, deadline=None)
@given(conf=st.lists(st.lists(st.floats(0.0, 1.0), max_size=3), min_size=1, max_size=3),
       slope=st.floats(0.001, 0.5), base=st.integers(1, 20), budget=st.integers(0, 9))
def test_plan_is_optimal(conf, slope, base, budget):
    model = linear_model(1.0, slope)
    counts = plan_drafts(conf, base, budget, model, fixed_length=False)
    assert all(0 <= m <= len(c) for m, c in zip(counts, conf)) and sum(counts) <= budget
    best = max(objective(conf, combo, base, model)
               for combo in itertools.product(*[range(len(c) + 1) for c in conf]) if sum(combo) <= budget)
    assert objective(conf, counts, base, model) >= best - 1e-9


def test_low_confidence_verifies_fewer():
    model = linear_model(1.0, 0.05)
    counts = plan_drafts([[0.95] * 5, [0.2] * 5], 2, 100, model, fixed_length=False)
    assert counts[0] == 5 and counts[1] < 2


def test_fixed_length_ignores_confidence_and_neighbours():
    model = linear_model(1.0, 10.0)  # drafts look very expensive: confidence mode would verify none
    assert plan_drafts([[0.01] * 4], 1, 100, model, fixed_length=False) == [0]
    alone = plan_drafts([[0.01] * 4], 1, 100, model, fixed_length=True)
    crowd = plan_drafts([[0.01] * 4, [0.9] * 2, []], 3, 100, model, fixed_length=True)
    assert alone == [4] and crowd == [4, 2, 0]


def test_step_time_model_learns_a_line():
    model = linear_model(2.0, 0.25)
    assert abs(model.estimate(100) - 27.0) < 1e-6
    assert StepTimeModel().estimate(256) == 2 * StepTimeModel().estimate(0)  # the prior before measurements
