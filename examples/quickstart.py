"""The main job on the embedded default model (SmolLM2-135M-Instruct, CPU): one chat answer, then a batch.

    python examples/quickstart.py
"""
from deepinfer_rt import Engine, SamplingParams


def chat(engine: Engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                add_generation_prompt=True)


def main() -> None:
    with Engine("smollm2-135m-instruct") as engine:
        print("streamed answer:")
        for delta in engine.stream(chat(engine, "What is the capital of France? Answer in one sentence."),
                                   SamplingParams(max_new_tokens=48, temperature=0)):
            print(delta, end="", flush=True)
        print("\n")
        questions = ["Name a primary color.", "What is 3 + 4?", "Give a synonym for 'happy'.",
                     "Which planet is known as the red planet?"]
        outs = engine.generate([chat(engine, q) for q in questions],
                               sampling_params=SamplingParams(max_new_tokens=32, temperature=0))
        for q, out in zip(questions, outs):
            print(f"Q: {q}\nA: {out.text.strip()}  [{out.completion_tokens} tokens, {out.finish_reason}]\n")


if __name__ == "__main__":
    main()
