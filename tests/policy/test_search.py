"""The cost model and LP search: FlexGen's T4 setting, LP optimality, infeasible budgets."""

from __future__ import annotations

import itertools

import pytest

from flexoff.checkpoint import load_model
from flexoff.cli import main
from flexoff.policy.cost_model import CPU_CALL_EXPOSED, Choice, CostModel, Workload
from flexoff.policy.hardware import flexgen_t4, h200
from flexoff.policy.search import Budget, search, solve_lp

T4 = flexgen_t4()
W512 = Workload(512, 32)


def spec(name: str):
    return load_model(f"dummy:{name}").spec


def test_opt_30b_on_t4_matches_table_15_shape():
    """Paper: 48x3 (20, 80, 0, 100, 0, 100): weights and cache on the CPU, block of 144. Our engine
    reads an attention layer's disk rows while the MLP layer before it runs, which FlexGen's does
    not, so a few rows on disk cost little here: the cache is on the CPU but for those."""
    best = search(spec("opt-30b"), T4, W512, Budget.of(T4))[0].policy
    assert best.w_disk_percent == 0 and best.w_cpu_percent >= 75  # weights: CPU (and a little GPU)
    assert best.cache_disk_percent <= 10 and best.cache_cpu_percent >= 75  # cache: CPU
    assert 64 <= best.block_size <= 512  # block size in the paper's range


def test_opt_175b_on_t4_matches_table_15_shape():
    """Paper: 32x8 (0, 50, 0, 0, 0, 100): weights half CPU half disk, cache on disk, activations CPU.
    Our engine keeps token steps' hidden states on the GPU, so the activations' placement moves
    prompts' only, under the prefill's compute on a T4: off the GPU, on CPU or disk alike."""
    best = search(spec("opt-175b"), T4, W512, Budget.of(T4))[0].policy
    assert best.w_gpu_percent <= 5 and 40 <= best.w_cpu_percent <= 70 and best.w_disk_percent >= 30
    assert best.cache_disk_percent >= 90
    assert best.act_gpu_percent <= 10
    assert 128 <= best.block_size <= 1024


def _grid(step: float = 0.25):
    vals = [i * step for i in range(int(1 / step) + 1)]
    for wg, wc, cg, cc, hg, hc in itertools.product(vals, repeat=6):
        if wg + wc <= 1 and cg + cc <= 1 and hg + hc <= 1:
            yield {"wg": wg, "wc": wc, "wd": 1 - wg - wc, "cg": cg, "cc": cc, "cd": 1 - cg - cc,
                   "hg": hg, "hc": hc, "hd": 1 - hg - hc}


@pytest.mark.parametrize("gbs,nb,cpu_attn", [(8, 4, False), (32, 2, True), (2, 1, True)])
def test_lp_optimum_is_never_worse_than_a_grid_point(gbs, nb, cpu_attn):
    s, hw = spec("opt-6.7b"), T4
    model = CostModel(s, hw, W512, Choice(gbs, nb, cpu_cache_compute=cpu_attn))
    budget = Budget(8e9, 40e9, 1e12)
    x, latency = solve_lp(model, budget)
    lp = model.evaluate(x)
    assert lp.latency == pytest.approx(latency, rel=1e-6)
    checked = 0
    for point in _grid():
        mem = model.memory(point)
        if all(mem[t] <= getattr(budget, t) for t in mem):
            assert lp.latency <= model.evaluate(point).latency * (1 + 1e-7)
            checked += 1
    assert checked > 100


def test_overlap_off_costs_the_sum_of_terms():
    s = spec("opt-6.7b")
    x = {"wg": 0.2, "wc": 0.8, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 1, "hc": 0, "hd": 0}
    # one GPU batch: with several and overlap on, staged cache rows are priced over a decode pair
    on = CostModel(s, T4, W512, Choice(8, 1)).evaluate(x)
    off = CostModel(s, T4, W512, Choice(8, 1, overlap=False)).evaluate(x)
    for key, terms in on.terms.items():
        assert off.terms[key] == terms
    assert off.latency > on.latency


def test_compression_shrinks_bytes_and_is_priced():
    s = spec("opt-30b")
    plain = CostModel(s, T4, W512, Choice(16, 4))
    comp = CostModel(s, T4, W512, Choice(16, 4, compress_weight=True, compress_cache=True))
    assert 0.25 < comp.W["mlp"] / plain.W["mlp"] < 0.3
    assert 0.25 < comp.kv / plain.kv < 0.3
    x = {"wg": 1, "wc": 0, "wd": 0, "cg": 1, "cc": 0, "cd": 0, "hg": 1, "hc": 0, "hd": 0}
    assert comp.terms(x)[("g", "mlp")]["comp"] > plain.terms(x)[("g", "mlp")]["comp"]  # dequantization


