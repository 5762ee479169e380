"""Decode attention on the CPU over a two-area KV cache: a compiled kernel, built on first use,
beside the torch reference (flexoff.models.attention.attend_cached's math) behind one dispatch.

Knows: how to build `cpu_attention.cpp` with torch's C++ extension tooling (once per machine,
CPU and torch version, cached under flexoff's cache directory; a build killed half-way does not
block the next) and when to fall back to torch.
The kernel reads each kv head's keys and values once for all the query heads that share it,
converting 16-bit values to float32 in registers; torch's batched matmuls over the same views
read the cache at well under the host's memory rate at decode's small batches (measured in
benchmarks/cpu_attention.py).
Does not know: where the cache lives or how its areas are laid out in a buffer.

FLEXOFF_CPU_KERNEL=0 turns the kernel off (the torch path runs), for comparisons.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# -fopenmp: at::parallel_for is inline OpenMP code, a loop on one thread without it (measured: 5 GB/s
# against torch's 23 on the H200 host). Nothing is linked for it: the OpenMP calls resolve to the
# runtime torch has loaded, so torch.set_num_threads sets the kernel's threads too.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once a build was tried; "error": its message


def _cpu_key() -> str:
    """What a -march=native build depends on: this CPU's model and flags, torch, the source."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = "".join(line for line in f if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        cpu = platform.processor()
    raw = "|".join([platform.machine(), cpu, torch.__version__, SOURCE.read_text(), *CFLAGS])
    return hashlib.sha1(raw.encode()).hexdigest()[:12]


def build(verbose: bool = False) -> bool:
    """Build and load the kernel if not done yet; False (with the reason in `error()`) when it
    cannot be built here: no C++ compiler, no ninja, or a failed compile."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        try:
            from torch.utils import cpp_extension

            from flexoff.checkpoint import cache_dir

            where = cache_dir() / "kernels" / f"cpu-attention-{_cpu_key()}"
            where.mkdir(parents=True, exist_ok=True)
            with open(where / "build.flock", "a") as held:
                # one build at a time across processes; the OS lets go of a killed process's
                # lock, where torch's lock file stays and every later load waits on it forever
                fcntl.flock(held, fcntl.LOCK_EX)
                (where / "lock").unlink(missing_ok=True)
                cpp_extension.load(name="flexoff_cpu_attention", sources=[str(SOURCE)], build_directory=str(where),
                                   extra_cflags=list(CFLAGS), is_python_module=False, verbose=verbose)
            _state["ok"] = True
        except Exception as exc:  # noqa: BLE001 - any failure means: use the torch path
            last = (str(exc).strip().splitlines() or [""])[-1]  # a compiler's last line says most
            _state["ok"], _state["error"] = False, f"{type(exc).__name__}: {last}"
            warnings.warn(f"flexoff: CPU attention kernel not built ({_state['error']}); "
                          "using torch's matmuls (slower)", RuntimeWarning, stacklevel=2)
        return bool(_state["ok"])


def error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def enabled() -> bool:
    """The kernel is wanted (FLEXOFF_CPU_KERNEL is not 0) and builds here."""
    return os.environ.get("FLEXOFF_CPU_KERNEL", "1") != "0" and build()


def fits(q: torch.Tensor, kp: torch.Tensor, kg: torch.Tensor) -> bool:
    """Shapes and layouts the kernel takes: one query token, rows contiguous, 16/32-bit floats."""
    return (q.shape[2] == 1 and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and kp.dtype == q.dtype and kg.dtype == q.dtype and kp.stride(-1) == 1 and kg.stride(-1) == 1
            and q.shape[1] % kp.shape[1] == 0)


def decode_attention(q: torch.Tensor, prompt: tuple[torch.Tensor, torch.Tensor],
                     generated: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, scale: float,
                     simd: bool = True) -> torch.Tensor:
    """The kernel: q (b, heads, 1, d) over the prompt area's keys and values (b, kv_heads, s, d)
    then the generated area's (b, kv_heads, n, d); mask (b, 1, >= s + n) bool. Returns
    (b, heads, 1, d). simd=False runs its plain C++ loops (tests compare both)."""
    if not build():
        raise RuntimeError(f"flexoff's CPU attention kernel is not built: {error()}")
    b, nh, _, d = q.shape
    m = mask.reshape(b, mask.shape[-1])
    if m.stride(-1) != 1:
        m = m.contiguous()
    out = torch.ops.flexoff.cpu_decode_attention(q.reshape(b, nh, d), *prompt, *generated, m, scale, simd)
    return out.view(b, nh, 1, d)


def cpu_attention_threads() -> int:
    """Threads CPU attention computes with next to a GPU: FLEXOFF_CPU_THREADS, or three quarters
    of torch's threads, leaving cores to the threads that drive the GPU (an OpenMP team that
    shares a core with them waits for its slowest member at every operation)."""
    env = os.environ.get("FLEXOFF_CPU_THREADS")
    return max(1, int(env) if env else torch.get_num_threads() * 3 // 4)


def simd() -> bool:
    """Whether the built kernel has its AVX-512 path (else it runs plain loops)."""
    return build() and bool(torch.ops.flexoff.cpu_kernel_simd())
