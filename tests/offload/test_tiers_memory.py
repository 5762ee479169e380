"""Tiers, placement arithmetic, memory accounting and budgets, the offload folder, the schedule."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexoff import LLM, Policy
from flexoff.errors import MemoryBudgetError
from flexoff.offload.activations import HiddenStore
from flexoff.offload.engine import Engine
from flexoff.offload.placement import row_segments, row_split
from flexoff.offload.schedule import Step, block_plan, forward_sweeps
from flexoff.offload.tiers import Budgets, MemTier
from flexoff.policy.policy import ACT_LOAD_SLOTS
from reference import PROMPTS

DISK = Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=0,
              cache_gpu_percent=0, cache_cpu_percent=0, act_gpu_percent=0, act_cpu_percent=50)


def zigzag(gen_len: int, layers: int, batches: int, early=()):
    """The inference plan's (step, next step) pairs."""
    return [(p.step, p.next) for p in block_plan(forward_sweeps(gen_len), layers, batches, early=early)]


def test_zigzag_order_and_lookahead():
    steps = zigzag(2, 3, 2)
    order = [Step(i, j, k) for i in range(2) for j in range(3) for k in range(2)]
    assert [s for s, _ in steps] == order
    assert [n for _, n in steps] == order[1:] + [None]
    stages = [p.stage for p in block_plan(forward_sweeps(2), 3, 2, ahead=1)]
    # layer j's batch 0 starts loading layer j + 1, wrapping to the next token step's layer 0
    assert stages == [(1,), (), (2,), (), (0,), (), (1,), (), (2,), (), (), ()]


def test_zigzag_early_layers_start_before_the_layer_before_ends_in_decode():
    steps = [s for s, _ in zigzag(2, 4, 3, early=[2])]
    zz = [Step(i, j, k) for i in range(2) for j in range(4) for k in range(3)]
    want = zz[:12] + zz[12:17] + [Step(1, 2, 0), Step(1, 1, 2)] + zz[19:]  # the prefill keeps zig-zag order
    assert steps == want
    for i in (0, 1):  # each square once, and each batch's layers in order
        mine = [s for s in steps if s.i == i]
        assert sorted(mine) == sorted(s for s in zz if s.i == i)
        for k in range(3):
            assert [s.j for s in mine if s.k == k] == list(range(4))
    assert [s for s, _ in zigzag(2, 4, 1, early=[2])] == [Step(i, j, 0) for i in range(2) for j in range(4)]


def test_row_split_fills_fast_tiers_first():
    assert row_split(4, 30, 40) == {"gpu": 1, "cpu": 2, "disk": 1}
    assert row_split(3, 0, 100) == {"gpu": 0, "cpu": 3, "disk": 0}
    assert row_segments(2, row_split(4, 30, 40)) == [("gpu", 0, 1), ("cpu", 1, 2)]
    assert row_segments(4, row_split(4, 30, 40)) == [("gpu", 0, 1), ("cpu", 1, 3), ("disk", 3, 4)]


def _engine(llm: LLM, policy: Policy, **kw) -> Engine:
    m = llm.model
    return Engine(m.family, m.spec, policy, device=torch.device("cpu"), dtype=torch.float32,
                  max_prompt=32, max_gen=8, **kw)


def test_weights_are_placed_by_bytes_and_accounting_matches_allocation(tiny):
    with LLM("dummy:llama-tiny") as llm:
        p = Policy(gpu_batch_size=4, num_gpu_batches=2, w_gpu_percent=20, w_cpu_percent=50,
                   cache_gpu_percent=25, cache_cpu_percent=50, act_gpu_percent=50, act_cpu_percent=0)
        e = _engine(llm, p)
        try:
            m = llm.model
            e.load_weights((j, m.source.layer(j, l, torch.float32, e.device)) for j, l in enumerate(m.spec.layers))
            for s in e.weights.splits:
                assert abs(s.a - 0.2 * s.n) <= 1 and abs(s.b - 0.7 * s.n) <= 1
            plan = e.plan
            for tier, alloc in (("gpu", e.tiers.gpu), ("cpu", e.tiers.cpu), ("disk", e.tiers.disk)):
                parts = ("weights", "kv cache", "buffers") + (("activations",) if tier != "gpu" else ())
                assert alloc.used == sum(plan.parts[w][tier] for w in parts), tier
            # activation rows on the compute device are compute's own tensors, counted but not
            # allocated; so are the rings of whole batches (32 tokens) and of one token step (a slot
            # per GPU batch and two more) that the CPU rows load back into
            ring_tokens = ACT_LOAD_SLOTS * 32 + 2 + 2
            assert plan.parts["activations"]["gpu"] == (2 * 2 * 32 + ring_tokens * 4) * 64 * 4
        finally:
            e.close()


