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
    get_server_info,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from deepinfer_lang.backend import Runtime, RuntimeBackend, set_default_backend
from deepinfer_lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from deepinfer_lang.endpoint import RuntimeEndpoint
from deepinfer_lang.config import global_config
from deepinfer_lang.interpreter import ProgramState, ProgramStateGroup
from deepinfer_lang.unsupported import Anthropic, Crusoe, LiteLLM, OpenAI, UnsupportedFeatureError, VertexAI

__version__ = "0.5.23-deepinfer"  # the SGLang frontend version whose API this mirrors


def __getattr__(name: str):
    # SGLang's runtime-side names of its package root (not frontend); `import sglang` code that names them
    # gets a clear error instead of AttributeError.
    if name in ("Engine", "ServerArgs"):
        raise UnsupportedFeatureError(f"sgl.{name} is SGLang's server runtime, not part of its frontend: use "
                                      f"deepinfer_rt.{'Engine' if name == 'Engine' else 'server'} instead")
    if name == "lang":  # sglang.lang.*, imported on first use
        import importlib

        return importlib.import_module("deepinfer_lang.lang")
    raise AttributeError(f"module 'deepinfer_lang' has no attribute {name!r}")


__all__ = [
    "Anthropic", "ChoicesDecision", "ChoicesSamplingMethod", "Crusoe", "LiteLLM", "OpenAI", "Program",
    "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeBackend", "RuntimeEndpoint", "UnsupportedFeatureError",
    "VertexAI", "__version__",
    "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_server_info", "global_config", "greedy_token_selection", "image", "select", "separate_reasoning",
    "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]
