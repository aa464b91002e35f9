"""The CPU decode-row kernels (kernels/cpu/row_decode.cpp): built once per machine, loaded as torch ops.

    ops = load()          # torch.ops.deepinfer_cpu, or None where it cannot be built (no C++ compiler, no ninja)
    ops.gemv(x, w, bf16_out)
    ops.decode_layer(x, residual, first, in_norm, post_norm, qkv_w, o_w, gate_up_w, down_w, cos, signed_sin,
                     k_cache, v_cache, slots, slot_starts, out_slots, num_q, num_kv, eps, scale)
    ops.q4_gemv(x, codes, d, c, bf16_out)      # Q4_1 weights in layers/q4.kernel_rows' form
    ops.int8_gemv(x, q, scale, bf16_out)       # per-row int8 weights (layers/int8.py)
    ops.decode_layer_q(...)                    # decode_layer, each weight [codes, d, c] or [q, scale]

The source is compiled with torch's C++ extension builder (a C++ compiler and ninja; about half a minute on two
cores) into `build_dir` (DEEPINFER_CACHE/torch_extensions by default), once per source version: a later process
loads the library it finds there. Its threads are torch's (at::parallel_for), so torch.set_num_threads applies.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger("deepinfer_rt")

SOURCE = Path(__file__).parent / "cpu" / "row_decode.cpp"

_lock = threading.Lock()
_state: dict[str, object] = {}


def load(build_dir: str | os.PathLike | None = None):
    """torch.ops.deepinfer_cpu with the kernels registered, or None (with the reason in `error()`) where they
    cannot be built here. Tries once per process."""
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        _state["ops"] = None
        try:
            from torch.utils import cpp_extension

            _ninja_on_path()

            source = SOURCE.read_bytes()
            name = "deepinfer_cpu_row_" + hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:12]
            if build_dir is None:
                from deepinfer_rt.env import get_env

                build_dir = get_env().cache_dir / "torch_extensions"
            library = Path(build_dir) / f"{name}.so"
            if not library.exists():  # else built by an earlier process: no compiler needed
                build = Path(build_dir) / f"{name}.build"  # torch's builder locks it against concurrent builds
                build.mkdir(parents=True, exist_ok=True)
                cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build),
                                   extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                   is_python_module=False, verbose=False)
                # published whole (a rename), so that a process that finds it never reads a half-written file
                partial = library.with_suffix(f".{os.getpid()}.partial")
                shutil.copyfile(build / f"{name}.so", partial)
                os.replace(partial, library)
            if not hasattr(torch.ops.deepinfer_cpu, "decode_layer"):  # cpp_extension.load has loaded it already
                torch.ops.load_library(str(library))
            _state["ops"] = torch.ops.deepinfer_cpu
        except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, a failed build: the callers fall back
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            logger.warning("the lone-row CPU kernels are unavailable (%s); the step uses torch's products",
                           _state["error"])
        return _state["ops"]


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; PyPI's ninja (a dependency) may sit in a directory PATH lacks (a
    virtualenv used without activating it): add that directory."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def error() -> str | None:
    """Why `load` returned None (after it did)."""
    return _state.get("error")  # type: ignore[return-value]