def test_budget_refused_before_anything_is_allocated(monkeypatch):
    calls = []
    monkeypatch.setattr(MemTier, "alloc", lambda self, n: calls.append(n))
    with LLM("dummy:opt-tiny") as llm:
        with pytest.raises(MemoryBudgetError, match=r"needs .* GiB on gpu .* available \(--gpu-mem\)"):
            _engine(llm, Policy(), budgets=Budgets(gpu=1000))
        with pytest.raises(MemoryBudgetError, match="on disk"):
            _engine(llm, DISK, budgets=Budgets(disk=10))
    assert calls == []


def test_offload_folder_is_private_and_removed(tmp_path, tiny_refs, tiny):
    root = tmp_path / "off"
    seen = {}
    with LLM(str(tiny["llama"].path), policy=DISK, offload_dir=str(root)) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)
        (folder,) = list(root.iterdir())
        seen["dir"] = stat.S_IMODE(folder.stat().st_mode)
        seen["files"] = {stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()}
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["llama"]]
    assert seen["dir"] == 0o700 and seen["files"] == {0o600}
    assert list(root.iterdir()) == []


def test_offload_folder_removed_on_error(tmp_path, monkeypatch):
    root = tmp_path / "off"
    with pytest.raises(KeyboardInterrupt):
        with LLM("dummy:opt-tiny", policy=DISK, offload_dir=str(root)) as llm:
            monkeypatch.setattr(Engine, "run_block", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
            llm.generate(["hello"], max_new_tokens=2)
    assert list(root.iterdir()) == []


def test_offload_folder_removed_at_exit(tmp_path):
    root = tmp_path / "exit"
    code = ("import flexoff; from flexoff import LLM, Policy; "
            f"llm = LLM('dummy:opt-tiny', policy=Policy(w_gpu_percent=0, w_cpu_percent=0), offload_dir={str(root)!r}); "
            "llm.generate(['hi'], max_new_tokens=2)")  # exits without close()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])  # killed; terminal closed
def test_offload_folder_removed_on_signals(tmp_path, sig, code):
    root = tmp_path / "term"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(400)))
    proc = subprocess.Popen([sys.executable, "-m", "flexoff.cli", "run", "--model", "dummy:opt-tiny", "-q",
                             "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--percent",
                             "0", "0", "0", "0", "100", "0", "--max-new-tokens", "64", "--gpu-batch-size", "1",
                             "--offload-dir", str(root)], cwd=tmp_path, stderr=subprocess.PIPE)
    out = tmp_path / "o.jsonl"
    deadline = time.time() + 120  # signal mid-job: once the first block's results are written
    while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 1):
        time.sleep(0.05)
    assert any(root.iterdir())
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == code
    assert list(root.iterdir()) == []


def test_weights_stay_resident_or_move_between_policies(tiny, tiny_refs):
    """Same weight placement: the store is kept; another placement: moved, layer by layer."""
    want = [r for r, _ in tiny_refs["llama"]]
    base = dict(cache_gpu_percent=0, cache_cpu_percent=100)
    with LLM(str(tiny["llama"].path)) as llm:
        outs, stores = [], []
        for p in [Policy(gpu_batch_size=4, w_gpu_percent=30, w_cpu_percent=40, **base),
                  Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=30, w_cpu_percent=40),
                  Policy(gpu_batch_size=5, w_gpu_percent=0, w_cpu_percent=100),
                  Policy(gpu_batch_size=5, compress_weight=True),
                  Policy(gpu_batch_size=5)]:
            llm.policy_arg = p
            outs.append([c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                             max_new_tokens=8).completions])
            stores.append(llm.residency.weights)
            held = llm.residency.weights.mem.held()
            split = llm.residency.weights.bytes_per_tier()
            slots = 2 * max((s.n - s.stage for s in llm.residency.weights.splits), default=0)
            assert held == {"gpu": split["gpu"], "cpu": split["cpu"], "disk": split["disk"]} or \
                held["gpu"] == split["gpu"] and slots >= 0
            # everything allocated is the weights' and this engine's; nothing leaked from before
            used = llm.residency.tiers.used()
            assert used == {t: held[t] + llm.engine.mem.held()[t] for t in used}
        assert stores[0] is stores[1] and stores[1] is not stores[2] and stores[2] is not stores[3]
    assert outs[0] == outs[1] == outs[2] == outs[4] == want
    assert all(len(t) == 8 for t in outs[3])