def test_max_latency_is_respected():
    s = spec("opt-6.7b")
    free = search(s, h200(), W512, Budget.of(h200(), gpu=8 * 2**30))
    fastest = min(c.prediction.latency for c in free)
    bound = (fastest + free[0].prediction.latency) / 2  # reachable, but not by the best policy
    assert free[0].prediction.latency > bound
    capped = search(s, h200(), W512, Budget.of(h200(), gpu=8 * 2**30), max_latency=bound)
    assert capped and all(c.prediction.latency <= bound * 1.001 for c in capped)


def test_infeasible_budget_is_exit_2(capsys):
    code = main(["policy", "search", "--model", "dummy:opt-175b", "--prompt-len", "512", "--gen-len", "32",
                 "--hardware", "h200", "--gpu-mem", "1GiB", "--disk-mem", "10GiB", "--cpu-mem", "10GiB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no policy fits" in err and "GiB of GPU memory" in err and len(err.splitlines()) == 1


def test_policy_search_cli_writes_a_runnable_policy(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["policy", "search", "--model", "dummy:opt-30b", "--prompt-len", "512", "--gen-len", "32",
                 "--hardware", "flexgen-t4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("policy", "prefill", "decode", "throughput", "bottleneck", "runners-up"):
        assert word in text
    from flexoff.policy.policy import Policy

    assert Policy.load(out).block_size >= 64


def test_auto_policy_runs_the_job(tiny, tiny_refs, tmp_path):
    from flexoff import LLM
    from flexoff.policy.hardware import save
    from reference import PROMPTS

    hw = h200()
    profile = tmp_path / "hw.json"
    save(hw.__class__(**{**hw.__dict__, "device": "cpu", "name": "test"}), profile)
    s = load_model(str(tiny["llama"].path)).spec
    gpu_mem = s.weight_bytes(4) // 2 + s.working_bytes(len(PROMPTS), 15, 4, "cpu")  # half the weights fit
    with LLM(str(tiny["llama"].path), policy="auto", hardware=str(profile), gpu_mem=gpu_mem,
             cpu_mem=1 << 30) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)
        assert out.policy.w_gpu_percent < 100  # a 1 MiB "GPU" cannot hold the weights
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["llama"]]


def test_auto_policy_searches_again_after_the_gpu_runs_out(tiny, tiny_refs, tmp_path, monkeypatch):
    import torch

    import flexoff.api as api
    from flexoff import LLM
    from flexoff.errors import GpuOutOfMemoryError, MemoryBudgetError
    from flexoff.policy.hardware import save
    from flexoff.policy.policy import Policy
    from reference import PROMPTS

    hw = h200()
    profile = tmp_path / "hw.json"
    save(hw.__class__(**{**hw.__dict__, "device": "cpu", "name": "test"}), profile)
    s = load_model(str(tiny["llama"].path)).spec
    gpu_mem = s.weight_bytes(4) + 2 * s.working_bytes(len(PROMPTS), 15, 4, "cpu")
    real, calls = api.run_block, []

    def fails_once(engine, *args, **kw):  # the first block runs out of (simulated) GPU memory
        calls.append(engine.policy)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(engine, *args, **kw)

    monkeypatch.setattr(api, "run_block", fails_once)
    with LLM(str(tiny["llama"].path), policy="auto", hardware=str(profile), gpu_mem=gpu_mem,
             cpu_mem=1 << 30) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)
        assert llm.gpu_margin == api.oom_step(gpu_mem)
        oom = llm.last_oom  # what ran out is recorded: the policy, torch's message, the failing frame
        assert oom["policy"] == calls[0].describe() and oom["message"] == "CUDA out of memory (simulated)"
        assert oom["frames"][-1].endswith("fails_once")
    assert len(calls) >= 2 and out.policy == calls[-1]
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["llama"]]

    calls.clear()  # a policy the user gave is not changed: a one-line error says what to do
    with LLM(str(tiny["llama"].path), policy=Policy(gpu_batch_size=2), gpu_mem=gpu_mem) as llm:
        with pytest.raises(MemoryBudgetError, match="ran out of memory running 2x1"):
            llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)

    # running out while the engine is set up (weights loaded through the GPU) is handled the same way
    monkeypatch.setattr(api, "run_block", real)
    from flexoff.offload import residency

    made, engine_cls = [], residency.Engine

    def setup_fails_once(*args, **kw):
        made.append(args[2])
        if len(made) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return engine_cls(*args, **kw)

    monkeypatch.setattr(residency, "Engine", setup_fails_once)
    with LLM(str(tiny["llama"].path), policy="auto", hardware=str(profile), gpu_mem=gpu_mem,
             cpu_mem=1 << 30) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)
        assert llm.gpu_margin == api.oom_step(gpu_mem) and len(made) == 2
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["llama"]]
    made.clear()
    with LLM(str(tiny["llama"].path), policy=Policy(gpu_batch_size=2), gpu_mem=gpu_mem) as llm:
        with pytest.raises(GpuOutOfMemoryError, match="ran out of memory running 2x1"):
            llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)


