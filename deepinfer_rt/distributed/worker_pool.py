"""Engine side of expert parallelism: starts, feeds and supervises the EP worker processes.

`WorkerPool` is an Executor (deepinfer_rt/executor.py), so the engine loop does not know it is there: the
scheduling stays in the engine process. With one rank the engine's scheduler hands out pages of `allocator`;
with EP > 1 attention is data-parallel: the engine runs a DPScheduler (distributed/dp_scheduler.py) with one
scheduler per rank over that rank's pages (`rank_pools`), each rank receives its own part of the step as plain
data (what changed since the previous step, pickled once, sent over one zmq ROUTER socket, the KV slot copies
it needs included; an empty part makes that rank run an empty step) and every rank's sampled tokens come back,
merged in rank order. Every worker is an ordinary `python -m deepinfer_rt.distributed.worker` process, one
per GPU on CUDA, so a user's script needs no `if __name__ == "__main__":` guard (nothing re-imports it); workers
find each other through torch.distributed's env:// rendezvous. Ranks beyond DEEPINFER_EP_LOCAL_WORKERS are
started elsewhere (another node, by torchrun or any launcher that sets RANK and LOCAL_RANK) with the same
command; every rank asks the engine for its arguments and the rendezvous address, then serves.

Supervision: while waiting for a step the engine polls the socket and the workers' liveness every 0.2 s. A
worker that dies, reports an exception, or does not answer within DEEPINFER_EP_STEP_TIMEOUT makes `collect`
raise a RuntimeError naming it, and all workers are stopped: none outlives the engine (a finalizer stops them
even if shutdown is never called, and workers exit on their own when their parent disappears). Workers write to
the engine's stderr.
"""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import zmq

from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.config import EngineConfig, ModelConfig
from deepinfer_rt.distributed.dp_scheduler import DPBatch, RankPool
from deepinfer_rt.distributed.eplb import EPLBConfig
from deepinfer_rt.distributed.messages import WorkerArgs
from deepinfer_rt.distributed.mirrors import StepEncoder
from deepinfer_rt.distributed.spec import EngineSpecDecoder
from deepinfer_rt.env import get_env
from deepinfer_rt.model_runner import RunResult, is_overlappable
from deepinfer_rt.sampler import SampleResult
from deepinfer_rt.scheduler.batch import ScheduledBatch
from deepinfer_rt.speculative.config import SpeculativeConfig

_POLL_MS = 200


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _start_worker(rank: int, world_size: int, engine_addr: str) -> subprocess.Popen:
    """A local rank: a fresh interpreter running the worker module, which exits when this process is gone. It
    runs this process's deepinfer_rt whatever sys.path edits the user's script made."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this deepinfer_rt
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, "-m", "deepinfer_rt.distributed.worker", engine_addr, "--parent-pid", str(os.getpid())],
        env=env, stdin=subprocess.DEVNULL, stdout=2)  # stdout to our stderr (fd 2); stderr is inherited


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    try:
        proc.wait(max(0.0, timeout_s))
        return True
    except subprocess.TimeoutExpired:
        return False


def _stop_workers(num_workers: int, procs: list[subprocess.Popen], sock, ctx) -> None:
    """Ask every rank politely, then terminate, then kill the ones this engine started: a worker blocked in a
    collective (its peer died) or stopped by a signal answers only to SIGKILL."""
    for rank in range(num_workers):
        try:
            sock.send_multipart([f"w{rank}".encode(), pickle.dumps(("stop", None))], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    deadline = time.monotonic() + 3.0
    for p in procs:
        _wait(p, deadline - time.monotonic())
    for p in procs:
        if p.poll() is None:
            p.terminate()
            if not _wait(p, 1.0):
                p.kill()
                _wait(p, 5.0)
    sock.close(linger=0)
    ctx.term()


def _decode_rows(parts: list[ScheduledBatch]) -> int:
    """StepMsg.decode_rows of a step of these parts."""
    if all(it.num_new_tokens == 1 and not it.draft_tokens for part in parts for it in part.items):
        return max(len(part.items) for part in parts)
    return 0


class _PagesOfRanks:
    """Every rank's page allocator counted as one (engine stats)."""

    def __init__(self, pools: list[RankPool]):
        self.pools = pools

    @property
    def num_free(self) -> int:
        return sum(p.allocator.num_free for p in self.pools)

    @property
    def num_pages(self) -> int:
        return sum(p.allocator.num_pages for p in self.pools)


