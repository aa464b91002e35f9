"""deepinfer_lang: generation programs (SGLang's frontend language) run in-process on a deepinfer_rt.Engine.

    import deepinfer_lang as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.Runtime(model="smollm2-135m-instruct"))
    print(qa.run(question="What is the capital of France?", temperature=0)["answer"])

Modules: api (the public functions), ir (expression nodes), interpreter (ProgramState and execution),
backend (RuntimeBackend over an Engine), endpoint (RuntimeEndpoint over a running server), chat_template
(role text), choices (select's scoring methods).
"""
from deepinfer_lang.api import (
    Program,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from deepinfer_lang.backend import Runtime, RuntimeBackend, set_default_backend
from deepinfer_lang.choices import (
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from deepinfer_lang.endpoint import RuntimeEndpoint
from deepinfer_lang.interpreter import ProgramState, ProgramStateGroup

__all__ = [
    "ChoicesSamplingMethod", "Program", "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeBackend",
    "RuntimeEndpoint",
    "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "greedy_token_selection", "select", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
