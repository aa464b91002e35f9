"""An expert-parallel worker process: one EP rank (one GPU on CUDA, one CPU process with gloo on CPU).

Every rank is an ordinary `python -m deepinfer_rt.distributed.worker` process (see main), whether the engine
started it or a launcher on another node did: nothing re-imports the user's script. It joins the EP group
through torch.distributed's env:// rendezvous (the variables torchrun sets: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK), holds the attention/dense weights, its slots of every MoE layer and a KV pool of its
own, and runs its part of the engine's plain-data steps (its own requests: attention is data-parallel) through
the ordinary ModelRunner; with no requests in a step it runs an empty one, its part in every MoE layer's
collectives. Steps arrive on a zmq DEALER socket; every rank answers each step with its sampled tokens.

Decode steps replay CUDA graphs on every rank, EP > 1 included: a step that decodes on every rank
(StepMsg.decode_rows) runs the capture-safe exchange (distributed/ep.py) sized by the smallest graph holding the
most rows any rank has, the same graph on every rank; a rank that cannot replay it (its page-table rows are
taken) runs the same exchange eagerly, and an empty rank its empty step through it, so the collectives line up.
Other steps (prefill, mixed, speculation) run eagerly with the exact exchange."""
from __future__ import annotations

import argparse
import os
import pickle
import threading
import time
import traceback
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer_rt.cache.kv_pool import KVPool, num_kv_pages
from deepinfer_rt.cuda_graph import CudaGraphRunner
from deepinfer_rt.distributed.ep import Exchange, ExpertShard, expert_tensors, moe_layers, run_empty
from deepinfer_rt.distributed.eplb import (
    LoadWindow,
    contiguous_placement,
    place_experts,
    plan_moves,
    window_objective,
)
from deepinfer_rt.distributed.messages import StepMsg, StepReply, WorkerArgs
from deepinfer_rt.distributed.mirrors import Mirrors
from deepinfer_rt.distributed.spec import WorkerDrafter, set_step_drafts, worker_spec_decoder
from deepinfer_rt.env import get_env
from deepinfer_rt.layers.attention.select import select_backend
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.model_runner import Launched, ModelRunner, RunResult
from deepinfer_rt.models.loader import build_model
from deepinfer_rt.sampler import Sampler
from deepinfer_rt.scheduler.batch import ScheduledBatch


