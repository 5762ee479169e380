"""Hardware profiles: the measured constants the cost model needs.

Knows: the fields of a profile (memory sizes, link and disk bandwidths, GPU
matmul and batched-matmul throughput at prefill and decode shapes, prefill
matmuls at a transformer layer's shapes by hidden size, the device's
elementwise pass rate, CPU attention and dequantization rates, host memory's
rate for the link's copies and CPU attention's reads together, the host's
time per engine step), two
presets (`flexgen-t4`, the constants FlexGen fitted for its T4 machine, and
`h200`, from the device's measured constants), measuring one on this machine
in under a minute, and caching it as JSON in the user cache folder, keyed by
machine.
Does not know: models or policies.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import psutil
import torch

from flexoff.errors import FlexoffError

GB = 1e9
UNMEASURED_ZERO = ("host_step_s", "lora_host_step_s", "packed_host_step_s", "gpu_mem_bdw", "decode_ctog_bdw",
                   "dtoc_cached_bdw", "host_read_bdw", "cpu_attn_ctog_bdw")  # fields that may be 0
# Host-side rates vary from call to call far more than the link's: on one H100 host, single
# contended CPU-attention calls took 10-39 ms where most took 10-11, and 25 profiles of one day
# (medians of three calls, measured after the engine probes and the GPU's rates) gave 18-55 GB/s while the engine's
# CPU attention ran at 34-44 GB/s on every one of those machines. So: medians of more calls, and
# the host's rates measured first (flexoff.profiler runs this before its engine probes).
CPU_ATTENTION_SAMPLES = 11
CPU_COPY_SAMPLES = 7
JOINT_READ_WINDOWS = 3


@dataclass(frozen=True)
class Hardware:
    name: str
    device: str  # the compute device: "cuda", or "cpu" on a machine without a GPU
    gpu_mem: float  # bytes of the compute device's memory
    cpu_mem: float  # bytes of host memory
    disk_mem: float  # bytes free where offloaded files go
    ctog_bdw: float  # bytes/s host -> device (pinned)
    gtoc_bdw_cache: float  # bytes/s device -> host, KV cache
    gtoc_bdw_hidden: float  # bytes/s device -> host, activations
    dtoc_bdw: float  # bytes/s disk -> host
    ctod_bdw_cache: float  # bytes/s host -> disk, KV cache
    ctod_bdw_hidden: float  # bytes/s host -> disk, activations
    mm_flops_p: float  # FLOP/s of device matmuls at prefill shapes
    mm_flops_g: float  # ... at decode shapes
    bmm_flops_p: float  # FLOP/s of device batched matmuls (attention) at prefill shapes
    bmm_flops_g: float  # ... at decode shapes
    cpu_flops: float  # FLOP/s of CPU attention (FlexGen's constant)
    cpu_attn_bdw: float  # bytes/s of KV cache that CPU attention reads
    cpu_mem_bdw: float  # bytes/s of a host memcpy, read plus write: what link copies and CPU attention share
    dequant_bdw: float  # bytes/s of dense output of 4-bit dequantization on the device
    cpu_dequant_bdw: float  # ... on the CPU (CPU attention over a compressed cache)
    host_step_s: float = 0.0  # seconds of host work per engine step (one layer of one GPU batch)
    lora_host_step_s: float = 0.0  # ... that LoRA adapters on the batch's rows add to a step
    packed_host_step_s: float = 0.0  # ... of a policy streaming 4-bit weights, rows split GPU/CPU; 0: unmeasured
    # FLOP/s of prefill matmuls at a transformer layer's shapes (its projections with biases, as the
    # engine calls them), by hidden size: ((hidden, FLOP/s), ...); empty: mm_flops_p at any size
    mm_flops_p_layers: tuple[tuple[int, float], ...] = ()
    gpu_mem_bdw: float = 0.0  # bytes/s (read plus written) of the device's elementwise passes; 0: unpriced
    # bytes/s host -> device while the link is busy in the engine's decode (its copies beside its
    # kernels and its other copies); 0: unmeasured (ctog_bdw)
    decode_ctog_bdw: float = 0.0
    # bytes/s disk -> host of a file the page cache holds (read again just after it was read);
    # 0: unmeasured (dtoc_bdw)
    dtoc_cached_bdw: float = 0.0
    # bytes/s host memory serves the link's copies and CPU attention's reads together, both
    # streaming at once; 0: unmeasured (the cost model's estimate from cpu_mem_bdw)
    host_read_bdw: float = 0.0
    # bytes/s host -> device of those copies with CPU attention reading beside them (the same
    # windows); 0: unmeasured (as fast as alone)
    cpu_attn_ctog_bdw: float = 0.0
    # machine_key() of the machine measured ("": unknown, a preset or an older profile): the
    # engine's own rates calibrate only a profile of the machine they were measured on
    machine: str = ""

    def step_host_s(self, compress_weight: bool) -> float:
        """Seconds of host work per engine step of a policy with or without 4-bit weights (a
        packed layer's matmuls are Triton launches, each with more host work than torch's; a
        profile without the packed measurement prices both alike)."""
        return self.packed_host_step_s if compress_weight and self.packed_host_step_s else self.host_step_s

    def decode_link_bdw(self, cpu_attention: bool = False) -> float:
        """Bytes/s of host-to-device copies in decode: the rate the engine's own decode moved them
        at where the profile measured it (on H100 machines 49-54 GB/s against 54-55 for one copy
        alone on an idle device; benchmarks/RESULTS.md), else ctog_bdw. With `cpu_attention`,
        slowed as the profile measured copies slow with CPU attention beside them (on an H100
        host 50.4 GB/s against 54.0 alone, where the engine's CPU-attention decodes moved them
        at 48.2-51.7)."""
        rate = self.decode_ctog_bdw or self.ctog_bdw
        return rate * self.ctog_beside_cpu_attention() / self.ctog_bdw if cpu_attention else rate

    def ctog_beside_cpu_attention(self) -> float:
        """Bytes/s of host-to-device copies with CPU attention reading host memory beside them:
        cpu_attn_ctog_bdw, never above ctog_bdw (as fast as alone where unmeasured)."""
        return min(self.cpu_attn_ctog_bdw or self.ctog_bdw, self.ctog_bdw)

    def page_cache_faster(self) -> bool:
        """Whether the profile measured the page cache reading faster than the disk: the engine's
        files are read through it, so a disk tier that fits the host memory the process leaves is
        read at memory speed (2.6-3.5 GB/s in OPT-30B's decode on H100 hosts against 1.3-1.4
        cold; benchmarks/RESULTS.md)."""
        return self.dtoc_cached_bdw > self.dtoc_bdw

    def disk_read_bdw(self, cached: bool) -> float:
        """Bytes/s of disk reads: from files the page cache holds (`cached`) where it is faster,
        else from the device (dtoc_bdw)."""
        return self.dtoc_cached_bdw if cached and self.page_cache_faster() else self.dtoc_bdw

    def prefill_mm_flops(self, hidden: int) -> float:
        """FLOP/s of prefill matmuls for a model of this hidden size: the rate measured at the
        nearest hidden size of mm_flops_p_layers (GEMM efficiency depends on the shapes: on the
        H200, 759 TFLOP/s at hidden 4096 and 667 at 7168, 16,384 rows), else mm_flops_p."""
        if not self.mm_flops_p_layers:
            return self.mm_flops_p
        return min(self.mm_flops_p_layers, key=lambda e: abs(math.log(e[0] / hidden)))[1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Hardware":
        if not isinstance(d, dict):
            raise FlexoffError("a hardware profile must be a JSON object; run `flexoff profile` again")
        known = {f.name for f in fields(cls)}
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = sorted(known - optional - set(d))
        if missing:
            raise FlexoffError(f"hardware profile lacks {', '.join(missing)}; run `flexoff profile` again")
        d = dict(d)
        table = d.get("mm_flops_p_layers", ())
        if not (isinstance(table, (list, tuple)) and all(
                isinstance(e, (list, tuple)) and len(e) == 2 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in e)
                for e in table)):
            raise FlexoffError(f"hardware profile: mm_flops_p_layers is {table!r}; run `flexoff profile` again")
        d["mm_flops_p_layers"] = tuple((int(h), float(f)) for h, f in table)
        for f in fields(cls):
            v = d.get(f.name)
            if f.name == "mm_flops_p_layers":
                continue
            if f.name in ("name", "device", "machine"):
                ok = isinstance(v, str) and (f.name != "device" or v in ("cuda", "cpu")) \
                    or v is None and f.name == "machine"
            else:  # rates and sizes: finite, positive (the host steps may be 0)
                ok = v is None and f.name in optional or isinstance(v, (int, float)) and not isinstance(v, bool) \
                    and math.isfinite(v) and (v > 0 or f.name in UNMEASURED_ZERO and v == 0)
            if not ok:
                raise FlexoffError(f"hardware profile: {f.name} is {v!r}; run `flexoff profile` again")
        return cls(**{k: d[k] for k in known if k in d})


def flexgen_t4() -> Hardware:
    """FlexGen's fitted T4 constants (16 GB GPU, 208 GB CPU, 1.5 TB disk). FlexGen prices CPU
    attention by FLOPs; its fp16 KV cache is one byte per FLOP of attention, so cpu_attn_bdw equals
    cpu_flops. FlexGen gives no dequantization rate or host memory bandwidth; ours are estimates
    (a third of the T4's 320 GB/s, and 50 GB/s of DDR4)."""
    return Hardware("flexgen-t4", "cuda", gpu_mem=16 * GB, cpu_mem=208 * GB, disk_mem=1.5e12,
                    ctog_bdw=12.89 * GB, gtoc_bdw_cache=0.97 * GB, gtoc_bdw_hidden=4.82 * GB,
                    dtoc_bdw=0.473 * GB, ctod_bdw_cache=0.746 * GB, ctod_bdw_hidden=2.015 * GB,
                    mm_flops_p=21.24e12, mm_flops_g=4.3e12, bmm_flops_p=9.97e12, bmm_flops_g=0.079e12,
                    cpu_flops=0.0123e12, cpu_attn_bdw=0.0123e12, cpu_mem_bdw=50 * GB, dequant_bdw=100 * GB,
                    cpu_dequant_bdw=2 * GB)


def h200() -> Hardware:
    """The H200 device machine, from ../shared/hardware/nvidia-h200.json (decode matmul from its
    64-row GEMM; decode attention is bound by HBM bandwidth, one FLOP per byte of fp16 cache)."""
    return Hardware("h200", "cuda", gpu_mem=139.8 * 2**30, cpu_mem=125.9 * 2**30, disk_mem=66.5 * GB,
                    ctog_bdw=55.5 * GB, gtoc_bdw_cache=55.4 * GB, gtoc_bdw_hidden=55.4 * GB,
                    dtoc_bdw=2.43 * GB, ctod_bdw_cache=1.58 * GB, ctod_bdw_hidden=1.58 * GB,
                    mm_flops_p=758e12, mm_flops_g=257e12, bmm_flops_p=300e12, bmm_flops_g=4.2e12,
                    cpu_flops=1.35e12, cpu_attn_bdw=139.8 * GB, cpu_mem_bdw=118.2 * GB, dequant_bdw=1500 * GB,
                    cpu_dequant_bdw=10 * GB)


PRESETS: dict[str, Callable[[], Hardware]] = {"flexgen-t4": flexgen_t4, "h200": h200}


def machine_key() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    raw = f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|{gpu}|{torch.__version__}"
    return hashlib.sha1(raw.encode()).hexdigest()[:12]


def cache_path() -> Path:
    from flexoff.checkpoint import cache_dir

    return cache_dir() / "hardware" / f"{machine_key()}.json"


def load(name_or_path: str | None, offload_dir: str | None = None, log: Callable[[str], None] | None = None,
         measure_machine: Callable[[str | None], Hardware] | None = None) -> Hardware:
    """A preset by name, a profile file, or (None) this machine's cached profile, measured if absent
    (by `measure_machine`, which adds what only the engine can measure: flexoff.profiler). A
    profile of this machine is priced with the rates the engine measured here
    (policy.calibration)."""
    from flexoff.policy.calibration import calibrated

    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    if name_or_path is not None:
        try:
            hw = Hardware.from_dict(json.loads(Path(name_or_path).read_text()))
        except OSError as e:
            raise FlexoffError(f"cannot read hardware profile {name_or_path}: {e.strerror}; "
                               f"presets: {', '.join(PRESETS)}") from None
        except json.JSONDecodeError as e:
            raise FlexoffError(f"hardware profile {name_or_path} is not valid JSON: {e.msg}") from None
        return calibrated(hw, log=log)
    path = cache_path()
    if path.exists():
        return calibrated(Hardware.from_dict(json.loads(path.read_text())), log=log)
    if log:
        log("measuring this machine once (flexoff profile); cached in " + str(path))
    hw = (measure_machine or measure)(offload_dir)
    save(hw, path)
    return hw


def save(hw: Hardware, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(hw.to_json() + "\n")
    tmp.replace(path)


# ---- measuring -------------------------------------------------------------
def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeat: int = 5) -> float:
    """Median seconds of fn after a warm-up."""
    return _median(_samples(fn, sync, repeat))


def _samples(fn: Callable[[], Any], sync: Callable[[], None], repeat: int) -> list[float]:
    """Seconds of each of `repeat` calls of fn after a warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _median(samples: Iterable[float]) -> float:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2]


def measure(offload_dir: str | None = None, size: int = 512 << 20, quick: bool = False) -> Hardware:
    """Measure this machine's links, GPU, CPU and disk (not the engine's host time per step,
    which flexoff.profiler adds). On a CPU-only machine the compute device is the CPU. `quick`
    measures small shapes only (seconds, for smoke tests; less accurate)."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    if not cuda or quick:
        size = min(size, (16 if quick else 128) << 20)
    call = _attention_call(quick)  # one cache for both host measurements
    cpu_attn, cpu_flops = _cpu_attention(quick, call)  # the host's rates before anything else has run
    joint, joint_link = joint_rates(joint_read_samples(quick, call=call))
    cpu_mem = host_copy_bandwidth(size)[0]
    deq, cpu_deq = _dequant(dev, quick)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    devbuf = torch.empty(size, dtype=torch.uint8, device=dev)
    host.fill_(1)
    devbuf.fill_(2)
    ctog = size / _timed(lambda: devbuf.copy_(host, non_blocking=True), sync)
    gtoc = size / _timed(lambda: host.copy_(devbuf, non_blocking=True), sync)
    dread, dcached, dwrite = _disk(offload_dir, host[: min(size, 256 << 20)])

    def mm(m: int, k: int, n: int) -> float:
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        return 2 * m * k * n / _timed(lambda: a @ b, sync)

    def bmm(b: int, m: int, k: int, n: int) -> float:
        x = torch.randn(b, m, k, device=dev, dtype=dtype)
        y = torch.randn(b, k, n, device=dev, dtype=dtype)
        return 2 * b * m * k * n / _timed(lambda: torch.bmm(x, y), sync)

    h = 4096 if cuda and not quick else (1024 if not quick else 256)
    mm_p, mm_g = mm(2048, h, 4 * h), mm(32, h, 4 * h)
    hiddens = (4096, 5120, 7168, 8192) if cuda and not quick else ((512, 1024) if not quick else (128,))
    layers = tuple((hd, _layer_mm(dev, dtype, hd, 16384 if cuda and not quick else 256, sync)) for hd in hiddens)
    bmm_p, bmm_g = (bmm(64, 512, 128, 512), bmm(1024, 1, 128, 1024)) if not quick else \
        (bmm(8, 64, 64, 64), bmm(64, 1, 64, 256))
    disk_free = shutil.disk_usage(offload_dir or tempfile.gettempdir()).free
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if cuda else psutil.virtual_memory().total
    return Hardware(f"measured:{platform.node()}", dev.type, gpu_mem=float(gpu_mem),
                    cpu_mem=float(psutil.virtual_memory().total), disk_mem=float(disk_free),
                    ctog_bdw=ctog, gtoc_bdw_cache=gtoc, gtoc_bdw_hidden=gtoc, dtoc_bdw=dread, dtoc_cached_bdw=dcached,
                    ctod_bdw_cache=dwrite, ctod_bdw_hidden=dwrite, mm_flops_p=mm_p, mm_flops_g=mm_g,
                    bmm_flops_p=bmm_p, bmm_flops_g=bmm_g, cpu_flops=cpu_flops, cpu_attn_bdw=cpu_attn,
                    cpu_mem_bdw=cpu_mem, dequant_bdw=deq, cpu_dequant_bdw=cpu_deq, mm_flops_p_layers=layers,
                    gpu_mem_bdw=_elementwise(dev, dtype, sync, quick), host_read_bdw=joint,
                    cpu_attn_ctog_bdw=joint_link, machine=machine_key())