def test_pinned_pool_reuses_and_trims(monkeypatch):
    """Freed pinned host buffers serve later requests of about their size; a request that none
    fits empties the pool first (so pooling never raises the peak)."""
    from flexoff.offload import tiers

    pinned, unpinned = [], []
    monkeypatch.setattr(tiers, "_host_register", lambda t: pinned.append(t.data_ptr()))
    monkeypatch.setattr(tiers, "_host_unregister", lambda t: unpinned.append(t.data_ptr()))
    mem = tiers.MemTier("cpu", torch.device("cpu"), pin=True)
    a, b = mem.alloc(1000), mem.alloc(1000)
    assert a.data_ptr() % tiers.PAGE == 0 and a.numel() == 1000 and len(pinned) == 2
    mem.free(a, 1000)
    mem.free(b, 1000)
    assert mem.used == 0 and mem.pooled == 2000 and unpinned == []
    c = mem.alloc(900)  # reuses a pooled buffer: no new pinning
    assert len(pinned) == 2 and c.numel() == 900 and mem.pooled == 1000
    d = mem.alloc(5000)  # nothing fits: the pool is released, then a new buffer is pinned
    assert len(unpinned) == 1 and mem.pooled == 0 and len(pinned) == 3
    mem.free(c, 900)
    mem.free(d, 5000)
    e = mem.alloc(4500)  # the pooled buffer of its size, not the first one pooled
    assert e.data_ptr() == d.data_ptr() and mem.pooled == 1000
    mem.free(e, 4500)
    mem.close()
    assert len(unpinned) == 3 and mem.pooled == 0


def test_a_closed_engine_still_referenced_holds_no_buffers():
    """A caller that keeps a closed engine (a traceback's frames while it retries, say) must not
    keep its memory: every buffer the engine allocated is collectable once it is closed."""
    import gc
    import weakref

    with LLM("dummy:llama-tiny") as llm:
        p = Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=20, w_cpu_percent=50,
                   cache_gpu_percent=0, cache_cpu_percent=50, act_gpu_percent=50, act_cpu_percent=0)
        e = _engine(llm, p)
        m = llm.model
        e.load_weights((j, m.source.layer(j, l, torch.float32, e.device)) for j, l in enumerate(m.spec.layers))
        bufs = [seg.buf for layer in e.kv.homes for batch in layer for seg in batch.values()]
        bufs += [b for home in e.weights.homes for b in home.values() if isinstance(b, torch.Tensor)]
        refs = [weakref.ref(b) for b in bufs]
        del bufs
        assert all(r() is not None for r in refs)
        e.close()
        gc.collect()
        alive = sum(r() is not None for r in refs)
        assert e is not None and alive == 0, f"{alive} of {len(refs)} buffers outlive close()"


def _allocated_gpu(plan) -> int:
    return sum(plan.parts[w]["gpu"] for w in ("weights", "kv cache", "buffers"))


def test_gpu_memory_available_counts_the_allocators_unused_blocks(monkeypatch):
    """What a new engine's plan may use on the GPU: the device's free memory and the blocks the
    CUDA allocator holds for this process unused (a closed engine's, not yet given back)."""
    from flexoff.offload.memory import available

    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 12 * GiB)
    assert available(torch.device("cuda", 0), None)["gpu"] == 58 * GiB


def test_a_new_engine_is_checked_after_the_old_one_gave_its_memory_back(monkeypatch):
    """An LLM replacing its engine (another policy, a larger job) closes the old one and
    empties the allocator's cache before the new plan is checked against what is free."""
    import flexoff.offload.engine as engine_mod

    events = []
    real_check = engine_mod.check
    monkeypatch.setattr(engine_mod, "check", lambda *a, **k: events.append("check") or real_check(*a, **k))
    with LLM("dummy:llama-tiny") as llm:
        real_drop = llm.drop_engine
        monkeypatch.setattr(llm, "drop_engine", lambda: events.append(("drop", llm.engine is not None)) or real_drop())
        for p in (Policy(gpu_batch_size=2), Policy(gpu_batch_size=4)):
            llm.policy_arg = p
            llm.generate([{"prompt_ids": q} for q in PROMPTS[:4]], max_new_tokens=2)
    assert events[-2:] == [("drop", True), "check"]