class ShippedBitmasks:
    """Stands in for the grammar backend in a worker: the engine holds the grammar matchers, fills each
    constrained row's bitmask and ships it with the step (as that mirror request's `grammar`)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def fill_and_apply(self, logits: torch.Tensor, bitmasks: list[torch.Tensor | None]) -> None:
        import xgrammar

        rows = [i for i, b in enumerate(bitmasks) if b is not None]
        full = torch.full((logits.shape[0], bitmasks[rows[0]].shape[0]), -1, dtype=torch.int32)
        full[rows] = torch.stack([bitmasks[i] for i in rows])
        width = logits.shape[1]
        xgrammar.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=min(width, self.vocab_size),
                                             indices=rows)
        if width > self.vocab_size:
            logits[rows, self.vocab_size:] = float("-inf")


class Worker:
    def __init__(self, args: WorkerArgs):
        self.args = args
        self.device = self._init_distributed(args)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.config = args.model_config
        mc = self.config
        self.eplb = args.eplb if args.eplb.enabled and self.size > 1 else None
        env = get_env()
        self.exchange = Exchange(mc.num_experts_per_tok, self.device, env.ep_capacity_factor)
        """How the MoE hooks exchange pairs in the forward being launched (set per step, `_padded_tokens`)."""
        self.is_padded_forced = env.ep_padded_dispatch
        shard = ExpertShard(self._initial_placement(), mc.n_routed_experts, self.rank, self.device, self.exchange)
        # Built on the CPU and cut to this rank's experts before weights are read (checkpoint) or drawn on the
        # device (dummy), so no process ever holds every expert.
        self.model = build_model(mc, Path(args.model_path), args.load_format, args.dtype, self.device, args.seed,
                                 shard=shard, kernel_config=KernelConfig.from_env(self.device, args.batch_invariant,
                                                                   args.quantization))
        self.placement, self.recorder = shard.placement, shard.recorder
        self.experts = [moe.experts for moe in moe_layers(self.model)]
        # MTP's layer has an MoE of its own: sharded as the target's (its own placement, never rearranged);
        # DSpark's draft bank stays whole (distributed/spec.py).
        spec = None if args.speculative is None else worker_spec_decoder(
            args.speculative, args.batch_invariant, args.max_position, self.model, mc, Path(args.model_path),
            args.load_format, args.seed,
            lambda: ExpertShard(contiguous_placement(mc.n_routed_experts, self.size), mc.n_routed_experts,
                                self.rank, self.device, self.exchange))
        self.drafter = spec.drafter if spec is not None and isinstance(spec.drafter, WorkerDrafter) else None
        """MTP or DSpark drafting here after each step (distributed/spec.py), or None."""
        layout = self.model.kv_layout(mc).with_kv_dtype(args.kv_cache_dtype)
        layout = layout if spec is None else spec.kv_layout(layout)
        num_pages = self._num_kv_pages(layout)
        self.pool = KVPool(layout, num_pages, args.page_size, args.dtype, self.device, args.kv_cache_dtype)
        self.num_pages = num_pages - self._keep_scratch()
        """Pages the engine hands out (the first ones); the rest are the MTP chain's scratch (none for DSpark)."""
        # The engine's backend rule, so EP=1 in-process and EP=N in workers run the same attention.
        backend = select_backend(self.device, args.batch_invariant, self.pool.is_fp8)
        # Overlap is the engine's decision, step by step (StepMsg.is_overlapped).
        self.runner = ModelRunner(self.model, self.pool, backend, Sampler(mc.vocab_size), self.device, args.eos_ids,
                                  is_overlap_enabled=True, graphs=self._cuda_graphs(backend), spec=spec)
        self.runner.grammar = ShippedBitmasks(mc.vocab_size)
        self.mirrors = Mirrors()
        self.held: tuple[Launched, object] | None = None
        """The overlapped step launched and not yet answered, with its overflow snapshot (or None)."""
        self.window = LoadWindow(self.eplb.window_steps) if self.eplb else None
        self.num_steps = 0
        self.num_decode_steps = 0
        self.num_padded_steps = 0
        """Steps whose forwards ran the capture-safe exchange (graphs replayed, or eagerly)."""
        self.num_moved_experts = 0
        self.num_rearrangements = 0

    def _keep_scratch(self) -> int:
        """MTP: keep back the last pages of the pool for the drafter's chain, which this worker's allocator then
        hands out (the engine's allocators hand out the first ones, unknown to this one): the pages a full step
        drafts into, so every rank always drafts max_draft tokens (their forwards line up)."""
        keep = 0 if self.drafter is None else self.drafter.scratch_pages(self.args.max_num_seqs, self.args.page_size)
        if keep == 0:
            return 0
        allocator = self.pool.allocator
        if keep >= allocator.num_pages:
            raise ValueError(f"MTP under EP keeps {keep} KV pages for its drafts (max_num_seqs x (max_draft - 1) "
                             f"tokens) of a pool of {allocator.num_pages}: raise kv_cache_tokens")
        allocator.alloc(allocator.num_pages - keep)  # the engine's, never freed here
        return keep

    def _cuda_graphs(self, backend):
        """Decode CUDA graphs as the in-process engine builds them. At EP > 1 (MoE hooks installed) the graphs
        hold the capture-safe exchange's collectives, so every rank captures the same sizes in the same order:
        the ranks agree the largest (the smallest of theirs; 0 on any rank, e.g. DEEPINFER_EP_CUDA_GRAPHS=0:
        none). Not with speculation at EP > 1 (its steps are not agreed decode steps). NCCL puts one rank per
        GPU, so graphs at EP > 1 need as many GPUs as ranks."""
        env = get_env()
        ok = self.device.type == "cuda" and env.cuda_graph_max_bs > 0 and self.model.supports_cuda_graphs
        max_bs = min(self.args.max_num_seqs, env.cuda_graph_max_bs)
        max_context = min(self.config.max_position, env.cuda_graph_max_context)
        if self.recorder is None:
            return CudaGraphRunner(self.model, self.pool, backend, max_bs, max_context) if ok else None
        ok = ok and env.ep_cuda_graphs and self.args.speculative is None
        agreed = torch.tensor([max_bs if ok else 0], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed.item()) <= 0:
            return None
        graphs = CudaGraphRunner(self.model, self.pool, backend, int(agreed.item()), max_context,
                                 capture_scope=self.exchange.padded)
        self.recorder.reset()  # the warm-up forwards' routing is no load
        return graphs

    def _padded_tokens(self, msg: StepMsg) -> int | None:
        """Tokens per rank the step's capture-safe exchange is sized for, the same on every rank (all read the
        same message and hold the same graph sizes), or None: the exact exchange."""
        if self.recorder is None or not msg.decode_rows or self.runner.spec is not None:
            return None
        graphs = self.runner.graphs
        size = graphs.graph_size(msg.decode_rows) if graphs is not None else None
        return msg.decode_rows if size is None and self.is_padded_forced else size

    # ---- start ----
    @staticmethod
    def _init_distributed(args: WorkerArgs) -> torch.device:
        os.environ.update(args.dist_env)  # the engine's rendezvous, over any a launcher (torchrun) set
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # torchrun's agent store is not the engine's
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        timeout = timedelta(seconds=args.timeout_s)
        if args.device_type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        return device

    def _initial_placement(self):
        experts = self.config.n_routed_experts
        if self.eplb is None:
            return contiguous_placement(experts, self.size)
        slots = experts // self.size + self.eplb.redundant_per_rank
        return place_experts(torch.ones(1, experts, dtype=torch.float64), self.size, slots)

    def _num_kv_pages(self, layout) -> int:
        """The engine's KV budget rule, measured after the weights are in place; every rank holds a full pool
        (attention is data-parallel), so on a shared CPU the budget is split between ranks. All ranks take the
        smallest size, which the engine's allocator then hands out."""
        args = self.args
        pages = num_kv_pages(layout, args.dtype, self.device, args.page_size, args.kv_cache_tokens,
                             args.max_num_seqs, args.max_position, num_sharing_ranks=self.size,
                            kv_cache_dtype=args.kv_cache_dtype)
        pages = torch.tensor([pages], device=self.device)
        dist.all_reduce(pages, op=dist.ReduceOp.MIN)
        return int(pages.item())

    # ---- each step ----
    def step(self, msg: StepMsg) -> list[StepReply]:
        """Launch the step's forward and sampling; returns the answers now due: the overlapped step held from
        before (whose tokens this step's inputs read on the device), then this step's unless it is overlapped
        itself (held until the next step or a flush). The routing counts stay on the device (see `stats`)."""
        for src, dst in msg.kv_copies:
            self.pool.copy_slots(src, dst)
        batch = self._batch(msg)
        if self.drafter is not None:
            self.drafter.begin_step(msg.draft_forwards)
        padded = self._padded_tokens(msg)
        if self.recorder is not None and self.runner.graphs is not None:
            self.runner.graphs.step_batch_size = padded or 0  # the same graph on every rank, or none
        with self.exchange.padded(padded) if padded else nullcontext():
            if batch.is_empty:  # no requests on this rank this step: its part in the MoE layers' collectives only
                run_empty(self.model, self.config.hidden_size, self.args.dtype, self.device)
                if self.drafter is not None:
                    self.drafter.empty_step(self.args.dtype, self.device)
                handle = Launched(result=RunResult([], None, {}))
            else:
                self.num_decode_steps += all(it.num_new_tokens == 1 for it in batch.items)
                batch.is_overlappable = msg.is_overlapped
                prev = self.held[0] if msg.is_overlapped and self.held is not None else None
                handle = self.runner.launch(batch, prev)
        self.num_padded_steps += padded is not None
        overflow = self.exchange.snapshot() if padded else None
        if self.recorder is not None:
            expert_tokens = self.recorder.take()
            self.num_steps += 1
            if self.eplb is not None:
                self.window.add(expert_tokens)
                if self.num_steps % self.eplb.interval_steps == 0:
                    self._rearrange()
        replies = self.flush()
        if msg.is_overlapped:
            self.held = handle, overflow
        else:
            drafts = self.drafter.drafts() if self.drafter is not None else None
            replies.append(StepReply(self.rank, self._collect(handle, overflow), drafts))
        return replies

    def flush(self) -> list[StepReply]:
        """The answer of the overlapped step held, if any."""
        held, self.held = self.held, None
        return [] if held is None else [StepReply(self.rank, self._collect(*held))]

    def _collect(self, handle: Launched, overflow) -> RunResult:
        """The step's result; a step whose capture-safe exchange overflowed raises instead (Exchange.check)."""
        result = self.runner.collect(handle)
        if overflow is not None:
            self.exchange.check(overflow)
        return result

    def stats(self) -> dict:
        """Counters since the start, read back from the device only when the engine asks."""
        graphs = self.runner.graphs
        out = {"decode_steps": self.num_decode_steps, "graph_decode_steps": graphs.num_replays if graphs else 0,
               "padded_steps": self.num_padded_steps}
        if self.recorder is None:
            return out
        rank_tokens, sum_max = self.recorder.totals()
        return {**out, "rank_tokens": rank_tokens, "sum_max": sum_max, "num_moved_experts": self.num_moved_experts,
                "num_rearrangements": self.num_rearrangements}

    def _batch(self, msg: StepMsg) -> ScheduledBatch:
        """The step's batch over this rank's mirror requests (distributed/mirrors.py)."""
        batch = self.mirrors.apply(msg.new_reqs, msg.items)
        if self.runner.spec is not None:
            set_step_drafts(self.runner.spec, {it.rid: (it.draft_tokens, it.req.num_tokens)
                                               for it in batch.items if it.draft_tokens})
        return batch

    # ---- EPLB ----
    def _rearrange(self) -> None:
        """Every rank holds the same routing counts, so each computes the same new placement with no messages;
        only the slots whose expert changed receive weights, point to point from a rank that held it."""
        # Each rank counted its own tokens (attention is data-parallel): summed, every rank holds the same
        # counts and computes the same placement.
        loads = self.window.loads()  # (steps, layers, experts)
        dist.all_reduce(loads)
        loads = loads.cpu()
        moves = []
        for layer, old in enumerate(self.placement.layers):
            load = loads[:, layer]
            new = place_experts(load, self.size, len(old[0]), old)
            if window_objective(load, new) > (1 - self.eplb.min_improvement) * window_objective(load, old):
                continue
            moves.extend(plan_moves(layer, old, new))
            self.placement.set_layer(layer, new)
        self._move_weights(moves)
        self.num_moved_experts += len(moves)
        self.num_rearrangements += 1

    def _move_weights(self, moves) -> None:
        ops, received = [], []
        for i, move in enumerate(moves):
            params = [p for _, p in expert_tensors(self.experts[move.layer])]  # scales too, where kept
            if self.rank == move.src_rank:
                ops += [dist.P2POp(dist.isend, p.data[move.src_slot], move.dst_rank, tag=4 * i + j)
                        for j, p in enumerate(params)]
            elif self.rank == move.dst_rank:
                bufs = [torch.empty_like(p.data[move.dst_slot]) for p in params]
                ops += [dist.P2POp(dist.irecv, b, move.src_rank, tag=4 * i + j) for j, b in enumerate(bufs)]
                received.append((params, move.dst_slot, bufs))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        # Written only after every send completed: a slot may be a source and a destination in one move.
        for params, slot, bufs in received:
            for p, b in zip(params, bufs):
                p.data[slot].copy_(b)


