"""sglang.lang.api: the public functions of the language."""
from deepinfer_lang.api import (  # noqa: F401
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
from deepinfer_lang.backend import Runtime, set_default_backend  # noqa: F401


def Engine(*args, **kwargs):
    """SGLang's offline engine is its runtime, not its frontend: deepinfer_rt.Engine is ours."""
    from deepinfer_lang.unsupported import UnsupportedFeatureError

    raise UnsupportedFeatureError("sglang.lang.api.Engine: use deepinfer_rt.Engine (our offline engine)")