def layer_projections(h: int) -> tuple[tuple[str, int, int], ...]:
    """A transformer layer's projections at hidden size h, as (name, out, in): q, k and v
    together, the output, the MLP's up (4h) and down."""
    return (("qkv", 3 * h, h), ("o", h, h), ("up", 4 * h, h), ("down", h, 4 * h))


def _layer_mm(dev: torch.device, dtype: torch.dtype, h: int, rows: int, sync: Callable[[], None]) -> float:
    """FLOP/s over a transformer layer's projections at prefill shapes, as the engine calls them
    (F.linear with a bias), on `rows` tokens; total FLOPs over total seconds."""
    x = {k: torch.randn(rows, k, device=dev, dtype=dtype) for k in (h, 4 * h)}
    flops = secs = 0.0
    for _, n, k in layer_projections(h):
        w, b = torch.randn(n, k, device=dev, dtype=dtype), torch.randn(n, device=dev, dtype=dtype)
        secs += _timed(lambda: torch.nn.functional.linear(x[k], w, b), sync)
        flops += 2 * rows * n * k
    return flops / secs


def elementwise_passes(x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple[Callable[[], Any], int]]:
    """The kinds of elementwise pass a layer's prefill makes (ModelSpec.elementwise_bytes), over
    x and y (tokens, h), tokens a multiple of 512 and h of 128: each one's call, and how many
    tensors of x's size it reads plus writes."""
    h = x.shape[-1]
    wn, bn = torch.ones(h, device=x.device, dtype=x.dtype), torch.zeros(h, device=x.device, dtype=x.dtype)
    heads = x.view(-1, 512, h // 128, 128)
    return {"layer_norm": (lambda: torch.nn.functional.layer_norm(x, (h,), wn, bn), 2),
            "add": (lambda: torch.add(x, y), 3), "relu_": (lambda: y.relu_(), 2),
            "heads moved (transposed copy)": (lambda: heads.transpose(1, 2).contiguous(), 2)}


def _elementwise(dev: torch.device, dtype: torch.dtype, sync: Callable[[], None], quick: bool) -> float:
    """Bytes/s (read plus written) of a layer's kinds of elementwise pass, one of each, over
    activations past the device's caches."""
    tokens, h = (16384, 4096) if dev.type == "cuda" and not quick else (512, 256)
    x, y = torch.randn(tokens, h, device=dev, dtype=dtype), torch.randn(tokens, h, device=dev, dtype=dtype)
    passes = elementwise_passes(x, y).values()
    secs = sum(_timed(fn, sync) for fn, _ in passes)
    return sum(k for _, k in passes) * x.numel() * x.element_size() / secs


def host_copy_bandwidth(nbytes: int) -> tuple[float, float]:
    """Bytes/s of a host memcpy of nbytes (read plus written), and the seconds one copy takes
    (the median of CPU_COPY_SAMPLES)."""
    s = _median(host_copy_samples(nbytes))
    return 2 * (nbytes // 4 * 4) / s, s


def host_copy_samples(nbytes: int, repeat: int = CPU_COPY_SAMPLES) -> list[float]:
    """Seconds of each of `repeat` host memcpys of nbytes, after a warm-up."""
    big = torch.empty(nbytes // 4, dtype=torch.float32)
    big.fill_(1.0)
    other = torch.empty_like(big)
    return _samples(lambda: other.copy_(big), lambda: None, repeat)


def _disk(offload_dir: str | None, buf: torch.Tensor) -> tuple[float, float, float]:
    """Write then read a file in the offload folder, dropping it from the page cache between, then
    read it again from the page cache: (cold read, cached read, write) bytes/s."""
    root = Path(offload_dir or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="flexoff-profile-", dir=root)
    try:
        view = memoryview(buf.numpy())
        t0 = time.perf_counter()
        os.pwrite(fd, view, 0)
        os.fsync(fd)
        write = len(view) / (time.perf_counter() - t0)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        reads = []
        for _ in range(2):  # the first from the device, the second from the page cache
            t0 = time.perf_counter()
            os.preadv(fd, [view], 0)
            reads.append(len(view) / (time.perf_counter() - t0))
        return reads[0], reads[1], write
    finally:
        os.close(fd)
        os.unlink(path)


def _cpu_attention(quick: bool = False, call: AttentionCall | None = None) -> tuple[float, float]:
    """KV bytes/s and FLOP/s of decode attention on the CPU: cpu_attention_samples' median call."""
    kv_bytes, flops, secs = cpu_attention_samples(quick, call=call)
    t = _median(secs)
    return kv_bytes / t, flops / t


AttentionCall = tuple[Callable[[], Any], int, int]  # a call of CPU decode attention, its KV bytes and FLOPs


def _attention_call(quick: bool = False) -> AttentionCall:
    """One call of decode attention on the CPU (attention_call_over) over a cache from `randn`, at
    a size well past the CPU caches: 32 rows (8 on a CPU machine) of 32 heads of 128 over 1024
    positions, fp16 beside a GPU (float32 without); small shapes when `quick`."""
    b, heads, d, s = (32, 32, 128, 1024) if not quick else (4, 8, 64, 128)
    cuda = torch.cuda.is_available()
    if not cuda and not quick:
        b = 8
    return attention_call_over(torch.randn(2, b, heads, s - 1, d, dtype=torch.float16 if cuda else torch.float32))


def attention_call_over(kv: torch.Tensor) -> AttentionCall:
    """One call of decode attention on the CPU through the engine's call (attend_cached: the
    compiled kernel where it builds) over head-major rows: `kv`'s prompt area (K and V, shaped
    (2, rows, heads, positions, head width)) and one generated position; with its KV bytes and
    FLOPs."""
    from flexoff.models.attention import attend_cached

    _, b, heads, s1, d = kv.shape
    s, dtype = s1 + 1, kv.dtype
    gen = torch.zeros(2, b, heads, 1, d, dtype=dtype)
    q = torch.randn(b, heads, 1, d, dtype=dtype)
    mask = torch.ones(b, 1, s, dtype=torch.bool)
    fn = lambda: attend_cached(q, (kv[0], kv[1]), (gen[0], gen[1]), (q, q), 0, mask, d**-0.5)  # noqa: E731
    return fn, 2 * b * heads * s * d * dtype.itemsize, 4 * b * heads * d * s


@contextmanager
def _engine_threads() -> Iterator[None]:
    """torch's CPU threads set to as many as the engine's CPU attention uses, for the block."""
    from flexoff.kernels.cpu_attention import cpu_attention_threads

    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_attention_threads())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cpu_attention_samples(quick: bool = False, repeat: int = CPU_ATTENTION_SAMPLES,
                          call: AttentionCall | None = None) -> tuple[int, int, list[float]]:
    """The KV bytes and FLOPs of one call of decode attention on the CPU (`call`, else
    _attention_call's). On a GPU machine it runs on the engine's CPU-attention threads and is timed
    while host-to-device copies stream, as in offloaded decoding, where weight transfers and CPU
    attention share host memory bandwidth (on an H200 host this halved torch's rate: 60.7 GB/s
    alone, 31.7 GB/s in the engine), and the seconds of each of `repeat` calls after a warm-up."""
    fn, kv_bytes, flops = call or _attention_call(quick)
    if torch.cuda.is_available() and not quick:
        src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()

        def contended() -> float:
            """One call's seconds while ~0.3 s of copies stream (longer than the call)."""
            with torch.cuda.stream(side):
                for _ in range(64):
                    dst.copy_(src, non_blocking=True)
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
            side.synchronize()
            return t

        with _engine_threads():
            fn()  # warm (and build the kernel)
            secs = [contended() for _ in range(repeat)]
    else:
        secs = _samples(fn, lambda: None, repeat)
    return kv_bytes, flops, secs


def joint_read_samples(quick: bool = False, windows: int = JOINT_READ_WINDOWS,
                       call: AttentionCall | None = None) -> list[tuple[float, float]]:
    """Host memory read by the link and by CPU attention at once, as in an offloaded decode whose
    link and CPU-attention lane are both busy: calls of decode attention (`call`, else
    _attention_call's, on the engine's threads) run back to back while 64 MiB host-to-device copies
    out of a 1 GiB pinned buffer stream for about 0.3 s. Over the host-timed span of the calls that
    end before the copies do, (the copies' bytes/s, the calls' bytes/s): the copies counted are
    those whose event completed within the span. One pair per window; none without CUDA, or with
    `quick`."""
    if quick or not torch.cuda.is_available():
        return []
    fn, kv_bytes, _ = call or _attention_call(quick)
    chunk, chunks, copies = 64 << 20, 16, 256
    src = torch.empty(chunk * chunks, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    out = []
    with _engine_threads():
        fn()  # warm (and build the kernel)
        for _ in range(windows):
            done = [torch.cuda.Event() for _ in range(copies)]
            with torch.cuda.stream(side):
                for i, ev in enumerate(done):
                    dst.copy_(src[(i % chunks) * chunk:(i % chunks + 1) * chunk], non_blocking=True)
                    ev.record()
            finished = 0

            def count() -> int:
                nonlocal finished
                while finished < copies and done[finished].query():
                    finished += 1
                return finished

            t0, first, calls, t1, last = time.perf_counter(), count(), 0, 0.0, 0
            while True:
                fn()
                t, n = time.perf_counter(), count()
                if n == copies:  # the copies ended during this call
                    break
                calls, t1, last = calls + 1, t, n
            side.synchronize()
            if calls and last > first:
                out.append(((last - first) * chunk / (t1 - t0), calls * kv_bytes / (t1 - t0)))
    return out


def joint_rates(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Bytes/s host memory serves the link and CPU attention together, and the link's share of
    it: the medians over joint_read_samples' windows; (0.0, 0.0) where unmeasured (none)."""
    if not samples:
        return 0.0, 0.0
    return _median(a + b for a, b in samples), _median(a for a, _ in samples)


def _dequant(dev: torch.device, quick: bool = False) -> tuple[float, float]:
    """Dense bytes/s of 4-bit dequantization on the device and on the CPU."""
    from flexoff.kernels.quant import dequantize_rows as fast
    from flexoff.quant.format import QuantConfig, dequantize_rows, quantize

    cfg = QuantConfig(4, 64)
    out = []
    big, small = (8192, 1024) if not quick else (64, 64)
    for device, fn, rows in ((dev, fast, big), (torch.device("cpu"), dequantize_rows, small)):
        c = quantize(torch.randn(rows, 4096, device=device), cfg)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        t = _timed(lambda: fn(c.data, c.scale, c.mn, cfg, dtype), sync, repeat=3)
        out.append(rows * 4096 * dtype.itemsize / t)
    return out[0], out[1]
