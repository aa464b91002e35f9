"""A multi-turn chat program on the embedded default model (SmolLM2-135M-Instruct, CPU), streamed.

    python examples/chat.py

Each turn's prompt extends the previous one token for token, so the engine finds the whole conversation so far
in its prefix cache and computes only the new turn (the cached_tokens column grows with the conversation).
"""
from __future__ import annotations

import deepinfer_lang as sgl

QUESTIONS = ["What is the capital of France?", "What is a famous landmark there?", "How tall is it, roughly?"]


@sgl.function
def multi_turn(s, questions):
    s += sgl.system("You are a helpful assistant. Answer in one or two sentences.")
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=64))


def main() -> None:
    with sgl.Runtime(model="smollm2-135m-instruct") as runtime:
        sgl.set_default_backend(runtime)
        state = multi_turn.run(questions=QUESTIONS, temperature=0, stream=True)
        for piece in state.text_iter():
            print(piece, end="", flush=True)
        if state.error() is not None:
            raise SystemExit(f"the program failed: {state.error()!r}")
        # Streamed gens report token counts only (see ProgramState._stream_gen); run again without streaming
        # to show the cache at work turn by turn.
        state = multi_turn.run(questions=QUESTIONS, temperature=0)
        print(f"\n{'turn':<6}{'prompt_tokens':>15}{'cached_tokens':>15}{'completion_tokens':>19}")
        for i in range(len(QUESTIONS)):
            meta = state.get_meta_info(f"answer_{i}")
            print(f"{i:<6}{meta['prompt_tokens']:>15}{meta['cached_tokens']:>15}{meta['completion_tokens']:>19}")
        assert state.text() == runtime.tokenizer.apply_chat_template(state.messages(), tokenize=False)


if __name__ == "__main__":
    main()
