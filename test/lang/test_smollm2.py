"""Programs whose answers must be right: SmolLM2-135M-Instruct, greedy."""
from __future__ import annotations

import pytest

import deepinfer_lang as sgl


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_engine):
    return sgl.RuntimeBackend(smollm2_engine)


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized], ids=repr)
def test_select_picks_paris(smollm2_backend, method):
    @sgl.function
    def capital(s):
        s += "The capital of France is"
        s += sgl.select("city", [" London", " Paris", " Berlin"], choices_method=method)

    state = capital.run(backend=smollm2_backend)
    assert state["city"] == " Paris"
    assert state.text() == "The capital of France is Paris"
    scores = state.get_meta_info("city")["scores"]
    assert max(range(3), key=scores.__getitem__) == 1
