"""DeepInfer 0.1.0's offline API over our Engine: a script written for `from deepinfer import LLM,
SamplingParams` runs with `from deepinfer_rt.compat.deepinfer import LLM, SamplingParams`.

`LLM(model, ..., **engine_args)` takes DeepInfer's constructor arguments (and EngineArgs keywords); what maps is
mapped (table in README), what has no counterpart here is refused with a ValueError naming it, never dropped.
`generate(prompts, sampling_params, prompt_token_ids, use_tqdm)` returns, per prompt, the decoded output text
(`decode_sequence=True`, DeepInfer's default) or DeepInfer's per-token `RequestOutput` list.

Teacher forcing (`golden_token_ids`): the forced tokens are the model's input after the prompt, so their logprobs
are the prompt logprobs of an extended prompt (one prefill computes them all); sampling continues after them.
The output holds the forced tokens, then the sampled ones, within max_tokens, as DeepInfer's does.
"""
from __future__ import annotations

import os
import random

from deepinfer_rt.compat.forcing import ForcedRequest, RequestOutput
from deepinfer_rt.sampling_params import SamplingParams as EngineSamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

_SAMPLING_EPS = 1e-5
_INT32_MAX = 2**31 - 1


class _WideTopLogprobs(EngineSamplingParams):
    """Our SamplingParams with DeepInfer's bound on top_logprobs."""
    max_top_logprobs = 1000