@pytest.mark.parametrize("compressed_first", [True, False])
def test_switching_policies_never_holds_both_engines_weight_slots(compressed_first):
    """Moving to a new weight placement (or from 4-bit weights back to exact ones) must not hold
    the old store's GPU staging slots next to the new engine's allocations: the new plan counts
    the old weights as free, so the GPU tier may never peak above the larger of the two plans."""
    base = dict(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100,
                cache_gpu_percent=100, cache_cpu_percent=0, act_gpu_percent=100, act_cpu_percent=0)
    first, second = Policy(**base, compress_weight=True), Policy(**{**base, "w_gpu_percent": 10, "w_cpu_percent": 90})
    if not compressed_first:
        first, second = Policy(**base), Policy(**{**base, "w_gpu_percent": 10, "w_cpu_percent": 90})
    with LLM("dummy:llama-tiny") as llm:
        plans = []
        for p in (first, second):
            llm.policy_arg = p
            llm.generate([{"prompt_ids": q} for q in PROMPTS[:4]], max_new_tokens=3)
            plans.append(_allocated_gpu(llm.engine.plan))
        assert llm.residency.tiers.gpu.peak <= max(plans), (llm.residency.tiers.gpu.peak, plans)


@pytest.mark.parametrize("room_to_move", [True, False])
def test_moving_weights_counts_the_old_layers_until_they_have_moved(room_to_move):
    """Exact weights on the CPU tier, then a 4-bit policy whose KV cache fills the CPU budget:
    moving layer by layer holds the old layers not yet moved next to the new cache, so the
    engine moves them only where that fits and otherwise reads the weights again; the CPU tier
    never peaks above its budget, and the result is what a fresh load gives."""
    from flexoff.autopolicy import engine_plan

    first = Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=100)
    second = Policy(gpu_batch_size=64, w_gpu_percent=0, w_cpu_percent=100, cache_gpu_percent=0,
                    cache_cpu_percent=100, compress_weight=True)
    prompts = [{"prompt_ids": PROMPTS[i % len(PROMPTS)]} for i in range(64)]
    with LLM("dummy:llama-tiny") as probe:
        plain = engine_plan(probe, first, 15, 3).total("cpu")
        packed = engine_plan(probe, second, 15, 3).total("cpu")
        probe.policy_arg = second
        want = [c.token_ids for c in probe.generate(prompts, max_new_tokens=3).completions]
    assert plain <= packed  # the first policy fits the tight budget too
    budget = plain + packed if room_to_move else packed
    with LLM("dummy:llama-tiny", cpu_mem=budget) as llm:
        reads, layer = [], llm.model.source.layer
        llm.model.source.layer = lambda j, *a: reads.append(j) or layer(j, *a)
        llm.policy_arg = first
        llm.generate(prompts[:5], max_new_tokens=3)
        llm.policy_arg = second
        got = [c.token_ids for c in llm.generate(prompts, max_new_tokens=3).completions]
        assert llm.residency.tiers.cpu.peak <= budget, (llm.residency.tiers.cpu.peak, budget)
        n = len(llm.model.spec.layers)
        assert reads == list(range(n)) * (1 if room_to_move else 2)
    assert got == want