def test_host_work_per_step_is_priced_per_gpu_batch():
    """The engine's host work per step (one layer of one GPU batch) is a term of every layer, so
    at a fixed block size more, smaller GPU batches cost more once it dominates."""
    from dataclasses import replace

    s = spec("opt-30b")
    hw = replace(h200(), host_step_s=1e-3)
    x = {"wg": 0, "wc": 1, "wd": 0, "cg": 0.125, "cc": 0.875, "cd": 0, "hg": 0, "hc": 1, "hd": 0}
    ch = dict(compress_weight=True, compress_cache=True)
    few, many = (CostModel(s, hw, W512, Choice(g, n, **ch)) for g, n in ((48, 8), (16, 24)))
    assert many.terms(x)[("g", "mlp")]["host"] == pytest.approx(24e-3)
    assert few.terms(x)[("g", "mlp")]["host"] == pytest.approx(8e-3)
    assert few.evaluate(x).latency < many.evaluate(x).latency
    free = CostModel(s, replace(hw, host_step_s=0.0), W512, Choice(16, 24, **ch))
    gap = many.evaluate(x).decode_s - free.evaluate(x).decode_s
    mlp = many.evaluate(x).terms["g/mlp"]
    assert gap > 0 and max(mlp, key=mlp.get) == "host"  # 24 ms of steps against 4 ms of weights


def test_packed_weights_take_their_own_host_step():
    """A profile's packed host step (4-bit weights streamed) prices policies that compress
    weights; others, and profiles that lack it, take the plain step."""
    from dataclasses import replace

    s = spec("opt-30b")
    hw = replace(h200(), host_step_s=1e-3, packed_host_step_s=2.5e-3)
    x = {"wg": 0, "wc": 1, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 0, "hc": 1, "hd": 0}
    host = {(c, p): CostModel(s, p, W512, Choice(16, 8, compress_weight=c, compress_cache=True)).terms(x)[("g", "mlp")]["host"]
            for c in (False, True) for p in (hw, replace(hw, packed_host_step_s=0.0))}
    assert host[(True, hw)] == pytest.approx(8 * 2.5e-3)
    assert host[(False, hw)] == pytest.approx(8e-3)
    assert host[(True, replace(hw, packed_host_step_s=0.0))] == pytest.approx(8e-3)