class SamplingParams:
    """DeepInfer's SamplingParams (same arguments, defaults and checks); `to_engine()` gives ours."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, ignore_eos: bool = False,
                 max_tokens: int = 16, logprobs: bool = False, prompt_logprobs: bool = False, top_logprobs: int = 0,
                 first_n_token_no_eos: int = 0, eos_id: int = 0, so_args: dict | None = None,
                 golden_token_ids: list[int] | None = None, seq_seed: int | None = None) -> None:
        del logprobs  # DeepInfer ignores it too: every RequestOutput carries its token's logprob
        self.temperature, self.top_p, self.top_k, self.ignore_eos = temperature, top_p, top_k, ignore_eos
        self.max_tokens = 1 if max_tokens == 0 else max_tokens
        self.prompt_logprobs, self.top_logprobs = prompt_logprobs, top_logprobs
        if seq_seed is not None and not isinstance(seq_seed, int):
            raise TypeError(f"seq_seed must be an int, got {type(seq_seed).__name__}")
        self.seq_seed = random.getrandbits(64) if seq_seed is None else seq_seed & 0xFFFF_FFFF_FFFF_FFFF
        self._verify_args()
        self.is_greedy = temperature < _SAMPLING_EPS
        self.first_n_token_no_eos, self.eos_id = first_n_token_no_eos, eos_id
        self.so_args, self.golden_token_ids = so_args, golden_token_ids
        self._constraint()  # so_args checked here, as DeepInfer's matcher builder would at submission

    def _verify_args(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0 or self.top_k > _INT32_MAX:
            raise ValueError(f"top_k must be -1 (disable), or between 1 and int32 max, got {self.top_k}.")
        if self.max_tokens < 1 or self.max_tokens > _INT32_MAX:
            raise ValueError(f"max_tokens must be >= 1 and in range of int32, got {self.max_tokens}.")
        if self.top_logprobs < 0 or self.top_logprobs > 1000:
            raise ValueError(f"top_logprobs must be in [0, 1000], got {self.top_logprobs}.")

    def _constraint(self) -> dict:
        so = self.so_args
        if so is None:
            return {}
        if not isinstance(so, dict) or "schema_type" not in so or "schema" not in so:
            raise ValueError("so_args: a dict with 'schema_type' and 'schema'")
        extra = sorted(set(so) - {"schema_type", "schema"})
        if extra:
            raise ValueError(f"so_args: {extra} (trigger/bound tokens) are not supported")
        kinds = {"json": "json_schema", "regex": "regex", "ebnf": "ebnf"}
        if so["schema_type"] not in kinds:
            raise ValueError(f"so_args.schema_type: one of {sorted(kinds)}, got {so['schema_type']!r}")
        return {kinds[so["schema_type"]]: so["schema"]}

    def to_engine(self, eos_ids: tuple[int, ...], num_forced: int, logprobs: bool) -> EngineSamplingParams:
        """Ours, for the part after `num_forced` teacher-forced tokens."""
        if self.eos_id not in (0, *eos_ids):
            raise ValueError(f"eos_id: {self.eos_id} is not an EOS id of this model {list(eos_ids)} (the engine "
                             "bans the model's EOS ids for first_n_token_no_eos)")
        if not isinstance(self.first_n_token_no_eos, int) or self.first_n_token_no_eos < 0:
            raise ValueError(f"first_n_token_no_eos: an int >= 0, got {self.first_n_token_no_eos!r}")
        max_new = max(1, self.max_tokens - num_forced)
        return _WideTopLogprobs(
            max_new_tokens=max_new, min_new_tokens=min(max_new, max(0, self.first_n_token_no_eos - num_forced)),
            temperature=0.0 if self.is_greedy else self.temperature, top_p=self.top_p, top_k=self.top_k,
            ignore_eos=self.ignore_eos, seed=self.seq_seed, logprobs=logprobs, top_logprobs=self.top_logprobs,
            prompt_logprobs=self.prompt_logprobs or num_forced > 0, **self._constraint())

    def __repr__(self) -> str:
        return (f"SamplingParams(temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}, "
                f"ignore_eos={self.ignore_eos}, max_tokens={self.max_tokens}, prompt_logprobs={self.prompt_logprobs}, "
                f"top_logprobs={self.top_logprobs}, so_args={self.so_args}, seq_seed={self.seq_seed})")


# DeepInfer LLM / EngineArgs keyword -> (Engine keyword or None, accepted values or None for any)
_DEFAULTS_ONLY = {"max_model_len": None, "data_parallel_size": (0, 1), "context_parallel_size": (1,),
                  "engram_parallel_size": (0,), "engine_rank": (0,), "engine_group_rank": (0,),
                  "stop_preempted_request": (False,), "engine_type": None, "ignore_len": None,
                  "lookahead_tokens": (0,), "revision": None, "tokenizer_revision": None}
"""Arguments accepted only at these values (None: only when left unset)."""
_NO_EFFECT = ("served_model_name", "disable_log_stats", "chunked_prefill", "trust_remote_code")
"""Accepted with no effect offline: a name for servers, stats logging, chunking (always on; outputs are the same),
and remote code (the engine never runs checkpoint code; architectures come from its registry)."""
_ENGINE_KWARGS = ("dtype", "device", "kv_cache_tokens", "enable_prefix_cache", "schedule_policy", "batch_invariant",
                  "speculative", "quantization", "load_format", "max_num_seqs")


class LLM:
    """DeepInfer's LLM over deepinfer_rt.Engine."""

    def __init__(self, model: str, tokenizer: str | None = None, trust_remote_code: bool = False,
                 expert_parallel_size: int = 1, revision: str | None = None, tokenizer_revision: str | None = None,
                 seed: int = 0, gpu_memory_utilization: float | None = None, decode_sequence: bool = True,
                 **kwargs) -> None:
        from deepinfer_rt.preflight import CliError, resolve_device, resolve_local_model
        from deepinfer_rt.engine import Engine

        given = {"revision": revision, "tokenizer_revision": tokenizer_revision, **kwargs}
        engine_kwargs = {"ep_size": expert_parallel_size, "seed": seed}
        for name, value in given.items():
            if name in _DEFAULTS_ONLY:
                allowed = _DEFAULTS_ONLY[name]
                if (value is not None) if allowed is None else (value not in allowed):
                    raise ValueError(f"LLM({name}={value!r}): not supported by this engine"
                                     + ("" if allowed is None else f" (accepted: {list(allowed)})"))
            elif name == "max_num_batched_tokens":
                if value is not None:
                    engine_kwargs["chunked_prefill_tokens"] = value
            elif name == "tokens_per_block":
                if value != -1:
                    engine_kwargs["page_size"] = value
            elif name in _ENGINE_KWARGS:
                engine_kwargs[name] = value
            elif name == "offline_inference":
                raise TypeError("LLM() got multiple values for keyword argument 'offline_inference'")
            elif name not in _NO_EFFECT:
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        if tokenizer not in (None, model):
            raise ValueError("LLM(tokenizer=...): the tokenizer is loaded from the model folder; a separate one "
                             "is not supported")
        try:
            engine_kwargs["model"] = resolve_local_model(model)
            engine_kwargs["device"] = resolve_device(engine_kwargs.get("device", "auto"))
        except CliError as e:
            raise ValueError(str(e).replace("--model ", "model=").replace("--device ", "device=")) from None
        self.decode_sequence = decode_sequence
        saved = os.environ.get("DEEPINFER_KV_CACHE_MEMORY_FRACTION")
        if gpu_memory_utilization is not None:  # the KV pool's share of the memory free after the weights
            os.environ["DEEPINFER_KV_CACHE_MEMORY_FRACTION"] = str(gpu_memory_utilization)
        try:
            self.llm_engine = Engine(**engine_kwargs)
        finally:
            if gpu_memory_utilization is not None:
                os.environ.pop("DEEPINFER_KV_CACHE_MEMORY_FRACTION") if saved is None else \
                    os.environ.__setitem__("DEEPINFER_KV_CACHE_MEMORY_FRACTION", saved)
        self._num_requests = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids=None, use_tqdm: bool = True, multi_modal_data=None) -> list:
        if multi_modal_data is not None:
            raise ValueError("multi_modal_data: multimodal inputs are not supported")
        if prompts is None and prompt_token_ids is None:
            raise ValueError("Either prompts or prompt_token_ids must be provided.")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None and prompt_token_ids is not None and len(prompts) != len(prompt_token_ids):
            raise ValueError("The lengths of prompts and prompt_token_ids must be the same.")
        num = len(prompts) if prompts is not None else len(prompt_token_ids)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != num:
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {num} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * num
        tok = self.llm_engine.tokenizer
        ids = [[int(t) for t in prompt_token_ids[i]] if prompt_token_ids is not None else tok.encode(prompts[i])
               for i in range(num)]
        return self._run(ids, params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True) -> list:
        """Each conversation rendered by the model's chat renderer (its chat template, or the one registered for
        its family), then generated as `generate` does."""
        from deepinfer_rt.models.loader import resolve_model_path
        from deepinfer_rt.server.chat import make_chat_format

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        renderer = make_chat_format(self.llm_engine.tokenizer,
                                    resolve_model_path(self.llm_engine.config.model)).renderer
        ids = [renderer.render(list(c), {}).ids for c in conversations]
        return self.generate(sampling_params=sampling_params, prompt_token_ids=ids, use_tqdm=use_tqdm)

    def _run(self, prompt_ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool) -> list:
        from tqdm import tqdm

        engine = self.llm_engine
        want_logprobs = not self.decode_sequence
        requests = []
        try:
            for ids, p in zip(prompt_ids, params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params: expected deepinfer_rt.compat.deepinfer.SamplingParams, "
                                     f"got {type(p).__name__}")
                requests.append(ForcedRequest.submit(engine, ids, p, want_logprobs))
        except BaseException:
            engine.abort([r.req for r in requests])
            raise
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm)
        num_steps, num_done = engine.num_steps, 0
        while num_done < len(requests):
            num_steps = engine.wait_for_step(num_steps, 0.5)
            if engine.loop_error is not None:
                raise RuntimeError(f"engine failed: {engine.loop_error}")
            now = sum(r.req.is_finished for r in requests)
            bar.update(now - num_done)
            num_done = now
        bar.close()
        failed = [f"{i}: {r.req.error}" for i, r in enumerate(requests) if r.finish_reason == "error"]
        if failed and self.decode_sequence:  # a text alone cannot say that it failed
            raise RuntimeError(f"requests failed: {'; '.join(failed)}")
        results = []
        for r in requests:
            rid = str(self._num_requests)
            self._num_requests += 1
            tokens = r.output_tokens()
            results.append(engine.tokenizer.decode(tokens) if self.decode_sequence else r.outputs(rid))
        return results

    def close(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