def test_disk_writes_of_transient_outputs_are_bounded(tmp_path, monkeypatch):
    """Compute outputs spilled to disk wait for the disk: while a slow disk writes, at most
    SPILLING of them are unwritten (the memory plan counts them), every byte arrives, and copies
    of buffers that live on (not transient) are not held back."""
    import threading

    from flexoff.offload.lanes import Lanes
    from flexoff.offload.mover import SPILLING, Mover, Span, span_of
    from flexoff.offload.tiers import Ledger, Tiers

    lanes, tiers = Lanes(torch.device("cpu")), Tiers(torch.device("cpu"), str(tmp_path))
    mem, lock = Ledger(tiers), threading.Lock()
    mover = Mover(lanes, mem)
    queued, most = [0], [0]
    write = Mover._write

    def slow_write(self, dst, src):
        time.sleep(0.02)
        write(self, dst, src)
        with lock:
            queued[0] -= 1

    monkeypatch.setattr(Mover, "_write", slow_write)
    n, parts = 4096, 8
    files = [mem.alloc("disk", n) for _ in range(2 * parts)]
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8) for _ in range(2 * parts)]
    for i in range(parts):
        with lock:
            queued[0] += 1
        mover.copy(Span(files[i], 0, n), span_of(data[i]), lane="store", transient=True)
        with lock:
            most[0] = max(most[0], queued[0])
    assert most[0] == SPILLING
    for i in range(parts, 2 * parts):  # not transient: queued at once
        with lock:
            queued[0] += 1
        mover.copy(Span(files[i], 0, n), span_of(data[i]), lane="store")
    with lock:
        assert queued[0] > SPILLING
    lanes.sync()
    for f, d in zip(files, data):
        back = torch.empty(n, dtype=torch.uint8)
        mover.copy(span_of(back), Span(f, 0, n)).wait_host()
        assert torch.equal(back, d)
    lanes.close()
    mem.release()
    tiers.close()


def test_disk_cache_rows_load_a_layer_ahead_under_cpu_attention(tiny, tiny_refs, monkeypatch):
    """CPU attention with a row of each GPU batch's cache on disk, three GPU batches: in every
    decode step, all three batches' disk rows of attention layer j + 1 start loading before the
    MLP layer j in front of it computes (a ring of four GPU slots; with two, a batch's rows
    loaded one step ahead, inside the attention layer). The tokens stay the reference's."""
    from flexoff.offload.layer_ops import AttnOp, MlpOp

    events = []
    load_cache, mlp_forward = AttnOp.load_cache, MlpOp.forward

    def logged_load(self, run, step):
        loads = load_cache(self, run, step)
        if loads:
            events.append(("load", step.i, step.j, step.k))
        return loads

    def logged_mlp(self, run, step):
        events.append(("mlp", step.i, step.j, step.k))
        return mlp_forward(self, run, step)

    monkeypatch.setattr(AttnOp, "load_cache", logged_load)
    monkeypatch.setattr(MlpOp, "forward", logged_mlp)
    policy = Policy(gpu_batch_size=4, num_gpu_batches=3, cache_gpu_percent=25, cache_cpu_percent=50,
                    cpu_cache_compute=True)
    prompts = (PROMPTS * 3)[:12]
    with LLM(str(tiny["opt"].path)) as llm:
        llm.policy_arg = policy
        got = [c.token_ids for c in llm.generate([{"prompt_ids": q} for q in prompts],
                                                   max_new_tokens=4).completions]
        assert len(llm.engine.kv.slots) == 4
        kinds = [layer.kind for layer in llm.model.spec.layers]
    assert got == [tiny_refs["opt"][n % len(PROMPTS)][0][:4] for n in range(12)]
    checked = 0
    for n, ev in enumerate(events):
        if ev[0] != "mlp" or ev[3] != 0 or ev[1] < 1 or ev[2] + 1 >= len(kinds) or kinds[ev[2] + 1] != "attn":
            continue
        i, j = ev[1], ev[2]
        assert {("load", i, j + 1, k) for k in range(3)} <= set(events[:n]), (i, j)
        checked += 1
    assert checked >= 3 * 2  # decode steps x (mlp, attn) pairs


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_hidden_states_load_back_into_a_ring_of_device_buffers(tiny, tiny_refs, monkeypatch, slots):
    """Rows of the hidden state kept in CPU memory or on disk load back into a fixed ring of
    compute-device buffers (on CUDA: no allocation per load in the load stream's own memory pool,
    which the compute stream cannot reuse). Each slot is loaded again only after compute has read
    it, CPU attention's deferred residual included: a ring of one, with the copy lanes running
    concurrently, still gives transformers' tokens. Token steps load into a second ring of
    one-token buffers, sized the same here, where they are not kept on the device."""
    monkeypatch.setenv("FLEXOFF_LOAD_SLOTS", str(slots))
    monkeypatch.setenv("FLEXOFF_STEP_SLOTS", str(slots))
    monkeypatch.setenv("FLEXOFF_KEEP_STEPS", "0")
    taken: list[bool] = []
    stores: list[HiddenStore] = []
    real = HiddenStore.take

    def take(self: HiddenStore, kb: int, j: int):
        out, evs = real(self, kb, j)
        taken.append(self.lends(out))
        stores.append(self)
        return out, evs

    monkeypatch.setattr(HiddenStore, "take", take)
    want = [r for r, _ in tiny_refs["llama"]]
    with LLM(str(tiny["llama"].path)) as llm:
        for cpu_attn in (False, True):
            for act in ((0, 100), (0, 50), (50, 0)):  # CPU, CPU and disk, half on the device and disk
                taken.clear()
                llm.policy_arg = Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=30, w_cpu_percent=40,
                                        cache_gpu_percent=0, cache_cpu_percent=100, act_gpu_percent=act[0],
                                        act_cpu_percent=act[1], cpu_cache_compute=cpu_attn)
                got = [c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                           max_new_tokens=8).completions]
                assert got == want, (cpu_attn, act)
                # every load landed in the ring: with two slots or more, the one being computed on and
                # the next batch's (CPU attention's deferred residual may hold them all)
                if not cpu_attn and slots >= 2:
                    assert taken and all(taken), (act, taken.count(False))
                    assert stores[-1].unslotted == 0 and [len(r.slots) for r in stores[-1]._rings] == [slots, slots]