def _connect(engine_addr: str, rank: int):
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)  # a last error report must leave before the process exits
    sock.connect(engine_addr)
    return ctx, sock


def _exit_with(parent_pid: int) -> None:
    """Watchdog thread: exit as soon as the engine that started this process is gone, whatever the main thread
    is doing (loading weights, waiting in a collective for a peer that died with it)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Entry of every worker process:

        RANK=2 LOCAL_RANK=0 python -m deepinfer_rt.distributed.worker tcp://ENGINE_HOST:DEEPINFER_EP_PORT
        torchrun --nproc-per-node 2 -m deepinfer_rt.distributed.worker --first-rank 2 tcp://ENGINE_HOST:PORT

    The engine starts its local ranks so, with --parent-pid; ranks beyond DEEPINFER_EP_LOCAL_WORKERS (another
    node) are started the same way by any launcher that sets RANK and LOCAL_RANK (WORLD_SIZE, when set, must be
    the engine's ep_size), or by torchrun on that node with --first-rank (the node's first EP rank; its
    processes take first rank + LOCAL_RANK, torchrun's own node-local RANK and rendezvous are not used). A worker
    asks the engine for its arguments ("hello"), including the rendezvous address, then serves steps."""
    parser = argparse.ArgumentParser(prog="python -m deepinfer_rt.distributed.worker")
    parser.add_argument("engine_addr", help="the engine's zmq address, tcp://HOST:PORT")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the engine that started this worker) is gone")
    parser.add_argument("--first-rank", type=int, default=None,
                        help="this node's first EP rank: the rank is it + LOCAL_RANK (for torchrun)")
    opts = parser.parse_args(argv)
    if opts.parent_pid:
        threading.Thread(target=_exit_with, args=(opts.parent_pid,), name="parent-watchdog", daemon=True).start()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if opts.first_rank is not None:
        rank, world_size = opts.first_rank + local_rank, None
    elif "RANK" in os.environ:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    else:
        raise SystemExit("deepinfer_rt.distributed.worker: set RANK (and LOCAL_RANK), or pass --first-rank")
    ctx, sock = _connect(opts.engine_addr, rank)
    sock.send(pickle.dumps(("hello", rank, world_size)))
    args = pickle.loads(sock.recv())
    if isinstance(args, tuple) and args[0] == "refused":
        sock.close()
        ctx.term()
        raise SystemExit(f"deepinfer_rt.distributed.worker: the engine refused rank {rank}: {args[1]}")
    args = replace(args, dist_env={**args.dist_env, "LOCAL_RANK": str(local_rank)})
    _serve(args, ctx, sock)


def _serve(args: WorkerArgs, ctx, sock) -> None:
    """Load, report ready, serve steps until told to stop."""
    code = 0
    try:
        worker = Worker(args)
        sock.send(pickle.dumps(("ready", args.rank, worker.num_pages, worker.model.supports_overlap)))
        while True:
            kind, msg = pickle.loads(sock.recv())
            if kind == "stop":
                break
            if kind == "stats":
                sock.send(pickle.dumps(("stats", args.rank, worker.stats())))
                continue
            for reply in worker.step(msg) if kind == "step" else worker.flush():
                sock.send(pickle.dumps(("step", args.rank, reply), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # any failure is reported to the engine, which names this rank in its error
        sock.send(pickle.dumps(("error", args.rank, traceback.format_exc())))
        code = 1
    finally:
        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
        sock.close()
        ctx.term()
    if code:
        os._exit(code)


if __name__ == "__main__":
    main()