def merge_results(results: list[RunResult], num_items: list[int]) -> RunResult:
    """The ranks' results of one DPBatch (num_items[r]: items of rank r's part) as one, item indices moved past
    the items of the ranks before."""
    sampled, prompt_lps, num_accepted, tokens, logprobs, top = [], {}, {}, [], [], []
    has_lp, has_top, offset = False, False, 0
    verified = []  # speculation: every rank's verified tokens after all sampler rows, as RunResult lists them
    for result, n_items in zip(results, num_items):
        num_rows = len(result.sample.token_ids) if result.sample is not None else 0
        sampled += [(offset + i, t) for i, t in result.sampled[:num_rows]]
        verified += [(offset + i, t) for i, t in result.sampled[num_rows:]]
        prompt_lps.update({offset + i: v for i, v in result.prompt_logprobs.items()})
        num_accepted.update({offset + i: n for i, n in result.num_accepted.items()})
        s = result.sample
        if s is not None:
            n = len(s.token_ids)
            tokens += s.token_ids
            logprobs += s.logprobs if s.logprobs is not None else [0.0] * n
            top += s.top_logprobs if s.top_logprobs is not None else [[] for _ in range(n)]
            has_lp, has_top = has_lp or s.logprobs is not None, has_top or s.top_logprobs is not None
        offset += n_items
    sample = SampleResult(tokens, logprobs if has_lp else None, top if has_top else None) if tokens else None
    return RunResult(sampled + verified, sample, prompt_lps, num_accepted)