def test_token_steps_keep_hidden_states_on_the_device(tiny, tiny_refs, monkeypatch):
    """A token step's hidden state stays whole on the compute device between layers, whatever
    the activations' placement: nothing is stored to its CPU or disk rows and nothing is loaded
    back (compute waits for no copy), while prompts' hidden states still go where the policy
    puts them and load back. Tokens equal transformers' with the GPU attending and with CPU
    attention; with `FLEXOFF_KEEP_STEPS=0` token steps load back too."""
    seen: list[tuple[int, bool]] = []  # (tokens per row, whether compute had copies to wait for)
    real = HiddenStore.take

    def take(self: HiddenStore, kb: int, j: int):
        out, evs = real(self, kb, j)
        seen.append((out.shape[1], bool(evs)))
        return out, evs

    monkeypatch.setattr(HiddenStore, "take", take)
    want = [r for r, _ in tiny_refs["opt"]]
    with LLM(str(tiny["opt"].path)) as llm:
        for keep in ("1", "0"):
            monkeypatch.setenv("FLEXOFF_KEEP_STEPS", keep)
            for cpu_attn in (False, True):
                seen.clear()
                llm.policy_arg = Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=30, w_cpu_percent=40,
                                        cache_gpu_percent=0, cache_cpu_percent=100, act_gpu_percent=0,
                                        act_cpu_percent=50, cpu_cache_compute=cpu_attn)
                got = [c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                           max_new_tokens=8).completions]
                assert got == want, (keep, cpu_attn)
                steps = [waited for s, waited in seen if s == 1]
                prompts = [waited for s, waited in seen if s > 1]
                assert steps and prompts and all(prompts), (keep, cpu_attn)
                assert (not any(steps)) if keep == "1" else all(steps), (keep, cpu_attn, steps)


def test_held_stores_stay_within_their_bytes_and_wait_for_the_oldest(tmp_path):
    """The mover keeps stored compute outputs alive until their copies are done (CUDA's path;
    its events are stood in for here): outputs whose copies are done are let go as new ones
    come, never more than `hold_bytes` are held beyond the newest, and the host waits for the
    oldest copy first."""
    from flexoff.offload.lanes import Lanes
    from flexoff.offload.mover import Mover
    from flexoff.offload.tiers import Ledger, Tiers

    waited: list[int] = []

    class Copied:  # a copy's event: done once the "stream" passes it, or once waited for
        def __init__(self, n: int):
            self.n, self.done = n, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            waited.append(self.n)
            self.done = True

    lanes, tiers = Lanes(torch.device("cpu")), Tiers(torch.device("cpu"), str(tmp_path))
    mover = Mover(lanes, Ledger(tiers), hold_bytes=3000)
    evs = [Copied(n) for n in range(8)]
    for n in range(4):  # 1000 bytes each: the fourth makes 4000 > 3000, so the first is waited for
        mover._hold(torch.zeros(1000, dtype=torch.uint8), evs[n])
    assert waited == [0] and mover._held_n == 3000 and mover.hold_waits == 1
    evs[1].done = evs[2].done = True  # copied meanwhile: let go without waiting
    mover._hold(torch.zeros(1000, dtype=torch.uint8), evs[4])
    assert waited == [0] and mover._held_n == 2000
    evs[4].done = True  # a later copy done before an earlier one is still held (copies end in order)
    mover._hold(torch.zeros(2500, dtype=torch.uint8), evs[5])  # 4500 held: 3, then 4 let go
    assert waited == [0, 3] and mover._held_n == 2500
    mover._hold(torch.zeros(4000, dtype=torch.uint8), evs[6])  # larger than the budget: held alone
    assert waited == [0, 3, 5] and mover._held_n == 4000 and len(mover._held) == 1
    evs[6].done = True
    mover.settle()
    assert mover._held_n == 0 and not mover._held
    lanes.close()
    tiers.close()