def test_decode_copies_take_the_engines_measured_link_rate():
    """A profile's decode link rate prices decode's host-to-device bytes (weights, staged cache
    rows, activations; and the pair's pooled copies under CPU attention), slowed under CPU attention
    as the profile measured copies slow beside it; prefill's copies keep ctog_bdw, and a profile
    without the rate prices decode at ctog_bdw too."""
    from dataclasses import replace

    from flexoff.quant.sizes import kv_config, kv_record_bytes, layer_bytes, weight_config

    s = spec("opt-30b")
    hw = h200()
    slow = replace(hw, decode_ctog_bdw=hw.ctog_bdw * 0.8)
    x = {"wg": 0, "wc": 1, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 0, "hc": 1, "hd": 0}
    ch = Choice(48, 8, compress_weight=True, compress_cache=True)
    models = {h: CostModel(s, h, W512, ch) for h in (hw, slow)}
    fast, probed = (models[h].terms(x) for h in (hw, slow))
    # decode's bytes of an (attn, mlp) pair, counted here from the sizes: 4-bit weights, the
    # staged cache rows over the average context (token steps' activations stay on the GPU)
    w = sum(layer_bytes(s.layers[j], 2, weight_config(4, 64)) for j in (1, 2))
    assert [s.layers[j].kind for j in (1, 2)] == ["attn", "mlp"]
    kv = kv_record_bytes(s.num_kv_heads, s.head_dim, 2, kv_config(4, 64, s.head_dim))
    moved = w + 384 * (512 + 32 / 2) * kv
    assert models[slow].cache_pool(x, probed)["ctog"] == pytest.approx(moved / slow.decode_ctog_bdw)
    assert models[hw].cache_pool(x, fast)["ctog"] == pytest.approx(moved / hw.ctog_bdw)
    assert probed[("p", "attn")]["ctog"] == pytest.approx(fast[("p", "attn")]["ctog"])
    assert hw.decode_link_bdw() == hw.ctog_bdw
    cpu = Choice(16, 4, cpu_cache_compute=True)
    y = dict(x, cc=0.5, cd=0.5)
    pair = {h: CostModel(s, h, W512, cpu) for h in (hw, slow)}
    # the pooled link term: its bytes at the link's rate, and what it waits on CPU attention's last
    # call of a layer (CPU_CALL_EXPOSED of a call at two batches, over (batches - 1)^3), whatever the rate
    waits = {h: CPU_CALL_EXPOSED / 3**3 * m.cpu_attention(y)[1] / 4 for h, m in pair.items()}
    assert waits[hw] == waits[slow] > 0
    pools = {h: m.cache_pool(y, m.terms(y))["ctog"] - waits[h] for h, m in pair.items()}
    assert pools[slow] == pytest.approx(pools[hw] / 0.8)
    # copies measured 10% slower with CPU attention beside them: CPU-attention decodes move their
    # bytes 10% slower; GPU attention and prefill keep their rates
    beside = replace(slow, cpu_attn_ctog_bdw=hw.ctog_bdw * 0.9)
    m = CostModel(s, beside, W512, cpu)
    assert m.cache_pool(y, m.terms(y))["ctog"] - waits[hw] == pytest.approx(pools[hw] / 0.8 / 0.9)
    assert m.terms(y)[("p", "attn")]["ctog"] == pytest.approx(pair[hw].terms(y)[("p", "attn")]["ctog"])
    assert CostModel(s, beside, W512, ch).cache_pool(x, probed)["ctog"] == pytest.approx(moved / slow.decode_ctog_bdw)


def test_staged_cache_rows_idle_the_link_while_the_mlp_layer_computes():
    """GPU attention over CPU rows, several GPU batches: a decode pair takes the pair's link
    seconds plus the idle of the rows' two-slot ring (two attention steps and the MLP layer on the
    GPU, less two batches' copies and the pair's own layer copies), where that idle is positive;
    more rows per batch hide it. Rows on disk add their reads to the pair's link seconds."""
    from dataclasses import replace

    s = spec("opt-30b")
    hw = replace(h200(), host_step_s=0.0)
    x = {"wg": 1, "wc": 0, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 0, "hc": 1, "hd": 0}
    idle = {}
    for g, n in ((8, 48), (96, 4)):
        m = CostModel(s, hw, W512, Choice(g, n, compress_weight=True, compress_cache=True))
        t = m.terms(x)
        attn, mlp = t[("g", "attn")], t[("g", "mlp")]
        copy = g * (512 + 16) * m.kv / hw.ctog_bdw  # one batch's rows
        link = m.cache_pool(x, t)["ctog"]
        idle[(g, n)] = 2 * attn["comp"] / n + mlp["comp"] - 2 * copy - attn["ctog"] - mlp["ctog"]
        pair = max(link + max(0.0, idle[(g, n)]), m.layer_time(attn) + m.layer_time(mlp))
        ends = sum(m.count[k] * m.layer_time(t[("g", k)]) for k in ("embed", "head"))
        assert m.evaluate(x).decode_s == pytest.approx(31 * (m.count["attn"] * pair + ends), rel=1e-9)
    assert idle[(8, 48)] > 0 > idle[(96, 4)]
    one = CostModel(s, hw, W512, Choice(64, 1, compress_weight=True, compress_cache=True))
    assert one.staged_idle(x, one.terms(x)) == 0 and one.cache_pool(x, one.terms(x)) == {}
    m = CostModel(s, hw, W512, Choice(48, 8, compress_weight=True, compress_cache=True))
    d = dict(x, cc=0.75, cd=0.25)
    pool = m.cache_pool(d, m.terms(d))
    disk = 384 * (512 + 16) * m.kv * 0.25 / hw.dtoc_bdw
    assert pool["dtoc"] == pytest.approx(disk) and pool["ctog"] == pytest.approx(m.cache_pool(x, m.terms(x))["ctog"] + disk)


