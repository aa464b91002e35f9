"""Engine: the in-process runtime. Public API contract in ARCHITECTURE.md section 2."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
import weakref
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Sequence

import torch

from deepinfer_rt.cache.base import NoPrefixCache, PrefixCache
from deepinfer_rt.cache.kv_pool import KVPool, check_kv_cache_dtype, num_kv_pages
from deepinfer_rt.cache.radix_cache import RadixCache
from deepinfer_rt.config import CacheConfig, EngineConfig, SchedulerConfig
from deepinfer_rt.engine_loop import EngineLoop
from deepinfer_rt.env import get_env
from deepinfer_rt.executor import Executor
from deepinfer_rt.layers.attention.select import select_backend
from deepinfer_rt.model_runner import ModelRunner
from deepinfer_rt.layers.kernel_config import KernelConfig, cpu_has_native_bf16
from deepinfer_rt.models.loader import build_model, load_model_config, resolve_model_path
from deepinfer_rt.models.registry import prompt_checker
from deepinfer_rt.output_processor import OutputProcessor
from deepinfer_rt.request import GenerateOutput, Req
from deepinfer_rt.sampler import Sampler, stream_seed
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.scheduler.batch import ScheduledBatch
from deepinfer_rt.scheduler.scheduler import Scheduler
from deepinfer_rt.speculative.config import SpeculativeConfig
from deepinfer_rt.speculative.decoder import build_spec_decoder
from deepinfer_rt.tokenizer import load_tokenizer

logger = logging.getLogger("deepinfer_rt")

_GRAMMAR_WAIT_S = 0.05
"""Longest the loop waits at once for a grammar compilation when nothing else can run."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 on CUDA and on CPUs that multiply bf16 natively (AMX / AVX512-BF16), fp32 on other CPUs."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {dtype!r}")
    return _DTYPES[dtype]


