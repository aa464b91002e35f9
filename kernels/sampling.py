"""Gumbel-max sampling of a whole batch in one kernel: token = argmax_i(z[i] - log(-log(u_i))), where u is the
counter-based noise of the row's own seed (Philox: lane i % 4 of tl.rand4x(seed, i // 4)), clamped below at 1e-20.
With per-row temperatures t, z = logits / t (IEEE division, as torch's), and a row of t == 0 takes the argmax of
its logits without noise (a greedy row): so a CUDA graph can end a decode step with every row's token.

A row's draw depends on its seed and logits only, never on the batch it runs in. Each program takes BLOCK * 4
consecutive tokens of one row (a 129K-token vocabulary is ~130 programs a row, so one request still spreads
over the GPU), and folds its best (value, index) into the row's int64 key with one atomic max: the key is the
value's order-preserving int32 bits above the complement of the index, so the largest key is the largest value
and, among equal values, the lowest index (torch.argmax's choice; a row of -inf gives index 0). The row's last
program to finish (an atomic count) writes its token: one launch a batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256
"""Philox counters per program (4 tokens each)."""
_KEY_MIN = -(1 << 63)


@triton.jit
def _lane_key(Z, row_z, offs4, j: tl.constexpr, u, V, t, HAS_TEMP: tl.constexpr):
    """int64 keys of the Gumbel-perturbed logits of tokens offs4 * 4 + j."""
    idx = offs4 * 4 + j
    z = tl.load(Z + row_z + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    if HAS_TEMP:
        greedy = t == 0.0
        z = tl.math.div_rn(z, tl.where(greedy, 1.0, t))
        g = tl.where(greedy, z, z - tl.log(-tl.log(tl.maximum(u, 1e-20))))
    else:
        g = z - tl.log(-tl.log(tl.maximum(u, 1e-20)))
    g = g + 0.0  # -0.0 + 0.0 == +0.0: the two zeros get one key
    bits = g.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # signed order == float order
    return ordered * 4294967296 + (4294967295 - idx.to(tl.int64))


@triton.jit
def _gumbel_kernel(Z, Seeds, Temps, Keys, Counts, Out, V, stride_z, stride_t, KEY_MIN: tl.constexpr,
                   BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr):
    row = tl.program_id(0)
    offs4 = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u0, u1, u2, u3 = tl.rand4x(tl.load(Seeds + row), offs4)
    row_z = row.to(tl.int64) * stride_z
    t = tl.load(Temps + row * stride_t) if HAS_TEMP else 1.0
    key = tl.maximum(tl.maximum(_lane_key(Z, row_z, offs4, 0, u0, V, t, HAS_TEMP),
                                _lane_key(Z, row_z, offs4, 1, u1, V, t, HAS_TEMP)),
                     tl.maximum(_lane_key(Z, row_z, offs4, 2, u2, V, t, HAS_TEMP),
                                _lane_key(Z, row_z, offs4, 3, u3, V, t, HAS_TEMP)))
    tl.atomic_max(Keys + row, tl.max(key, 0), sem="acq_rel")
    # The row's last program to finish takes the row's key, writes its token and leaves key and count as found.
    if tl.atomic_add(Counts + row, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        best = tl.atomic_xchg(Keys + row, KEY_MIN, sem="acq_rel")
        tl.store(Out + row, 4294967295 - (best & 4294967295))
        tl.atomic_xchg(Counts + row, 0)


@triton.jit
def _noise_kernel(Seeds, Noise, V, stride_n, BLOCK: tl.constexpr):
    """The noise _gumbel_kernel draws, written out: u[row, i] for every token i."""
    row = tl.program_id(0)
    offs4 = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u0, u1, u2, u3 = tl.rand4x(tl.load(Seeds + row), offs4)
    base = Noise + row.to(tl.int64) * stride_n + offs4 * 4
    tl.store(base, tl.maximum(u0, 1e-20), mask=offs4 * 4 < V)
    tl.store(base + 1, tl.maximum(u1, 1e-20), mask=offs4 * 4 + 1 < V)
    tl.store(base + 2, tl.maximum(u2, 1e-20), mask=offs4 * 4 + 2 < V)
    tl.store(base + 3, tl.maximum(u3, 1e-20), mask=offs4 * 4 + 3 < V)


def _check_seeds(seeds: torch.Tensor, rows: int, device: torch.device) -> None:
    if seeds.dtype != torch.int64 or seeds.shape != (rows,) or seeds.device != device:
        raise ValueError(f"seeds must be int64 ({rows},) on {device}, got {seeds.dtype} {tuple(seeds.shape)} "
                         f"on {seeds.device}")


def new_keys(rows: int, device: torch.device) -> torch.Tensor:
    """State for `rows` rows of gumbel_argmax(keys=): each row's running key and count of finished programs
    (2, rows) int64. Each draw leaves it as it found it."""
    state = torch.zeros(2, rows, dtype=torch.int64, device=device)
    state[0] = _KEY_MIN
    return state


_states: dict[torch.device, torch.Tensor] = {}


def _state(rows: int, device: torch.device) -> torch.Tensor:
    """The device's kept state for draws outside a CUDA graph (grown as batches grow; one stream order, the
    engine's)."""
    if device not in _states or _states[device].shape[1] < rows:
        _states[device] = new_keys(max(rows, 256), device)
    return _states[device]


def gumbel_argmax(z: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
    """z (B, V) logits (-inf drops a token), seeds (B,) int64 -> (B,) int64 tokens (into `out` if given): each
    row's argmax of z / t - log(-log(u)) under its seed's noise (gumbel_noise), t the row's temperature (float32
    (B,), any stride; None: z is scaled already), a row of t == 0 the argmax of z alone. keys: a new_keys state of at least B
    rows (a CUDA graph's own; None: the device's kept one). One launch, no host sync: a CUDA graph can hold it."""
    rows, vocab = z.shape
    _check_seeds(seeds, rows, z.device)
    if temperatures is not None and (temperatures.dtype != torch.float32 or temperatures.shape != (rows,)):
        raise ValueError(f"temperatures must be float32 ({rows},), got {temperatures.dtype} "
                         f"{tuple(temperatures.shape)}")
    tokens = torch.empty(rows, dtype=torch.int64, device=z.device) if out is None else out
    if rows == 0:
        return tokens
    if z.stride(1) != 1:
        z = z.contiguous()
    state = _state(rows, z.device) if keys is None else keys
    if state.shape[0] != 2 or state.shape[1] < rows or state.dtype != torch.int64:
        raise ValueError(f"keys must be a new_keys state of at least {rows} rows, got {tuple(state.shape)}")
    _gumbel_kernel[(rows, triton.cdiv(vocab, 4 * BLOCK))](
        z, seeds, seeds if temperatures is None else temperatures, state[0], state[1], tokens, vocab, z.stride(0),
        1 if temperatures is None else temperatures.stride(0), KEY_MIN=_KEY_MIN, BLOCK=BLOCK, HAS_TEMP=temperatures is not None, num_warps=4)
    return tokens


def gumbel_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) float32: the uniform noise in [1e-20, 1) that gumbel_argmax draws for each row's seed."""
    rows = seeds.shape[0]
    _check_seeds(seeds, rows, seeds.device)
    noise = torch.empty(rows, vocab, dtype=torch.float32, device=seeds.device)
    if rows and vocab:
        _noise_kernel[(rows, triton.cdiv(vocab, 4 * BLOCK))](seeds, noise, vocab, noise.stride(0), BLOCK=BLOCK)
    return noise