def test_a_pairs_host_work_and_link_combine_as_a_norm():
    """A decode pair's link seconds and its host seconds (weighted) combine as a HOST_NORM-norm:
    a shape whose host work is small is priced by its link, one of many small GPU batches whose
    host work nears the link's time takes longer than either, and the larger names the pair's
    bottleneck. cache_pool gives the LP the weighted host seconds as a bound."""
    from dataclasses import replace

    from flexoff.policy.cost_model import HOST_NORM, HOST_WEIGHT

    s = spec("opt-30b")
    x = {"wg": 0.5, "wc": 0.5, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 0, "hc": 1, "hd": 0}
    ch = Choice(24, 16, compress_weight=True, compress_cache=True)
    for step in (1e-5, 8e-4, 2e-3):
        hw = replace(h200(), host_step_s=step, packed_host_step_s=step)
        m = CostModel(s, hw, W512, ch)
        t = m.terms(x)
        pool = m.cache_pool(x, t)
        host, link = pool["host"], pool["ctog"] + m.staged_idle(x, t)
        assert host == pytest.approx(HOST_WEIGHT * 2 * 16 * step)
        name, both = m.pair_pool(x, t)
        assert both == pytest.approx((link ** HOST_NORM + host ** HOST_NORM) ** (1 / HOST_NORM))
        assert name == ("host" if host > link else "ctog") and both >= max(host, link)
        if step == 1e-5:
            assert both == pytest.approx(link, rel=1e-6)


def test_disk_rows_the_page_cache_holds_are_read_at_its_rate():
    """With the page cache's read rate in the profile, a placement whose CPU and disk tiers fit
    PAGE_CACHE_SHARE of host memory reads its disk rows at that rate, PAGE_CACHE_READ_BDW at most
    (the pair's disk seconds are its staged rows' bytes over it); one that does not, or a profile
    without the rate, at dtoc_bdw. The search's picks keep their predictions under that rule."""
    from dataclasses import replace

    from flexoff.policy.cost_model import PAGE_CACHE_READ_BDW, PAGE_CACHE_SHARE

    s = spec("opt-30b")
    hw = replace(h200(), dtoc_bdw=0.3e9, dtoc_cached_bdw=3e9)  # a slow disk, a host's page cache
    ch = Choice(24, 3, cpu_cache_compute=True)
    x = {"wg": 0, "wc": 1, "wd": 0, "cg": 0, "cc": 23 / 24, "cd": 1 / 24, "hg": 1, "hc": 0, "hd": 0}
    cold, cached = CostModel(s, hw, W512, ch), CostModel(s, hw, W512, ch, cached_disk=True)
    kv = 2 * s.num_kv_heads * s.head_dim * 2  # fp16 keys and values per token
    rows = 3 * (512 + 32 / 2) * kv  # one row per GPU batch, at the average context
    # the page cache's rate, where the profile measured it below the engine's cap
    for m, rate in ((cold, hw.dtoc_bdw), (cached, hw.dtoc_cached_bdw)):
        t = m.terms(x)
        own = t[("g", "attn")]["dtoc"] + t[("g", "mlp")]["dtoc"]
        assert m.cache_pool(x, t)["dtoc"] - own == pytest.approx(rows / rate)
    # a profile that read the page cache alone faster than the engine's disk thread gets it
    fast = CostModel(s, replace(hw, dtoc_cached_bdw=3 * PAGE_CACHE_READ_BDW), W512, ch, cached_disk=True)
    t = fast.terms(x)
    own = t[("g", "attn")]["dtoc"] + t[("g", "mlp")]["dtoc"]
    assert fast.cache_pool(x, t)["dtoc"] - own == pytest.approx(rows / PAGE_CACHE_READ_BDW)
    mem = cold.memory(x)
    assert mem["cpu"] + mem["disk"] <= PAGE_CACHE_SHARE * hw.cpu_mem
    assert cold.price(x).decode_s == pytest.approx(cached.evaluate(x).decode_s)
    assert cached.evaluate(x).decode_s < cold.evaluate(x).decode_s
    small = replace(hw, cpu_mem=(mem["cpu"] + mem["disk"]) / PAGE_CACHE_SHARE * 0.99)  # no room left
    assert not CostModel(s, small, W512, ch, cached_disk=True).holds(x)
    assert CostModel(s, small, W512, ch).price(x).decode_s == pytest.approx(cold.evaluate(x).decode_s)
    unmeasured = replace(hw, dtoc_cached_bdw=0.0)
    assert CostModel(s, unmeasured, W512, ch).price(x).decode_s == pytest.approx(cold.evaluate(x).decode_s)
    budget = Budget.of(hw, 16 * 2**30, 90 * 2**30)  # the cache does not fit CPU memory: disk rows
    picks = search(s, hw, W512, budget, shapes=[(24, 3), (32, 2)], cpu_attention="on")[:4]
    alone = search(s, unmeasured, W512, budget, shapes=[(24, 3), (32, 2)], cpu_attention="on")[0]
    on_disk = picks[0].fractions["wd"] + picks[0].fractions["cd"] + picks[0].fractions["hd"]
    assert on_disk > 0 and picks[0].prediction.throughput > alone.prediction.throughput
    for c in picks:
        got = CostModel(s, hw, W512, Choice(c.policy.gpu_batch_size, c.policy.num_gpu_batches,
                                            cpu_cache_compute=True)).price(c.fractions)
        assert got.throughput == pytest.approx(c.prediction.throughput)