class Engine:
    def __init__(self, model: str = "smollm2-135m-instruct", dtype: str = "auto", device: str = "cpu",
                 load_format: str = "auto", max_num_seqs: int = 256, kv_cache_tokens: int | None = None,
                 page_size: int = 1, chunked_prefill_tokens: int = 2048, enable_prefix_cache: bool = True,
                 schedule_policy: str = "lpm", batch_invariant: bool = False, ep_size: int = 1, seed: int = 0,
                 speculative: "str | SpeculativeConfig | None" = None, quantization: str | None = None,
                 kv_cache_dtype: str = "auto"):
        env = get_env()
        logging.getLogger("deepinfer_rt").setLevel(env.log_level.upper())
        if env.num_threads:
            torch.set_num_threads(env.num_threads)
        dev = torch.device(device)
        if schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be 'lpm' or 'fcfs', got {schedule_policy!r}")
        if page_size < 1 or chunked_prefill_tokens < 1 or max_num_seqs < 1:
            raise ValueError("page_size, chunked_prefill_tokens and max_num_seqs must be >= 1")
        if ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {ep_size}")
        check_kv_cache_dtype(kv_cache_dtype)
        self.config = EngineConfig(
            model=model, dtype=_resolve_dtype(dtype, dev), device=dev, load_format=load_format, seed=seed,
            batch_invariant=batch_invariant or env.batch_invariant, ep_size=ep_size,
            cache=CacheConfig(page_size, kv_cache_tokens, enable_prefix_cache, kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs, chunked_prefill_tokens, schedule_policy),
            quantization=quantization)
        path = resolve_model_path(model)
        self.model_config, _ = load_model_config(path)
        self.tokenizer = load_tokenizer(path)
        self._check_prompt = prompt_checker(self.model_config)
        """Model-specific prompt refusals (DeepSeek-V4.1: image placeholders, text-only engine)."""
        mc = self.model_config
        self.eos_ids = mc.eos_token_ids or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id
                                            is not None else ())
        self.sampler = Sampler(mc.vocab_size)
        self.spec = None
        if ep_size > 1 or env.ep_worker_pool:
            from deepinfer_rt.distributed.worker_pool import WorkerPool

            KernelConfig.from_env(dev, self.config.batch_invariant, quantization)  # refused here, not in a worker
            spec_config = None if speculative is None else SpeculativeConfig.parse(speculative)
            if spec_config is not None:  # planned here, verified in the workers (distributed/spec.py)
                from deepinfer_rt.distributed.spec import engine_spec_decoder

                self.spec = engine_spec_decoder(spec_config, mc, self.config.batch_invariant)
            # The model lives in the EP worker processes; the pool's allocator hands out pages of theirs.
            self.model = None
            self.executor: Executor = WorkerPool(self.config, path, mc, self.eos_ids, spec_config and
                                                 dataclasses.replace(spec_config, drafter=None,
                                                                     max_draft=spec_config.num_draft))
            self.executor.spec = self.spec
            self.pool = self.executor
        else:
            self.model = build_model(self.model_config, path, load_format, self.config.dtype, dev, seed,
                                     kernel_config=KernelConfig.from_env(dev, self.config.batch_invariant,
                                                                         quantization))
            # Speculative decoding (off unless asked): "prompt_lookup", "mtp" or a SpeculativeConfig.
            self.spec = None if speculative is None else build_spec_decoder(
                SpeculativeConfig.parse(speculative), self.model, self.model_config, path, load_format,
                self.config.batch_invariant, seed)
            self.pool = KVPool(self._kv_layout(), self._num_pages(), page_size, self.config.dtype, dev,
                               kv_cache_dtype)
            backend = select_backend(dev, self.config.batch_invariant, self.pool.is_fp8)
            overlap = (env.overlap if env.overlap is not None else dev.type == "cuda") and self.model.supports_overlap
            graphs = None
            if dev.type == "cuda" and env.cuda_graph_max_bs > 0 and self.model.supports_cuda_graphs:
                from deepinfer_rt.cuda_graph import CudaGraphRunner

                # One page table row per running request (the graphs' and the eager steps' alike).
                graphs = CudaGraphRunner(self.model, self.pool, backend, min(max_num_seqs, env.cuda_graph_max_bs),
                                         min(mc.max_position, env.cuda_graph_max_context), num_rows=max_num_seqs + 8,
                                         head=self.model.compute_logits, vocab_size=self.sampler.vocab_size)
            runner = ModelRunner(self.model, self.pool, backend, self.sampler, dev, self.eos_ids,
                                 is_overlap_enabled=overlap, graphs=graphs, spec=self.spec, max_num_seqs=max_num_seqs,
                                 max_context=mc.max_position)
            self.executor = runner
        if getattr(self.executor, "rank_pools", None):  # data-parallel attention: a scheduler per EP rank
            from deepinfer_rt.distributed.dp_scheduler import DPScheduler

            self.scheduler = DPScheduler(self.config.scheduler, self.executor.rank_pools, enable_prefix_cache,
                                         spec=self.spec)
            self.cache = self.scheduler.cache
        else:
            self.cache: PrefixCache = (RadixCache(self.executor.allocator, page_size) if enable_prefix_cache
                                       else NoPrefixCache(self.executor.allocator, page_size))
            self.scheduler = Scheduler(self.config.scheduler, self.executor, self.cache, spec=self.spec)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids, mc.max_position)
        self._rng = random.Random(seed)
        self._rids = itertools.count()
        self._grammar = None
        self._grammar_lock = threading.Lock()
        """Callers' threads build the grammar backend on first use and submit to it: one at a time (without
        it, a batch of constrained programs started together built one backend per thread)."""
        self._inflight: _Inflight | None = None
        self._loop = EngineLoop(self.step, self._fail_step, self._is_busy)
        self._cond = self._loop.cond
        weakref.finalize(self, self._loop.close)  # an engine never shut down still ends its loop thread

    # ---- sizing ----
    def _num_pages(self) -> int:
        cfg, mc = self.config, self.model_config
        return num_kv_pages(self._kv_layout(), cfg.dtype, cfg.device, cfg.cache.page_size, cfg.cache.kv_cache_tokens,
                            cfg.scheduler.max_num_seqs, mc.max_position, kv_cache_dtype=cfg.cache.kv_cache_dtype)

    def _kv_layout(self):
        layout = self.model.kv_layout(self.model_config).with_kv_dtype(self.config.cache.kv_cache_dtype)
        return layout if self.spec is None else self.spec.kv_layout(layout)

    # ---- the loop ----
    def step(self) -> list[Req]:
        """One turn of the loop: schedule -> launch -> complete; returns the requests that finished. A step that
        can overlap stays in flight until the next one is launched behind it; any other completes at once."""
        self._loop.check_driver()
        finished = self._poll_grammars()
        batch = self.scheduler.schedule()
        is_overlapped = self.executor.can_overlap(batch)
        if not is_overlapped:  # this batch needs the step in flight on the host first
            finished += self._complete_inflight()
            batch = batch.unfinished()
        handle = None if batch.is_empty else self.executor.launch(batch, self._inflight and self._inflight.handle)
        finished += self._complete_inflight()  # the step before, applied while this one computes
        return finished + (self._idle() if handle is None else self._start(batch, handle, is_overlapped))

    def _start(self, batch: ScheduledBatch, handle, is_overlapped: bool) -> list[Req]:
        """A launched step: overlapped, it counts its tokens in flight and moves the computed counts on now (the
        next schedule needs them); otherwise it completes here."""
        if not is_overlapped:
            result = self.executor.collect(handle)
            self.scheduler.update(batch, result.num_accepted)
            return self._process(batch, result)
        live = batch.unfinished()  # the step completed meanwhile finished some (their rows are dropped)
        self.scheduler.update(live)  # before the new tokens count: a decode then offers nothing to the cache
        counted = [it.req for it in live.items]
        for req in counted:
            req.num_inflight_tokens += 1
        self._inflight = _Inflight(batch, handle, counted)
        return []

    def _complete_inflight(self) -> list[Req]:
        """Apply the overlapped step in flight, if any, as the synchronous engine would have."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        result = self.executor.collect(inflight.handle)
        for req in inflight.counted:
            req.num_inflight_tokens -= 1
        return self._process(inflight.batch, result)

    def _poll_grammars(self) -> list[Req]:
        """Constrained requests wait until their grammar is compiled (off this thread); a failed or timed-out
        compilation finishes that request alone with finish_reason 'error'."""
        failed = []
        for req in [r for r in self.scheduler.waiting if r.is_grammar_pending]:
            state, value = self._grammar.poll(req.grammar_handle)
            if state == "ready":
                req.grammar = value
            elif state == "error":
                self.scheduler.abort_waiting(req)
                req.finish("error", value)
                failed.append(req)
        return failed

    def _idle(self) -> list[Req]:
        pending = [r.grammar_handle for r in self.scheduler.waiting if r.is_grammar_pending]
        if pending and not self.scheduler.has_runnable:
            # Not long: a request submitted meanwhile is admitted by the next turn of the loop.
            self._grammar.wait(pending, max_wait_s=_GRAMMAR_WAIT_S)
        elif self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("scheduler made no progress with requests waiting")  # a bug, never a hang
        return []

    @property
    def grammar(self):
        """The structured-output backend (xgrammar), built on first use."""
        if self._grammar is None:
            with self._grammar_lock:
                if self._grammar is None:
                    from deepinfer_rt.constrained.grammar import GrammarBackend

                    grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_ids,
                                             get_env().grammar_compile_timeout_s)
                    self.executor.grammar = grammar
                    self._grammar = grammar
        return self._grammar

    def _process(self, batch: ScheduledBatch, result) -> list[Req]:
        """Apply a completed step's tokens, logprobs and stop conditions. An error while handling one request
        (its grammar, its text) finishes that request alone."""
        with self._cond:  # stream readers take text deltas under this lock
            for i, (first, values, tops) in result.prompt_logprobs.items():
                self.outputs.add_prompt_logprobs(batch.items[i].req, first, values, tops)
            pairs = [(batch.items[i].req, token, j) for j, (i, token) in enumerate(result.sampled)]
            pairs = [(req, token, j) for req, token, j in pairs if not req.is_finished]  # drafts past a stop
            if result.sample is not None and result.sample.logprobs is None and len(pairs) == len(batch.items):
                done = self.outputs.append_tokens([req for req, _, _ in pairs], [token for _, token, _ in pairs])
            else:
                done = [self.outputs.append_token(req, token, *result.logprobs_of(j)) for req, token, j in pairs]
            finished = [req for (req, _, _), d in zip(pairs, done) if d]
            for req in finished:
                self.scheduler.abort_waiting(req)  # retracted in the step scheduled since (overlap)
                self.scheduler.finish(req)
            return finished

    # ---- submission ----
    def _make_reqs(self, prompts, input_ids, sampling_params) -> list[list[Req]]:
        if self._loop.is_closed:
            raise RuntimeError("engine is shut down")
        if (prompts is None) == (input_ids is None):
            raise ValueError("generate: give exactly one of prompts or input_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            for i, p in enumerate(prompts):
                if not isinstance(p, str) or not p:
                    raise ValueError(f"prompts[{i}]: must be a non-empty string")
            id_lists = [self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        else:
            if input_ids and isinstance(input_ids[0], int):
                input_ids = [input_ids]
            id_lists = [list(ids) for ids in input_ids]
        n_inputs = len(id_lists)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n_inputs:
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {n_inputs} inputs")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * n_inputs
        vocab, ctx = self.model_config.vocab_size, self.model_config.max_position
        for i, (ids, p) in enumerate(zip(id_lists, params)):
            if not ids:
                raise ValueError(f"input_ids[{i}]: empty prompt")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"input_ids[{i}]: token ids must be ints in [0, {vocab})")
            if len(ids) >= ctx:
                raise ValueError(f"input_ids[{i}]: prompt of {len(ids)} tokens does not fit the model context "
                                 f"of {ctx} tokens")
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}]: expected SamplingParams, got {type(p).__name__}")
            try:
                self._check_prompt(ids, p)
            except ValueError as e:
                raise ValueError(f"input_ids[{i}]: {e}") from None
            p.validate(vocab)
            if p.constraint is not None:
                self.grammar.validate(*p.constraint)
        groups = []
        for ids, p in zip(id_lists, params):
            base_seed = p.seed if p.seed is not None else self._rng.getrandbits(63)
            group, leader = [], None
            for k in range(p.n):
                seed = base_seed if k == 0 else stream_seed(base_seed, -k)
                req = Req(next(self._rids), ids, p, seed)
                req.leader = leader
                leader = leader or req
                if p.constraint is not None:
                    grammar = self.grammar
                    with self._grammar_lock:
                        req.grammar_handle = grammar.submit(*p.constraint)
                self.outputs.start(req)
                group.append(req)
            groups.append(group)
        return groups

    def _submit(self, prompts=None, input_ids=None, sampling_params=None) -> list[list[Req]]:
        """Validate and build the requests here, on the caller's thread; the loop admits them."""
        groups = self._make_reqs(prompts, input_ids, sampling_params)
        reqs = [r for g in groups for r in g]
        self._loop.post(lambda: [self.scheduler.add(r) for r in reqs])
        return groups

    def _fail_step(self, error: BaseException) -> None:
        """A step raised (a fault of the step itself, e.g. a device error): its requests finish with an error and
        the loop goes on with the rest. With nothing running, the fault was in admitting the waiting ones."""
        message = f"internal error in the engine step: {type(error).__name__}: {error}"
        inflight, self._inflight = self._inflight, None
        failed = list(self.scheduler.running) + (inflight.counted if inflight else [])
        if not failed:
            failed = list(self.scheduler.waiting)
        for req in failed:
            req.num_inflight_tokens = 0
            if not req.is_finished:
                self.scheduler.abort_waiting(req)
                self.scheduler.finish(req)
                req.finish("error", message)

    # ---- public API ----
    def generate(self, prompts: list[str] | str | None = None, input_ids: list[list[int]] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerateOutput]:
        groups = self._submit(prompts, input_ids, sampling_params)
        reqs = [r for g in groups for r in g]
        self._loop.wait(lambda: all(r.is_finished for r in reqs))
        if logger.isEnabledFor(logging.INFO):
            logger.info("generate: %d requests done; engine stats %s", len(reqs), self.stats)
        return [GenerateOutput.from_req(r) for r in reqs]

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
               input_ids: list[int] | None = None) -> Iterator[str]:
        """Text deltas of one request, UTF-8 safe; never emits a partial stop string."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("SamplingParams.n: stream serves one sequence (n=1)")
        (req,), = self._submit([prompt] if prompt is not None else None,
                               [input_ids] if input_ids is not None else None, params)
        seen = -1
        while True:
            self._loop.wait(lambda: req.is_finished or len(req.token_ids) != seen)
            with self._cond:
                finished, seen = req.is_finished, len(req.token_ids)
                delta = req.detokenizer.take_delta(finished)
            if delta:
                yield delta
            if finished:
                return

    async def async_generate(self, prompts: list[str] | str | None = None,
                             input_ids: list[list[int]] | None = None,
                             sampling_params: SamplingParams | list[SamplingParams] | None = None
                             ) -> list[GenerateOutput]:
        groups = self._submit(prompts, input_ids, sampling_params)
        reqs = [r for g in groups for r in g]
        await self._loop.async_wait(lambda: all(r.is_finished for r in reqs))
        return [GenerateOutput.from_req(r) for r in reqs]

    async def async_stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                           input_ids: list[int] | None = None) -> AsyncIterator[str]:
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("SamplingParams.n: stream serves one sequence (n=1)")
        (req,), = self._submit([prompt] if prompt is not None else None,
                               [input_ids] if input_ids is not None else None, params)
        seen = -1
        while True:
            await self._loop.async_wait(lambda: req.is_finished or len(req.token_ids) != seen)
            with self._cond:
                finished, seen = req.is_finished, len(req.token_ids)
                delta = req.detokenizer.take_delta(finished)
            if delta:
                yield delta
            if finished:
                return

    def add_request(self, input_ids: list[int], sampling_params: SamplingParams) -> list[Req]:
        """Queue one request (its params.n sequences) without waiting for it (the server's scheduler process
        follows its progress with `wait_for_step`); ValueError as for generate."""
        (group,) = self._submit(input_ids=[input_ids], sampling_params=sampling_params)
        return group

    def wait_for_step(self, num_steps_seen: int, timeout_s: float) -> int:
        """Block until the loop has taken a step past `num_steps_seen`, or `timeout_s`; returns the count."""
        self._loop.wait(lambda: self._loop.num_steps > num_steps_seen, timeout_s)
        return self._loop.num_steps

    @property
    def num_steps(self) -> int:
        return self._loop.num_steps

    @property
    def loop_error(self) -> str | None:
        """Why the engine's loop died, once it has (every call then raises)."""
        return self._loop.error

    def _is_busy(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def abort(self, reqs: Sequence[Req]) -> None:
        """Finish unfinished requests with finish_reason 'abort' and give back their KV pages now."""
        def abort_now():
            for req in reqs:
                if not req.is_finished:
                    self.scheduler.abort_waiting(req)
                    self.scheduler.finish(req)
                    req.finish("abort", "aborted")
        self._loop.call(abort_now)

    def flush_cache(self) -> None:
        self._loop.call(self.cache.flush)

    def hold_loop(self):
        """Context manager: park the background loop; the calling thread then drives `step()` by hand (tests,
        host-time benchmarks). generate/stream called meanwhile from this thread step the engine themselves."""
        return self._loop.hold()

    def shutdown(self) -> None:
        """Stop the loop, finish what is unfinished with 'abort', stop the executor. Waiting callers return."""
        if self._loop.is_closed:
            return
        self._loop.stop()
        with self._cond:
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                req.finish("abort", "engine shut down")
            self.scheduler.running.clear()
            self.scheduler.waiting.clear()
        if self._grammar is not None:
            self._grammar.close()
        self.executor.shutdown()
        self._loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def stats(self) -> dict:
        """Engine counters: retractions, pool occupancy and, with the prefix cache, its hit rate/evictions."""
        allocator = self.executor.allocator
        stats = {"num_retractions": self.scheduler.num_retractions, "num_steps": self._loop.num_steps,
                 "num_free_pages": allocator.num_free, "num_pages": allocator.num_pages,
                 "num_cached_pages": self.cache.num_cached_pages}
        if isinstance(self.cache, RadixCache) or hasattr(self.cache, "stats"):
            stats.update(self.cache.stats())
        stats.update(self.executor.stats())  # the EP worker pool: MoE balance across ranks, EPLB moves
        if self.spec is not None:
            stats["spec"] = self.spec.stats()
        return stats


@dataclass
class _Inflight:
    """An overlapped step launched but not completed: its batch (rows of its tokens), handle, and the requests
    whose token it counted in flight."""
    batch: ScheduledBatch
    handle: object
    counted: list[Req]
