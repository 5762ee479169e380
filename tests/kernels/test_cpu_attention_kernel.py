"""The compiled CPU decode-attention kernel (both its AVX-512 and its plain loops) and its torch
reference against brute-force float64 attention, over shapes the engine meets and odd ones."""

import pytest
import torch

from flexoff.kernels import cpu_attention as ck
from flexoff.models.attention import attend_two_areas
from reference import brute_force

PATHS = ["torch", "kernel", "kernel-plain"]


def run(path, q, prompt, generated, mask, scale):
    if path == "torch":
        return attend_two_areas(q, prompt, generated, mask, scale)
    if not ck.build():
        pytest.skip(f"the CPU kernel does not build here: {ck.error()}")
    return ck.decode_attention(q, prompt, generated, mask, scale, simd=path == "kernel")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("b,nh,kvh,d,s,n", [(3, 8, 2, 16, 7, 3), (2, 4, 4, 128, 40, 1), (2, 6, 3, 80, 19, 6),
                                             (1, 3, 1, 8, 1, 1)])
def test_matches_brute_force(path, dtype, tol, b, nh, kvh, d, s, n):
    g = torch.Generator().manual_seed(b * 1000 + d)
    q = torch.randn(b, nh, 1, d, generator=g).to(dtype)
    # the engine's areas: views into larger buffers (the generated area holds more tokens than used)
    kp, vp = torch.randn(2, b, kvh, s, d, generator=g).to(dtype)
    kg, vg = torch.randn(2, b, kvh, n + 4, d, generator=g).to(dtype)
    kg, vg = kg[:, :, :n], vg[:, :, :n]
    mask = torch.rand(b, 1, s + n, generator=g) > 0.3
    mask[:, :, -1] = True  # the new token is always visible
    if b > 1:
        mask[1, 0, :s // 2] = False  # left padding
    out = run(path, q, (kp, vp), (kg, vg), mask, d ** -0.5)
    ref = brute_force(q.double(), torch.cat([kp, kg], 2).double(), torch.cat([vp, vg], 2).double(), mask, d ** -0.5)
    assert out.dtype == dtype and out.shape == (b, nh, 1, d)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_rejects_mismatched_inputs():
    if not ck.build():
        pytest.skip(f"the CPU kernel does not build here: {ck.error()}")
    q = torch.randn(2, 4, 1, 16)
    kp, vp = torch.randn(2, 2, 2, 5, 16)
    kg, vg = torch.randn(2, 2, 2, 1, 16)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        ck.decode_attention(q, (kp.half(), vp.half()), (kg.half(), vg.half()), mask, 0.25)
    with pytest.raises(RuntimeError, match="mask"):
        ck.decode_attention(q, (kp, vp), (kg, vg), mask[:, :, :4], 0.25)


def test_a_failed_build_warns_once_and_torch_runs(monkeypatch):
    """No compiler (the build raises): one warning, and attend_cached still gives the right
    attention through torch's matmuls."""
    from torch.utils import cpp_extension

    from flexoff.models.attention import attend_cached

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(ck, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    q = torch.randn(2, 4, 1, 16)
    kp, vp = torch.randn(2, 2, 2, 5, 16)
    kg, vg = torch.zeros(2, 2, 2, 3, 16)
    new = torch.randn(2, 2, 2, 1, 16)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    with pytest.warns(RuntimeWarning, match="Ninja is required") as caught:
        out = attend_cached(q, (kp, vp), (kg, vg), (new[0], new[1]), 0, mask, 0.25)
        attend_cached(q, (kp, vp), (kg, vg), (new[0], new[1]), 0, mask, 0.25)
    assert len([w for w in caught if "CPU attention kernel" in str(w.message)]) == 1
    assert not ck.enabled() and "Ninja" in ck.error()
    ref = brute_force(q.double(), torch.cat([kp, kg[:, :, :1]], 2).double(), torch.cat([vp, vg[:, :, :1]], 2).double(),
                      mask, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_killed_build_does_not_block_the_next(monkeypatch, tmp_path):
    """A process killed while building leaves torch's lock file in the build folder, and torch's
    loader waits on it forever: the next build goes on (its load sees no lock)."""
    import os

    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    seen = []

    def load(name, sources, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, "lock"))  # as torch's loader takes it
        seen.append(baton.try_acquire())
        baton.release()

    monkeypatch.setenv("FLEXOFF_CACHE", str(tmp_path))
    monkeypatch.setattr(ck, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", load)
    where = tmp_path / "kernels" / f"cpu-attention-{ck._cpu_key()}"
    where.mkdir(parents=True)
    (where / "lock").touch()  # left by the killed build
    assert ck.build() and seen == [True]