def test_profiles_without_the_host_step_still_load(tmp_path):
    import json
    from dataclasses import asdict

    from flexoff.errors import FlexoffError
    from flexoff.policy.hardware import load

    d = asdict(h200())
    del d["host_step_s"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load(str(tmp_path / "old.json")).host_step_s == 0.0
    del d["ctog_bdw"]
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(FlexoffError, match="lacks ctog_bdw"):
        load(str(tmp_path / "bad.json"))


def test_host_step_is_measured_from_the_engine():
    import torch

    from flexoff.profiler import host_step

    t = host_step(torch.device("cpu"))
    assert 1e-6 < t < 0.05  # a tiny model's step: Python and bookkeeping, not arithmetic


def test_whole_rows_rounded_to_the_faster_neighbour():
    """OPT-30B under CPU attention at 24x3, 16 GiB GPU, 100 GiB CPU, the H200 as profiled, and a
    placement with 1.6 rows of each batch's cache on disk (an earlier cost model's LP solution).
    Rounding the row counts down puts two there, and the disk reads then hold up every (attn,
    mlp) pair; the candidate is the fastest rounding that fits (one row on disk), and never
    slower than rounding down."""
    from pathlib import Path

    from flexoff.policy.hardware import load
    from flexoff.policy.search import _candidate, round_policy

    G = 2**30
    hw = load(str(Path(__file__).parents[2] / "benchmarks" / "data" / "h200-measured.json"))
    model = CostModel(spec("opt-30b"), hw, W512, Choice(24, 3, cpu_cache_compute=True))
    budget = Budget(16 * G, 100 * G, 64 * G)
    x = {"wg": 0.0, "wc": 1.0, "wd": 0.0, "cg": 0.1837, "cc": 0.7514, "cd": 0.0649, "hg": 0.0, "hc": 1.0, "hd": 0.0}
    down = model.evaluate(round_policy(x, model.ch)[1])
    cand = _candidate(model, x, budget, None)
    assert cand is not None and cand.prediction.latency < 0.9 * down.latency
    assert cand.policy.cache_disk_percent == pytest.approx(100 / 24)
    for name, m in cand.prediction.memory.items():
        assert m <= getattr(budget, name)
    rows = [p * 24 / 100 for p in (cand.policy.cache_gpu_percent, cand.policy.cache_cpu_percent)]
    assert all(abs(r - round(r)) < 1e-9 for r in rows)


def test_weights_make_room_for_rows_rounded_whole():
    """OPT-30B under CPU attention at 24x3, 16 GiB GPU, 100 GiB CPU, an H100 host as profiled, and
    an LP solution with 1.9 rows of each batch's cache on the GPU and the rest in CPU memory.
    Rounded down, the CPU is over its budget; rounded up, the GPU is. Neither fits as it stands,
    but weights moved between the two make room: the candidate fits, and no placement of the
    weights (GPU and CPU, on a 0.2% grid) over any rounding of the rows that fits is faster."""
    import itertools
    from pathlib import Path

    from flexoff.policy.hardware import load
    from flexoff.policy.search import BUMPS, _candidate, _fit_slots, _fits, round_policy

    G = 2**30
    hw = load(str(Path(__file__).parents[2] / "benchmarks" / "data" / "h100-measured.json"))
    model = CostModel(spec("opt-30b"), hw, W512, Choice(24, 3, cpu_cache_compute=True))
    budget = Budget(16 * G, 100 * G, 64 * G)
    x = {"wg": 0.0935, "wc": 0.9065, "wd": 0.0, "cg": 0.0794, "cc": 0.9206, "cd": 0.0, "hg": 0.0, "hc": 1.0, "hd": 0.0}
    roundings = [round_policy(_fit_slots(model, x, budget), model.ch, {"c": c, "h": h})[1]
                 for c, h in itertools.product(BUMPS, BUMPS)]
    assert not any(_fits(model.memory(f), budget) for f in roundings)
    cand = _candidate(model, x, budget, None)
    assert cand is not None and _fits(cand.prediction.memory, budget)
    best = max(model.price(g).throughput for f in roundings for i in range(0, 1001, 2)
               if _fits(model.memory(g := {**f, "wg": i / 1000, "wc": 1 - i / 1000}), budget) and model.holds(g))
    assert cand.prediction.throughput >= best * (1 - 2e-3)


def test_cpu_attention_is_priced_over_the_attention_and_mlp_pair():
    """With CPU attention and several GPU batches, a decode (attn, mlp) pair takes at least the
    host memory that the link's copies out of it and CPU attention's cache reads move, at the
    profile's host_read_bdw where it measured it, else HOST_READ_OVER_MEMCPY times its
    cpu_mem_bdw, and at least the CPU attention over
    the lane's busy share; neither is added to the attention layer alone. The bytes come from transformers' own OPT decoder layer
    (weights all in CPU memory, the cache all in CPU memory), not from the cost model."""
    import dataclasses
    from pathlib import Path

    import torch
    from transformers import OPTConfig
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    from flexoff.policy.cost_model import CPU_ATTN_CALL_S, CPU_LANE_SHARE, HOST_READ_OVER_MEMCPY
    from flexoff.policy.hardware import load

    s = spec("opt-30b")
    hw = load(str(Path(__file__).parents[2] / "benchmarks" / "data" / "h200-measured.json"))
    cfg = OPTConfig(hidden_size=s.hidden_size, ffn_dim=s.intermediate_size, num_attention_heads=s.num_heads,
                    enable_bias=True)
    with torch.device("meta"):
        layer_bytes = 2 * sum(p.numel() for p in OPTDecoderLayer(cfg).parameters())
    gbs, k, n = 24, 3, W512.gen_len
    bls, ctx, layers = gbs * k, W512.prompt_len + n / 2, s.num_layers
    x = {"wg": 0.0, "wc": 1.0, "wd": 0.0, "cg": 0.0, "cc": 1.0, "cd": 0.0, "hg": 1.0, "hc": 0.0, "hd": 0.0}
    link = layer_bytes + bls * s.hidden_size * 2  # the weights, and attention's outputs coming back
    cache = bls * ctx * 2 * s.hidden_size * 2  # keys and values read by CPU attention

    def pairs(p) -> float:  # decode seconds less the embedding's and the head's own
        return p.decode_s - (n - 1) * sum(max(p.terms[f"g/{kind}"].values()) for kind in ("embed", "head"))

    slow_memory = dataclasses.replace(hw, cpu_mem_bdw=1e9)
    got = CostModel(s, slow_memory, W512, Choice(gbs, k, cpu_cache_compute=True)).evaluate(x)
    assert pairs(got) == pytest.approx((n - 1) * layers * (link + cache) / (HOST_READ_OVER_MEMCPY * 1e9), rel=1e-6)
    assert got.bottleneck == "cpu_mem (attn, mlp pairs)"
    measured = dataclasses.replace(slow_memory, host_read_bdw=2e9)  # the profile measured the two together
    got = CostModel(s, measured, W512, Choice(gbs, k, cpu_cache_compute=True)).evaluate(x)
    assert pairs(got) == pytest.approx((n - 1) * layers * (link + cache) / 2e9, rel=1e-6)

    slow_cpu = dataclasses.replace(hw, cpu_attn_bdw=2e9)
    got = CostModel(s, slow_cpu, W512, Choice(gbs, k, cpu_cache_compute=True)).evaluate(x)
    calls = k * CPU_ATTN_CALL_S  # one per GPU batch
    assert pairs(got) == pytest.approx((n - 1) * layers * (cache / 2e9 + calls) / CPU_LANE_SHARE, rel=1e-6)
    assert got.bottleneck == "cpu_comp (attn, mlp pairs)"
    # one GPU batch: CPU attention runs between that batch's GPU work, in the attention layer
    one = CostModel(s, slow_cpu, W512, Choice(bls, 1, cpu_cache_compute=True)).evaluate(x)
    assert one.decode_s > (n - 1) * layers * cache / 2e9 and "attn layers" in one.bottleneck


def test_searched_policies_fit_the_engines_memory_plan():
    """Every candidate the search offers for OPT-30B under a 16 GiB GPU (weights partly on the
    GPU, the rest streamed through slots that the engine fills from the first tensor a layer's
    GPU share does not hold whole) fits the engine's own plan of the GPU, and the model's GPU
    bytes are the plan's (the search once offered runners-up that needed 16.4-16.6 GiB)."""
    from pathlib import Path

    import torch

    from flexoff.offload.layout import Layout, PlainFormat
    from flexoff.offload.memory import plan_memory
    from flexoff.policy.hardware import load

    G = 2**30
    s = spec("opt-30b")
    hw = load(str(Path(__file__).parents[2] / "benchmarks" / "data" / "h200-measured.json"))
    layouts = [Layout(PlainFormat(torch.float16).fields(l)) for l in s.layers]
    found = search(s, hw, W512, Budget(16 * G, 100 * G, 64 * G))[:10]
    assert any(0 < c.policy.w_gpu_percent < 50 for c in found)  # GPU shares that end inside a tensor
    for cand in found:
        plan = plan_memory(s, layouts, s.kv_bytes_per_token(2), cand.policy, 512, 32, torch.float16, True)
        assert plan.total("gpu") <= 16 * G, cand.policy.describe()
        assert cand.prediction.memory["gpu"] == pytest.approx(plan.total("gpu"), rel=1e-3, abs=2**20)


def test_prefill_priced_at_the_models_matmul_shapes_and_with_its_elementwise_passes():
    """A profile that measured matmuls at layer shapes by hidden size prices a model at the
    nearest size; its elementwise rate prices each layer's norm, residual, activation and head
    moves (counted here by hand for OPT-30B: hidden 7168, MLP 28672, 56 heads of 128)."""
    from dataclasses import replace

    s = spec("opt-30b")
    hw = replace(h200(), mm_flops_p_layers=((4096, 700e12), (7168, 600e12), (12288, 800e12)), gpu_mem_bdw=2e12)
    x = {"wg": 1, "wc": 0, "wd": 0, "cg": 1, "cc": 0, "cd": 0, "hg": 1, "hc": 0, "hd": 0}
    plain, priced = (CostModel(s, h, W512, Choice(8, 2)) for h in (h200(), hw))
    assert priced.mm_p == 600e12 and plain.mm_p == h200().mm_flops_p
    tokens = 16 * 512
    mlp_flops = tokens * 2 * 2 * 7168 * 28672
    mlp_bytes = tokens * 2 * (5 * 7168 + 2 * 28672)  # norm 2h, residual 3h, ReLU 2 x 28672
    attn_bytes = tokens * 2 * (5 * 7168 + 2 * 3 * 7168 + 2 * 7168)  # q, k, v to heads; output back
    t, t0 = priced.terms(x), plain.terms(x)
    assert t[("p", "mlp")]["comp"] == pytest.approx(mlp_flops / 600e12 + mlp_bytes / 2e12)
    assert t[("p", "attn")]["comp"] - t0[("p", "attn")]["comp"] == pytest.approx(
        tokens * 2 * 4 * 7168 * 7168 * (1 / 600e12 - 1 / h200().mm_flops_p) + attn_bytes / 2e12)
    assert t[("g", "mlp")]["comp"] == pytest.approx(16 * 2 * 2 * 7168 * 28672 / h200().mm_flops_g + mlp_bytes / 512 / 2e12)


def test_profiles_keep_the_layer_matmul_table_and_reject_a_bad_one(tmp_path):
    import json
    from dataclasses import asdict, replace

    from flexoff.errors import FlexoffError
    from flexoff.policy.hardware import load

    hw = replace(h200(), mm_flops_p_layers=((4096, 7e14), (8192, 6.5e14)), gpu_mem_bdw=3e12)
    (tmp_path / "p.json").write_text(hw.to_json())
    assert load(str(tmp_path / "p.json")) == hw and hw.prefill_mm_flops(5000) == 7e14
    assert hw.prefill_mm_flops(7168) == 6.5e14
    from flexoff.cli import hardware_table
    assert "4096: 700 TFLOP/s, 8192: 650 TFLOP/s" in hardware_table(hw)  # what `flexoff profile` prints
    d = asdict(hw)
    d["mm_flops_p_layers"] = [[4096, -1]]
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(FlexoffError, match="mm_flops_p_layers"):
        load(str(tmp_path / "bad.json"))


def test_the_profiler_measures_layer_matmuls_and_elementwise_passes():
    from flexoff.policy.hardware import measure

    hw = measure(quick=True)
    assert hw.mm_flops_p_layers and all(h > 0 and f > 1e8 for h, f in hw.mm_flops_p_layers)
    assert hw.dtoc_bdw > 0 and hw.dtoc_cached_bdw > 0  # the file read cold, then from the page cache
    assert hw.gpu_mem_bdw > 1e7
