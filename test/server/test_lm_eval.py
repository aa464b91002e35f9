"""lm-evaluation-harness through the server, unmodified: `local-completions` (loglikelihood of a multiple-choice
task, and generate_until) give the per-sample scores and metrics of `--model hf`, and `local-chat-completions` the engine's greedy text, on
the same checkpoint. The tasks are two-document local JSON files (no download)."""
from __future__ import annotations

import json
import os

import pytest
from conftest import MODEL_NAME

lm_eval = pytest.importorskip("lm_eval")

MC_DOCS = [{"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red"], "answer": 0},
           {"question": "How many legs does a dog have?", "choices": ["two", "four", "six"], "answer": 1}]
GEN_DOCS = [{"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "What is two plus two?", "answer": "4"}]


def _task(name: str, data, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "mc.yaml").write_text(_task("deepinfer_tiny_mc", root / "mc.jsonl", (
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")))
    (root / "gen.yaml").write_text(_task("deepinfer_tiny_gen", root / "gen.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return TaskManager(include_path=str(root))


def _evaluate(model, task_manager, tasks, **kwargs) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager, log_samples=True,
                                   **kwargs)


@pytest.fixture(scope="module")
def hf_results(smollm2_hf, smollm2_engine, task_manager):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=smollm2_hf, tokenizer=smollm2_engine.tokenizer, batch_size=1, device="cpu")
    return _evaluate(hf, task_manager, ["deepinfer_tiny_mc", "deepinfer_tiny_gen"])


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: (s["doc_id"]))]


def _metrics(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if "stderr" not in k and k != "alias"}


def test_local_completions_match_hf(server_url, smollm2_path, task_manager, hf_results):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    api = LocalCompletionsAPI(model=MODEL_NAME, base_url=f"{server_url}/v1/completions", tokenizer=str(smollm2_path),
                              tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
                              max_retries=1)
    ours = _evaluate(api, task_manager, ["deepinfer_tiny_mc", "deepinfer_tiny_gen"])
    hf = hf_results
    assert _metrics(ours, "deepinfer_tiny_mc") == _metrics(hf, "deepinfer_tiny_mc")
    assert _metrics(ours, "deepinfer_tiny_gen") == _metrics(hf, "deepinfer_tiny_gen")
    for got, want in zip(_responses(ours, "deepinfer_tiny_mc"), _responses(hf, "deepinfer_tiny_mc")):
        for (ll, is_greedy), (ref_ll, ref_greedy) in zip((r[0] for r in got), (r[0] for r in want)):
            assert ll == pytest.approx(ref_ll, abs=1e-3)
            assert is_greedy == ref_greedy
    assert _responses(ours, "deepinfer_tiny_gen") == _responses(hf, "deepinfer_tiny_gen")


def test_local_chat_completions_match_engine(server_url, smollm2_path, smollm2_engine, task_manager):
    """The chat backend's generations equal greedy decoding of the chat-templated prompt in-process."""
    from lm_eval.models.openai_completions import LocalChatCompletion

    from deepinfer_rt import SamplingParams

    api = LocalChatCompletion(model=MODEL_NAME, base_url=f"{server_url}/v1/chat/completions",
                              tokenizer=str(smollm2_path), tokenizer_backend="huggingface", num_concurrent=1,
                              max_retries=1)
    ours = _evaluate(api, task_manager, ["deepinfer_tiny_gen"], apply_chat_template=True)
    tok = smollm2_engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Question: {d['question']}\nAnswer:"}],
                                              tokenize=False, add_generation_prompt=True), add_special_tokens=False)
           for d in GEN_DOCS]
    outs = smollm2_engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=8, temperature=0,
                                                                                 stop=["\n"]))
    assert [r[0][0] for r in _responses(ours, "deepinfer_tiny_gen")] == [o.text for o in outs]