class WorkerPool:
    def __init__(self, config: EngineConfig, path: Path, model_config: ModelConfig, eos_ids: tuple[int, ...],
                 speculative: SpeculativeConfig | None = None):
        env = get_env()
        n = config.ep_size
        if n > 1 and not model_config.is_moe:
            raise ValueError(f"ep_size={n} needs a mixture-of-experts model; {model_config.architecture} is dense")
        if model_config.is_moe and model_config.n_routed_experts % n:
            raise ValueError(f"ep_size={n} must divide the {model_config.n_routed_experts} routed experts")
        num_local = env.ep_local_workers or n
        if config.device.type == "cuda" and num_local > torch.cuda.device_count():
            raise ValueError(f"{num_local} local EP workers need as many GPUs; {torch.cuda.device_count()} visible")
        self.size = n
        self.step_timeout_s = env.ep_step_timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host = env.ep_host
        if env.ep_port:
            port = env.ep_port
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        master = {"MASTER_ADDR": env.master_addr or host, "MASTER_PORT": str(env.master_port or _free_port(host)),
                  "WORLD_SIZE": str(n)}
        eplb = EPLBConfig(env.eplb, env.eplb_window_steps, env.eplb_interval_steps, env.eplb_redundant_per_rank)
        # Every rank gets the same arguments but its rank, sent when it asks ("hello").
        engine_addr = f"tcp://{host}:{port}"
        self._worker_args = [WorkerArgs(
            rank=rank, world_size=n, engine_addr=engine_addr,
            dist_env=dict(master, RANK=str(rank), LOCAL_RANK=str(rank)),
            model_path=str(path), model_config=model_config, dtype=config.dtype, device_type=config.device.type,
            load_format=config.load_format, seed=config.seed, page_size=config.cache.page_size,
            kv_cache_tokens=config.cache.kv_cache_tokens, max_num_seqs=config.scheduler.max_num_seqs,
            max_position=model_config.max_position, eos_ids=eos_ids,
            num_threads=env.num_threads or max(1, torch.get_num_threads() // num_local), eplb=eplb,
            timeout_s=max(60.0, 2 * env.ep_step_timeout_s), batch_invariant=config.batch_invariant,
            speculative=speculative, quantization=config.quantization,
            kv_cache_dtype=config.cache.kv_cache_dtype)
            for rank in range(n)]
        self._procs = [_start_worker(rank, n, engine_addr) for rank in range(num_local)]
        self._finalizer = weakref.finalize(self, _stop_workers, n, self._procs, self._sock, self._ctx)
        self._broken: str | None = None
        self._refused: list[str] = []
        """Why workers that asked to join were turned away (named when the start times out)."""
        ready = self._collect("ready", env.ep_start_timeout_s)
        num_pages = min(num_pages for num_pages, _ in ready.values())
        self.page_size = config.cache.page_size
        self.rank_pools = [RankPool(PageAllocator(num_pages), self.page_size) for _ in range(n)] if n > 1 else []
        """Data-parallel attention (EP > 1): each rank's KV pages, handed out by that rank's scheduler and prefix
        cache (distributed/dp_scheduler.py); the engine builds its DPScheduler over them."""
        self.allocator = PageAllocator(num_pages) if n == 1 else _PagesOfRanks(self.rank_pools)
        """One rank: the worker's KV pages, handed out by the engine's scheduler and prefix cache."""
        self.num_slots = num_pages * self.page_size
        self.spec: EngineSpecDecoder | None = None
        """Set by the engine with speculation: plans the drafts the workers verify, books what they accepted."""
        self.grammar = None
        """Set by the engine; the matchers stay here and the workers receive filled bitmask rows."""
        self._encoder = StepEncoder(self._bitmask)
        """What the workers' mirrors hold; turns each step's parts into the messages of what changed."""
        self._num_launched = self._num_collected = 0
        self._launched: dict[int, tuple[list[int], ScheduledBatch, float]] = {}
        """Launched, not yet collected step -> (its parts' item counts, its batch, its launch time)."""
        self._held: int | None = None
        """The overlapped step the workers hold unanswered until the next step (or a flush) arrives."""
        self._num_overlapped = 0
        self.is_overlap_enabled = ((env.overlap if env.overlap is not None else config.device.type == "cuda")
                                   and all(supports_overlap for _, supports_overlap in ready.values()))
        """As the in-process engine: off where the model needs each step's token ids on the host (V4.1's Engram
        hashing), which every worker reports when ready."""
        self._lock = threading.Lock()
        """Held while the socket is used: stats may be asked from another thread than the engine loop's."""
        self._last_stats: dict = {}
        self.reset_stats()

    # ---- supervision ----
    def _collect(self, kind: str, timeout_s: float) -> dict[int, tuple]:
        """One `kind` message from every worker, or RuntimeError naming the worker that failed."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.size:
            if self._sock.poll(_POLL_MS):
                _, payload = self._sock.recv_multipart()
                got, rank, *rest = pickle.loads(payload)
                if got == "hello":  # a worker asks for its arguments
                    self._answer_hello(rank, *rest)
                    continue
                if got == "error":
                    # A peer's death surfaces first as a collective error in the survivors: name the cause.
                    dead = self._dead_worker(wait_s=1.0)
                    self._fail(f"{dead}; worker {rank} then failed: {rest[0].strip().splitlines()[-1]}" if dead
                               else f"expert-parallel worker {rank} failed:\n{rest[0]}")
                replies[rank] = tuple(rest)
                continue
            dead = self._dead_worker(wait_s=0.0)
            if dead:
                self._fail(dead + self._late_error())
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - set(replies))
                variable, what = ("START", "starts") if kind == "ready" else ("STEP", "steps")
                refused = f"; workers refused: {'; '.join(self._refused)}" if self._refused else ""
                self._fail(f"expert-parallel worker(s) {missing} did not answer within {timeout_s:g} s "
                           f"(hung?); set DEEPINFER_EP_{variable}_TIMEOUT for longer {what}{refused}")
        return replies

    def _answer_hello(self, rank: int, world_size: int | None = None) -> None:
        """Its arguments to a rank the engine expects; a clear refusal to any other (the worker exits with it)."""
        problem = None
        if not 0 <= rank < self.size:
            problem = f"rank {rank} is outside the EP group of {self.size} ranks (ep_size)"
        elif world_size is not None and world_size != self.size:
            problem = f"WORLD_SIZE={world_size} but the engine runs ep_size={self.size}"
        if problem is not None:
            self._sock.send_multipart([f"w{rank}".encode(), pickle.dumps(("refused", problem))])
            self._refused.append(problem)
            return
        self._sock.send_multipart([f"w{rank}".encode(), pickle.dumps(self._worker_args[rank])])

    def _dead_worker(self, wait_s: float) -> str | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    return f"expert-parallel worker {rank} (pid {proc.pid}) died with exit code {proc.returncode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _late_error(self) -> str:
        """The traceback a dying worker sent, if it arrives shortly after its death was noticed."""
        if self._sock.poll(500):
            _, payload = self._sock.recv_multipart()
            got, _, *rest = pickle.loads(payload)
            if got == "error":
                return f":\n{rest[0]}"
        return ""

    def _fail(self, message: str) -> None:
        self._broken = message
        self._finalizer()
        raise RuntimeError(message)

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- each step (the Executor contract) ----
    def launch(self, batch: ScheduledBatch, prev=None) -> int:
        """Send the step to every worker and return its number without waiting. An overlapped step's inputs may
        be the previous step's tokens: the workers hold that step (`prev`) and read them on their device."""
        if self._broken is not None:
            raise RuntimeError(f"the expert-parallel worker pool is down: {self._broken}")
        parts = batch.parts if isinstance(batch, DPBatch) else [batch]
        if len(parts) != self.size:
            raise ValueError(f"an EP={self.size} step needs one part per rank (a DPBatch), got {len(parts)}")
        is_overlapped = self.can_overlap(batch)
        msgs = self._encoder.encode(parts, is_overlapped, self.spec is not None)
        if self.spec is not None and self.spec.num_chain_forwards and any(it.is_sampling for it in batch.items):
            for msg in msgs:  # MTP: the chain forwards of the drafts, on every rank (distributed/spec.py)
                msg.draft_forwards = self.spec.num_chain_forwards
        decode_rows = _decode_rows(parts)
        for msg in msgs:
            msg.decode_rows = decode_rows
        payloads = [pickle.dumps(("step", msg), protocol=pickle.HIGHEST_PROTOCOL) for msg in msgs]
        with self._lock:
            for rank, payload in enumerate(payloads):
                self._sock.send_multipart([f"w{rank}".encode(), payload])
            handle = self._num_launched
            self._launched[handle] = ([len(part.items) for part in parts], batch, time.perf_counter())
            self._held = handle if is_overlapped else None
            self._num_launched += 1
            self._num_overlapped += is_overlapped
        return handle

    def collect(self, handle: int) -> RunResult:
        """Wait for every rank's answer to step `handle` (steps are collected in launch order), merged."""
        if self._broken is not None:
            raise RuntimeError(f"the expert-parallel worker pool is down: {self._broken}")
        assert handle == self._num_collected, f"step {handle} collected out of order (next: {self._num_collected})"
        with self._lock:
            if self._held == handle:  # the workers answer an overlapped step when the next one comes: no next
                for rank in range(self.size):
                    self._sock.send_multipart([f"w{rank}".encode(), pickle.dumps(("flush", None))])
                self._held = None
            replies = self._collect("step", self.step_timeout_s)
            self._num_collected += 1
            num_items, batch, start = self._launched.pop(handle)
        if self.size == 1:
            result = replies[0][0].result
        else:
            result = merge_results([replies[rank][0].result for rank in range(self.size)], num_items)
        if self.spec is not None:
            drafts = [replies[rank][0].drafts for rank in range(self.size)]
            self.spec.book(batch, result.num_accepted, time.perf_counter() - start, [d for d in drafts if d is not None])
        return result

    def run(self, batch: ScheduledBatch) -> RunResult:
        return self.collect(self.launch(batch))

    def can_overlap(self, batch: ScheduledBatch) -> bool:
        """As the local runner: a decode step launched while the step before computes (DEEPINFER_OVERLAP, on by
        default on CUDA); the workers read its inputs from that step's tokens on their device."""
        if not self.is_overlap_enabled or self.spec is not None:
            return False
        if batch.is_overlappable is None:
            batch.is_overlappable = is_overlappable(batch)
        return batch.is_overlappable

    def _bitmask(self, req) -> torch.Tensor:
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(1, self.grammar.vocab_size)
        req.grammar.matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]

    # ---- statistics ----
    def reset_stats(self) -> None:
        """Restart the balance counters (a benchmark measures after its warm-up)."""
        self._stats_base = self._read_stats() if hasattr(self, "_stats_base") else {}

    def _read_stats(self) -> dict:
        """Rank 0's counters (every rank records the same: the gathered pair counts), asked for between steps; while a step
        is in flight (another thread drives the loop), the last ones read."""
        with self._lock:
            if self._broken is None and self._num_launched == self._num_collected:
                for rank in range(self.size):
                    self._sock.send_multipart([f"w{rank}".encode(), pickle.dumps(("stats", None))])
                replies = self._collect("stats", self.step_timeout_s)
                self._last_stats = {**replies[0][0], "graph_decode_steps_per_rank":
                                    [replies[rank][0]["graph_decode_steps"] for rank in range(self.size)]}
        return self._last_stats

    def stats(self) -> dict:
        """MoE balance over the steps and layers since reset_stats: moe_balance = sum of mean / sum of max
        (token, expert) pairs per rank (1.0 = even); per-rank totals; EPLB rearrangements and expert copies
        moved; rank 0's decode steps, those of them that replayed a CUDA graph and its steps through the
        capture-safe exchange (ep_decode_steps, ep_graph_decode_steps, ep_padded_steps), and every rank's graph
        replays (ep_graph_decode_steps_per_rank). One rank has no balance to report."""
        now, base = self._read_stats(), self._stats_base
        graphs = {f"ep_{key}": now[key] - base.get(key, 0) for key in ("decode_steps", "graph_decode_steps",
                                                                        "padded_steps")
                  if key in now}
        if "graph_decode_steps_per_rank" in now:
            graphs["ep_graph_decode_steps_per_rank"] = [
                a - b for a, b in zip(now["graph_decode_steps_per_rank"],
                                      base.get("graph_decode_steps_per_rank", [0] * self.size))]
        if "rank_tokens" not in now:
            return {"ep_size": self.size, "ep_overlapped_steps": self._num_overlapped, **graphs}
        rank_tokens = [a - b for a, b in zip(now["rank_tokens"], base.get("rank_tokens", [0] * self.size))]
        sum_max = now["sum_max"] - base.get("sum_max", 0)
        return {"ep_size": self.size, "ep_overlapped_steps": self._num_overlapped, **graphs,
                "ep_tokens_per_rank": rank_tokens,
                "moe_balance": sum(rank_tokens) / self.size / sum_max if sum_max else 1.0,
                "eplb_rearrangements": now["num_rearrangements"], "eplb_moved_experts": now["num_moved_experts"]}