class _Fence:
    """A stand-in for a CUDA event: counts the waits on it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), min_size=1, max_size=60))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_pinned_arena_runs_never_overlap_and_wait_for_their_fences(monkeypatch, ops):
    """Random takes and gives against a byte-by-byte model of the region: live runs never share
    a byte, a request no free run fits is pinned on its own, a run reused waits once, for a fence
    no earlier than the latest under which any of its bytes was freed (a merged run keeps its
    parts' latest), and all runs given back merge into one."""
    from flexoff.offload import tiers

    pinned: list[int] = []
    monkeypatch.setattr(tiers, "_host_register", lambda t: pinned.append(t.numel()))
    monkeypatch.setattr(tiers, "_host_unregister", lambda t: None)
    arena = tiers.PinnedArena()
    arena.reserve(8192)
    owner = tiers.PinnedArena  # any object outlives the test
    base = arena.region.buf.data_ptr()
    used = [None] * 8192  # byte -> the live lease holding it
    freed_by = [-1] * 8192  # byte -> the number of the fence it was last freed under
    fences: list[_Fence] = []
    live: list[tuple[torch.Tensor, object]] = []
    for give, n in ops:
        if give and live:
            t, lease = live.pop(n % len(live))
            fences.append(_Fence())
            tiers.PinnedArena.give(lease, (len(fences) - 1, fences[-1]))
            at = t.data_ptr() - base
            for i in range(at, at + lease[2]):
                used[i], freed_by[i] = None, len(fences) - 1
            continue
        before = [f.waits for f in fences]
        t, lease = arena.take(n, torch.float16, owner)
        assert t.numel() == n and t.dtype == torch.float16
        if lease is None:  # pinned on its own: no free run of the region was big enough
            assert pinned[-1] >= 2 * n
            assert not any(all(u is None for u in used[i:i + 2 * n]) and i % tiers.PinnedArena.ALIGN == 0
                           for i in range(0, 8192 - 2 * n + 1))
            continue
        at = t.data_ptr() - base
        assert at % tiers.PinnedArena.ALIGN == 0 and lease[2] >= 2 * n
        assert all(u is None for u in used[at:at + lease[2]])  # no byte of a live run
        for i in range(at, at + lease[2]):
            used[i] = lease
        latest = max(freed_by[at:at + lease[2]])
        waited = [i for i, f in enumerate(fences) if f.waits > before[i]]
        assert len(waited) <= 1 and (latest < 0 or waited and waited[0] >= latest)  # merged runs: their latest
        live.append((t, lease))
    for t, lease in live:
        tiers.PinnedArena.give(lease)
    assert [(a, n) for a, n, _ in arena.region.free] == [(0, 8192)]


@given(st.lists(st.integers(1, 40), min_size=1, max_size=80), st.integers(40, 200))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_pinned_arena_is_a_ring_for_entries_that_come_and_go_in_order(monkeypatch, sizes, live):
    """Entries taken in order, the oldest given back until what stays and the next one are at
    most `live` (as the adapter pool's cache drops a sorted job's adapters): in a region of
    `live` and the largest entry more, every entry gets a run, none is pinned on its own."""
    from flexoff.offload import tiers

    monkeypatch.setattr(tiers, "_host_register", lambda t: None)
    monkeypatch.setattr(tiers, "_host_unregister", lambda t: None)
    align = tiers.PinnedArena.ALIGN  # sizes in runs of ALIGN bytes
    arena = tiers.PinnedArena()
    arena.reserve((live + max(sizes)) * align)
    held: list[tuple[int, object]] = []
    for n in sizes:
        while held and sum(m for m, _ in held) + n > live:
            tiers.PinnedArena.give(held.pop(0)[1])
        t, lease = arena.take(n * align, torch.uint8, tiers.PinnedArena)
        assert lease is not None and arena.pinned == 0
        held.append((n, lease))
