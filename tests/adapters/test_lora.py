"""LoRA adapters against Hugging Face PEFT on the same weights: per row, greedy tokens equal
PEFT's with that row's adapter active, in mixed batches of several ranks with base rows among
them, across placements (offloaded weights, CPU attention, disk); bad adapters refused in one
line naming the adapter and the field."""

from __future__ import annotations

import gc
import json
import shutil
import threading

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.cli import main
from flexoff.errors import PolicyError
from reference import PROMPTS, make_adapters

peft = pytest.importorskip("peft")

POLICIES = [Policy(gpu_batch_size=5),
            Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=0, w_cpu_percent=100),
            Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu_percent=30, w_cpu_percent=40, cache_gpu_percent=0,
                   cache_cpu_percent=100, cpu_cache_compute=True),
            Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=0, cache_gpu_percent=0, cache_cpu_percent=0,
                   act_gpu_percent=0, act_cpu_percent=0)]
ASSIGN = ["a", None, "b", "c", "a"]  # per prompt of PROMPTS
# kernels on the CPU under Triton's interpreter, in float32 or float64 (the conftest sets it where
# there is no GPU); on a GPU machine Triton takes no CPU tensors, and the GPU's own checks are in tests/gpu
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="runs the kernels under Triton's CPU interpreter")


def peft_greedy(path, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["opt", "llama", "qwen2"])
def test_mixed_adapter_batches_equal_peft(tiny, name, tmp_path):
    path = tiny[name].path
    adapters = make_adapters(path, name, tmp_path)
    want = [peft_greedy(path, adapters[a] if a else None, p, 8) for a, p in zip(ASSIGN, PROMPTS)]
    base = [peft_greedy(path, None, p, 8) for p in PROMPTS]
    assert sum(w != b for w, b in zip(want, base)) >= 3  # the adapters change the outputs
    with LLM(str(path), lora=adapters) as llm:
        for policy in POLICIES:
            llm.policy_arg = policy
            got = llm.generate([{"prompt_ids": p, "adapter": a} for a, p in zip(ASSIGN, PROMPTS)], max_new_tokens=8)
            assert [c.token_ids for c in got.completions] == want, policy.describe()
            assert (llm.engine.lean is not None) == (policy is POLICIES[0])  # resident: the lean path, adapters too
        by_arg = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8, adapters=ASSIGN)
        assert [c.token_ids for c in by_arg.completions] == want


def test_host_copy_is_the_only_copy_where_dtypes_match(tiny, tmp_path):
    """An adapter's tensors become views of the pool's flat host buffer (one host copy) with
    their values unchanged, where they are frozen host tensors of the compute dtype; other
    dtypes keep their own tensors."""
    from flexoff.adapters import load_adapter
    from flexoff.offload.adapters import AdapterPool

    path = tiny["llama"].path
    made = make_adapters(path, "llama", tmp_path)
    with LLM(str(path)) as llm:
        spec = llm.model.spec
    for dtype, shared in ((torch.float32, True), (torch.float64, False)):
        a = load_adapter("a", made["a"], spec)
        a.hold()  # as a trainer holds it (an adapter read from its file has no tensors to share)
        before = {k: (m.A.clone(), m.B.clone()) for k, m in a.modules.items()}
        h = AdapterPool([a], torch.device("cpu"), dtype).host("a")
        lo, hi = h.flat.data_ptr(), h.flat.data_ptr() + h.flat.numel() * h.flat.element_size()
        for k, m in a.modules.items():
            assert torch.equal(m.A, before[k][0]) and torch.equal(m.B, before[k][1])
            assert all((lo <= t.data_ptr() < hi) == shared for t in (m.A, m.B)), (dtype, k)
            s = h.slots[k]
            assert torch.equal(h.flat[s.a_off:s.a_off + m.A.numel()].view_as(m.A), m.A.to(dtype))



@pytest.mark.parametrize("chunk", [1, 300, 1 << 30])
def test_host_copy_is_rewritten_in_chunks_after_the_values_change(tiny, tmp_path, monkeypatch, chunk):
    """An optimizer step changes float32 master weights; the pool's host copy written again in
    chunks of any size (one tensor, a few, all) holds each module's A and B transposed, as a
    copy tensor by tensor makes them."""
    from flexoff.adapters import load_adapter
    from flexoff.offload import adapters as pool_mod

    path = tiny["llama"].path
    made = make_adapters(path, "llama", tmp_path)
    with LLM(str(path)) as llm:
        spec = llm.model.spec
    a = load_adapter("a", made["a"], spec)
    for m in a.hold().values():  # as a trainer holds them: float32 leaves that require grad
        m.A = m.A.detach().to(torch.float32, copy=True).requires_grad_(True)
        m.B = m.B.detach().to(torch.float32, copy=True).requires_grad_(True)
    monkeypatch.setattr(pool_mod, "WRITE_CHUNK", chunk)
    h = pool_mod.AdapterPool([a], torch.device("cpu"), torch.float16).host("a")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in a.modules.values():
            m.A.copy_(torch.randn(m.A.shape, generator=g))
            m.B.copy_(torch.randn(m.B.shape, generator=g))
    h.flat.zero_()
    h.write(a.modules)
    for k, m in a.modules.items():
        s = h.slots[k]
        assert torch.equal(h.flat[s.a_off:s.a_off + m.A.numel()].view_as(m.A), m.A.detach().half())
        got_b = h.flat[s.b_off:s.b_off + m.B.numel()].view(m.B.shape[1], m.B.shape[0])
        assert torch.equal(got_b, m.B.detach().t().half())
    ends = [h.slots[k].b_off + m.B.numel() for k, m in a.modules.items()]
    assert max(ends) == h.flat.numel()  # the modules fill the buffer: nothing left unwritten

def test_a_closed_engine_gives_back_the_adapters_device_room(tiny, tmp_path):
    """The adapters' device buffers belong to the engine whose plan counted them: a job without
    adapters on a new engine does not carry them, and the next job with adapters reserves again
    and gives the same tokens."""
    path = tiny["opt"].path
    adapters = make_adapters(path, "opt", tmp_path)
    job = [{"prompt_ids": p, "adapter": a} for a, p in zip(ASSIGN, PROMPTS)]
    with LLM(str(path), lora=adapters, policy=POLICIES[1]) as llm:
        first = [c.token_ids for c in llm.generate(job, max_new_tokens=4).completions]
        pool = llm.adapter_pool()
        assert pool.device_bytes() > 0
        llm.drop_engine()
        assert pool.device_bytes() == 0
        assert [c.token_ids for c in llm.generate(job, max_new_tokens=4).completions] == first
        assert pool.device_bytes() > 0


def six_adapters_counted(tiny, tmp_path, monkeypatch):
    """Six PEFT folders (make_adapters' three, and the same values again under other names) for
    the tiny LLaMA: its path, the folders by name, a prompt, the names sorted, each of a, b and
    c's PEFT tokens for the prompt, and two lists each file read appends to: the adapter's name,
    the reading thread's."""
    from flexoff.adapters import peft as peft_files

    path = tiny["llama"].path
    made = make_adapters(path, "llama", tmp_path)
    for k in "abc":
        shutil.copytree(made[k], tmp_path / f"{k}2")
        made[f"{k}2"] = str(tmp_path / f"{k}2")
    prompt = PROMPTS[0]
    want = {n: peft_greedy(path, made[n], prompt, 6) for n in ("a", "b", "c")}
    reads: list[str] = []
    threads: list[str] = []
    real = peft_files._read_safetensors

    def counted(file, where, named):
        reads.append(file.parent.name)
        threads.append(threading.current_thread().name)
        return real(file, where, named)

    monkeypatch.setattr(peft_files, "_read_safetensors", counted)
    return path, made, prompt, sorted(made), want, reads, threads


def fake_pinning(monkeypatch) -> dict[int, int]:
    """Host copies pinned as for a GPU, the pinning faked: what is pinned now, address -> bytes."""
    from flexoff.offload import adapters as pool_mod
    from flexoff.offload import tiers

    registered: dict[int, int] = {}
    monkeypatch.setattr(pool_mod, "pins", lambda device: True)
    monkeypatch.setattr(tiers, "_host_register", lambda t: registered.__setitem__(t.data_ptr(), t.numel()))
    monkeypatch.setattr(tiers, "_host_unregister", lambda t: registered.pop(t.data_ptr()))
    return registered


@pytest.mark.parametrize("pinned,readers", [(False, 1), (True, 1), (True, 2)],
                         ids=["unpinned", "pinned", "pinned-two-readers"])
@pytest.mark.parametrize("policy", POLICIES[:2], ids=["resident", "streamed"])
def test_adapters_are_read_from_their_files_into_a_cache_of_two_blocks(tiny, tmp_path, monkeypatch, policy, pinned,
                                                                       readers):
    """Six adapters from PEFT folders, a job of blocks of one adapter each: every row's tokens
    equal PEFT's with its adapter; each file is read once per job, a block's while the block
    before it runs (by `readers` threads, READ_THREADS); host memory keeps at most two blocks'
    adapters (and the plan counts only those). Pinned (as for a GPU; pinning faked): the host
    copies take runs of one arena of the cache's room, never sharing a byte, and a copy pinned
    on its own is unpinned once dropped."""
    from flexoff.offload import adapters as pool_mod
    from flexoff.offload import tiers

    monkeypatch.setattr(pool_mod, "READ_THREADS", readers)
    registered = fake_pinning(monkeypatch) if pinned else {}
    path, made, prompt, names, want, reads, threads = six_adapters_counted(tiny, tmp_path, monkeypatch)
    job = [{"prompt_ids": prompt, "adapter": n} for n in names for _ in range(policy.gpu_batch_size)]
    with LLM(str(path), lora=made, policy=policy.replace(num_gpu_batches=1)) as llm:
        assert not any(a.held for a in llm.adapters.values()) and reads == []  # checked from headers alone
        got = llm.generate(job, max_new_tokens=6).completions
        assert [c.token_ids for c in got] == [want[r["adapter"][0]] for r in job]
        assert sorted(reads) == names  # each adapter read once
        # the first block's read when it began (by the readers' pool, if several), each later
        # one's while the block before it ran
        assert threads[0] == threading.current_thread().name if readers == 1 else \
            threads[0].startswith("flexoff-adapters-read")
        assert all(t.startswith("flexoff-adapters") for t in threads[1:])
        pool = llm.adapter_pool()
        assert pool.reads.adapters == len(names) and pool.reads.read_s > 0  # every read counted
        need = llm.engine.adapter_need
        assert need.adapters == 1 and pool.cache_elements == 2 * need.elements and need.largest == need.elements
        kept = list(pool._host)  # the last blocks' adapters, as many as the room takes
        assert kept[-1] == names[-1] and len(kept) < len(names)
        assert sum(pool._host[n].numel for n in kept) <= pool.cache_elements
        everything = sum(a.numel for a in llm.adapters.values()) * llm.dtype.itemsize
        # two blocks' room and the largest adapter's (the arena's runs go round it as a ring)
        assert llm.adapter_host_bytes(need) == 3 * need.elements * llm.dtype.itemsize < everything
        if pinned:
            region = pool.arena.region
            lo, hi = region.buf.data_ptr(), region.buf.data_ptr() + region.nbytes
            assert region.nbytes < 3 * need.elements * llm.dtype.itemsize + 4 * tiers.PinnedArena.ALIGN
            spans = sorted((h.flat.data_ptr(), h.flat.data_ptr() + h.flat.numel() * h.flat.element_size())
                           for h in pool._host.values())
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no byte shared
            alone = [s for s in spans if not lo <= s[0] < hi]  # pinned on their own: still registered
            assert pool.arena.taken > 0 and {s[0] for s in alone} <= set(registered)
            leased = sum(h.lease[2] for h in pool._host.values() if h.lease is not None)
            assert leased + sum(n for _, n, _ in region.free) == region.nbytes  # dropped runs came back
            gc.collect()
            assert len(registered) == 1 + len(alone)  # the region and the live ones; dropped ones unpinned


@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize("policy", POLICIES[:2], ids=["resident", "streamed"])
def test_a_cache_of_one_block_reads_what_the_room_leaves_when_its_block_begins(tiny, tmp_path, monkeypatch, policy,
                                                                              pinned):
    """A policy whose host cache keeps one block's adapters read from files (lora_cache_blocks=1):
    every row's tokens equal PEFT's; each file is read once, while the block before runs exactly
    where it fits beside that block's in the room, else when its own block begins (the block
    waits, counted in Reads); the cache never holds more than its room, and the plan counts one
    block's bytes. Pinned (faked): one arena of that room, no copy pinned on its own."""
    from flexoff.offload import adapters as pool_mod
    from flexoff.offload import tiers

    registered = fake_pinning(monkeypatch) if pinned else {}
    path, made, prompt, names, want, reads, threads = six_adapters_counted(tiny, tmp_path, monkeypatch)
    held: list[int] = []  # elements the cache holds after each copy kept
    keep = pool_mod.AdapterPool._keep

    def kept(self, h):
        out = keep(self, h)
        held.append(sum(c.numel for n, c in self._host.items() if not self.adapters[n].held))
        return out

    monkeypatch.setattr(pool_mod.AdapterPool, "_keep", kept)
    job = [{"prompt_ids": prompt, "adapter": n} for n in names for _ in range(policy.gpu_batch_size)]
    with LLM(str(path), lora=made, policy=policy.replace(num_gpu_batches=1, lora_cache_blocks=1)) as llm:
        got = llm.generate(job, max_new_tokens=6).completions
        assert [c.token_ids for c in got] == [want[r["adapter"][0]] for r in job]
        assert reads == names  # each adapter read once, in the blocks' order
        pool, need = llm.adapter_pool(), llm.engine.adapter_need
        size = {n: llm.adapters[n].numel for n in names}
        room = need.elements
        assert pool.cache_elements == room == max(size.values()) and max(held) <= room
        # the next block's read ahead where it fits beside the running block's, else as it begins
        ahead = [False] + [size[p] + size[n] <= room for p, n in zip(names, names[1:])]
        assert True in ahead and False in ahead[1:]  # the sizes give both cases
        assert [t.startswith("flexoff-adapters") for t in threads] == ahead
        assert pool.reads.adapters == len(names) and pool.reads.waited_s > 0
        assert llm.adapter_host_bytes(need, 1) == (room + need.largest) * llm.dtype.itemsize
        if pinned:
            region = pool.arena.region
            assert region.nbytes <= (room + need.largest) * llm.dtype.itemsize + 2 * tiers.PinnedArena.ALIGN
            assert pool.arena.pinned == 0 and len(registered) == 1  # the region alone


def test_held_adapters_are_pinned_apart_from_the_arena_of_those_read_from_files(tiny, tmp_path, monkeypatch):
    """The arena is sized for the copies of adapters read from files; a held adapter's copy
    (never dropped) is pinned on its own, so it takes none of that room. Each copy holds its
    adapter's values (pinning faked)."""
    from flexoff.adapters import load_adapter
    from flexoff.offload import adapters as pool_mod
    from flexoff.offload import tiers

    monkeypatch.setattr(pool_mod, "pins", lambda device: True)
    monkeypatch.setattr(tiers, "_host_register", lambda t: None)
    monkeypatch.setattr(tiers, "_host_unregister", lambda t: None)
    path = tiny["llama"].path
    made = make_adapters(path, "llama", tmp_path)
    with LLM(str(path)) as llm:
        spec = llm.model.spec
    held, files = load_adapter("a", made["a"], spec), [load_adapter(n, made[n], spec) for n in ("b", "c")]
    held.hold()
    pool = pool_mod.AdapterPool([held, *files], torch.device("cpu"), torch.float16, spec)
    pool.keep_for(pool.need([["a", "b"], ["c"]]))
    region = pool.arena.region
    # the file-read adapters' room (both fit in two blocks' worth), each run's alignment more
    assert region.nbytes <= sum(f.numel for f in files) * 2 + (pool_mod.CACHE_BLOCKS + 1) * 2 * tiers.PinnedArena.ALIGN
    for name, a in (("a", held), ("b", files[0]), ("c", files[1])):
        h = pool.host(name, keep=("a", "b", "c"))
        inside = region.buf.data_ptr() <= h.flat.data_ptr() < region.buf.data_ptr() + region.nbytes
        assert inside == (name != "a") and (h.lease is None) == (name == "a")
        for k, m in a.modules.items():
            sl = h.slots[k]
            assert torch.equal(h.flat[sl.a_off:sl.a_off + m.A.numel()].view_as(m.A), m.A.half())
    assert pool.arena.pinned == 1 and pool.arena.taken == 2


def test_an_adapter_file_gone_or_changed_after_loading_is_a_one_line_error(tiny, tmp_path):
    """Adapters are read when a block uses them (the next block's in a thread): a file removed
    or replaced by another rank's after loading fails the job with one line naming the adapter,
    raised in the caller's thread, and the blocks before it were answered."""
    from flexoff.errors import InputError

    path = tiny["llama"].path
    job = [{"prompt_ids": PROMPTS[0], "adapter": n} for n in ("a", "b", "c")]
    for broken, why in (("c", "cannot read its weights"), ("b", "changed since it was loaded")):
        made, done = make_adapters(path, "llama", tmp_path / broken), []
        with LLM(str(path), lora=made, policy=Policy(gpu_batch_size=1)) as llm:
            target = tmp_path / broken / broken / "adapter_model.safetensors"
            if broken == "c":
                target.unlink()
            else:  # the same weights cut to a smaller rank
                from safetensors.torch import load_file, save_file

                cut = {k: (t[:2] if ".lora_A." in k else t[:, :2]).contiguous() for k, t in load_file(target).items()}
                save_file(cut, target)
            with pytest.raises(InputError) as e:
                llm.generate(job, max_new_tokens=2, on_block=lambda comps, st: done.extend(comps))
        msg = str(e.value)
        assert f"adapter {broken!r}" in msg and why in msg and "\n" not in msg
        assert len(done) == "abc".index(broken)  # the blocks before the broken adapter's were answered


def test_a_name_loaded_again_serves_the_new_adapter(tiny, tmp_path):
    """load_lora under a name already loaded replaces that adapter for the next jobs."""
    path = tiny["llama"].path
    made = make_adapters(path, "llama", tmp_path)
    job = [{"prompt_ids": PROMPTS[2], "adapter": "x"}]
    with LLM(str(path), lora={"x": made["a"]}) as llm:
        first = llm.generate(job, max_new_tokens=6).completions[0].token_ids
        llm.load_lora("x", made["b"])
        second = llm.generate(job, max_new_tokens=6).completions[0].token_ids
    assert first == peft_greedy(path, made["a"], PROMPTS[2], 6)
    assert second == peft_greedy(path, made["b"], PROMPTS[2], 6) != first


def test_cli_lora_flags_and_the_adapter_field(tiny, tmp_path, capsys):
    path = tiny["llama"].path
    adapters = make_adapters(path, "llama", tmp_path / "dir")
    inp, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt_ids": p, **({"adapter": a} if a else {})}) + "\n"
                           for i, (a, p) in enumerate(zip(ASSIGN, PROMPTS))))
    assert main(["run", "--model", str(path), "--input", str(inp), "--output", str(out), "-q", "--lora-dir",
                 str(tmp_path / "dir"), "--max-new-tokens", "8"]) == 0, capsys.readouterr().err
    got = {json.loads(l)["id"]: json.loads(l) for l in out.read_text().splitlines()}
    for i, (a, p) in enumerate(zip(ASSIGN, PROMPTS)):
        ids = got[str(i)]
        assert ids["completion_tokens"] == 8
    out2 = tmp_path / "o2.jsonl"
    assert main(["run", "--model", str(path), "--input", str(inp), "--output", str(out2), "-q", "--lora",
                 f"a={adapters['a']}", "--lora", f"b={adapters['b']}", "--lora", f"c={adapters['c']}",
                 "--max-new-tokens", "8"]) == 0
    assert [json.loads(l)["completion"] for l in out2.read_text().splitlines()] == \
        [json.loads(l)["completion"] for l in out.read_text().splitlines()]


def test_bad_adapters_are_one_line_exit_2(tiny, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny["llama"].path
    good = make_adapters(path, "llama", tmp_path / "good")["a"]

    def variant(name: str, change) -> str:
        d = tmp_path / name
        shutil.copytree(good, d)
        change(d)
        return str(d)

    def cfg_set(**kw):
        def change(d):
            c = json.loads((d / "adapter_config.json").read_text())
            c.update(kw)
            (d / "adapter_config.json").write_text(json.dumps(c))
        return change

    emb = tmp_path / "emb"
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=2, target_modules=["embed_tokens"],
                                                                          init_lora_weights=False)).save_pretrained(emb)
    other = tmp_path / "other"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny["opt"].path),
                   LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(other)
    cases = {
        "use_dora": variant("dora", cfg_set(use_dora=True)),
        "modules_to_save": variant("mts", cfg_set(modules_to_save=["lm_head"])),
        "embedding": str(emb),
        "not a linear layer of this base model": str(other),
        "adapter_model.safetensors": variant("nofile", lambda d: (d / "adapter_model.safetensors").unlink()),
        "adapter_config.json": str(tmp_path / "missing"),
        "peft_type": variant("ia3", cfg_set(peft_type="IA3")),
    }
    inp, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"prompt_ids": [1, 2], "adapter": "x"}\n')
    out.write_text('{"id": "old"}\n')
    capsys.readouterr()  # what making the adapters printed
    for says, adapter in cases.items():
        code = main(["run", "--model", str(path), "--input", str(inp), "--output", str(out), "-q", "--lora",
                     f"x={adapter}"])
        err = capsys.readouterr().err
        assert code == 2 and says in err and "'x'" in err and len(err.strip().splitlines()) == 1, (says, err)
    code = main(["run", "--model", str(path), "--input", str(inp), "--output", str(out), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown adapter 'x'" in err
    assert out.read_text() == '{"id": "old"}\n'


def test_ppl_and_eval_use_an_adapter(tiny, tmp_path, capsys):
    """`flexoff ppl --lora` scores with PEFT's log-probabilities; an eval run entry's adapter=NAME
    sends its requests through that adapter."""
    import math

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny["llama"].path
    adapters = make_adapters(path, "llama", tmp_path / "ad")
    text = tmp_path / "t.txt"
    text.write_text("a short text to score, " * 4)
    with LLM(str(path)) as llm:
        ids = llm.tokenizer.encode(text.read_text())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path).float(), adapters["b"]).eval()
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
    want = math.exp(-float(lp.gather(1, torch.tensor(ids[1:])[:, None]).mean()))
    capsys.readouterr()
    assert main(["ppl", "--model", str(path), "--text", str(text), "--lora", adapters["b"]]) == 0
    got = float(capsys.readouterr().out.strip().splitlines()[-1].split()[-1])
    assert abs(got - want) < 1e-3 * want

    pytest.importorskip("helm.benchmark.runner", reason="the eval extra (crfm-helm) is not installed")
    out = tmp_path / "ev"
    entry = "synthetic_reasoning:mode=pattern_match"
    for extra in ([], ["--lora", f"b={adapters['b']}"]):
        e = entry + (",adapter=b" if extra else "")
        assert main(["eval", "run", "--run-entries", e, "--model", str(path), "--output-path", str(out), "-q",
                     "--local-path", str(tmp_path / "prod_env"), "--max-eval-instances", "4", *extra]) == 0, \
            capsys.readouterr().err
    runs = {d.name: d for d in (out / "runs" / "default").iterdir() if d.name.startswith("synthetic")}
    with_adapter = [d for n, d in runs.items() if n.endswith(",adapter=b")]
    assert len(runs) == 2 and len(with_adapter) == 1
    states = json.loads((with_adapter[0] / "scenario_state.json").read_text())["request_states"]
    req = states[0]["request"]
    with LLM(str(path), lora={"b": adapters["b"]}) as llm:  # the adapter's own generation, directly
        want = llm.generate([s["request"]["prompt"] for s in states], adapters=["b"] * len(states),
                            max_new_tokens=req["max_tokens"], temperature=0.0, stop=req["stop_sequences"])
    assert [c.text for c in want.completions] == [s["result"]["completions"][0]["text"] for s in states]
    capsys.readouterr()
    code = main(["eval", "run", "--run-entries", entry + ",adapter=zz", "--model", str(path), "--output-path",
                 str(out), "-q", "--local-path", str(tmp_path / "prod_env"), "--max-eval-instances", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "adapter=zz" in err and len(err.strip().splitlines()) == 1


def test_adapters_are_counted_by_the_plan_and_the_cost_model(tiny, tmp_path, capsys):
    import math
    from dataclasses import replace

    from flexoff.dummy import dummy_config
    from flexoff.models.spec import ModelSpec
    from flexoff.policy.cost_model import Choice, CostModel, Workload
    from flexoff.policy.hardware import h200

    path = tiny["llama"].path
    adapters = make_adapters(path, "llama", tmp_path)
    with LLM(str(path), lora=adapters) as llm:
        b = llm.adapters["b"]
        host = sum(a.numel for a in llm.adapters.values()) * 4  # float32 on this CPU
        llm.generate([{"prompt_ids": [1, 2, 3], "adapter": "b"}], max_new_tokens=2)
        pool = llm.adapter_pool()
        # resident weights: the block's one adapter on the device; in host memory the cache of
        # adapters read from files, room for two blocks' (here more than all three take)
        assert 2 * b.numel * 4 > host
        assert llm.engine.plan.parts["adapters"] == {"gpu": b.numel * 4, "cpu": host, "disk": 0}
        assert pool._buf.numel() == b.numel and not pool.paged
        llm.policy_arg = Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=100)
        llm.generate([{"prompt_ids": [1, 2, 3], "adapter": "b"}, {"prompt_ids": [4, 5], "adapter": "a"}],
                     max_new_tokens=2)
        per_layer = {}
        for name in ("a", "b"):
            for (j, _), m in llm.adapters[name].modules.items():
                per_layer[j] = per_layer.get(j, 0) + m.A.numel() + m.B.numel()
        slots = len(llm.engine.weights.slots)
        # streamed weights: a page per weight slot, as large as the block's largest layer of LoRA
        assert llm.engine.plan.parts["adapters"]["gpu"] == slots * max(per_layer.values()) * 4
        assert pool.paged and [t.numel() for t in pool._slots] == [max(per_layer.values())] * slots
    spec = ModelSpec.from_config("dummy:llama-7b", dummy_config("llama-7b"))
    width = sum(sum(t.shape) for l in spec.layers if l.kind in ("attn", "mlp") for t in l.tensors if t.matmul)
    x = {"wg": 1, "wc": 0, "wd": 0, "cg": 1, "cc": 0, "cd": 0, "hg": 1, "hc": 0, "hd": 0}
    plain = CostModel(spec, h200(), Workload(512, 32, num_prompts=8), Choice(8, 1))
    lora = CostModel(spec, h200(), Workload(512, 32, num_prompts=8, lora_ranks=(8, 16, 64)), Choice(8, 1))
    assert lora.memory(x)["gpu"] - plain.memory(x)["gpu"] == (8 + 16 + 64) * width * 2  # one block: its adapters
    mlp_width = sum(sum(t.shape) for t in spec.layers[2].tensors if t.matmul)
    extra = lora.terms(x)[("g", "mlp")]["comp"] - plain.terms(x)[("g", "mlp")]["comp"]
    assert math.isclose(extra, 8 * 2 * (88 / 3) * mlp_width / h200().mm_flops_g)
    # 300 prompts grouped by adapter: a block of 8 uses 2 of the 3 adapters, and the next block's
    # are staged beside them; streamed weights bring their pages of each layer over the link, and
    # the GPU holds one page per weight slot
    grouped = CostModel(spec, h200(), Workload(512, 32, num_prompts=300, lora_ranks=(8, 16, 64)), Choice(8, 1))
    plain_n = CostModel(spec, h200(), Workload(512, 32, num_prompts=300), Choice(8, 1))
    assert math.isclose(grouped.memory(x)["gpu"] - plain_n.memory(x)["gpu"], 2 * 2 * 88 / 3 * width * 2)
    xs = {**x, "wg": 0, "wc": 1}
    assert math.isclose(grouped.memory(xs)["gpu"] - plain_n.memory(xs)["gpu"],
                        grouped.slots * 2 * 88 / 3 * mlp_width * 2)
    link = grouped.terms(xs)[("g", "mlp")]["ctog"] - plain_n.terms(xs)[("g", "mlp")]["ctog"]
    assert math.isclose(link, 2 * 88 / 3 * mlp_width * 2 / h200().ctog_bdw)
    # every adapter of the job in host memory where they are held, as the engine's plan counts them
    assert math.isclose(grouped.memory(xs)["cpu"] - plain_n.memory(xs)["cpu"], 88 * width * 2)
    # thirty adapters read from files: host memory for two blocks' of them (two a block) and the
    # largest one's more, held ones all
    for held, host_ranks in ((0.0, 2 * 2 * 88 / 3 + 64), (88.0, 88 + 2 * 2 * 88 / 3 + 64), (None, 880)):
        files = CostModel(spec, h200(), Workload(512, 32, num_prompts=300, lora_ranks=(8, 16, 64) * 10,
                                                 lora_held=held), Choice(8, 1))
        assert math.isclose(files.memory(xs)["cpu"] - plain_n.memory(xs)["cpu"], host_ranks * width * 2)
    # the host work LoRA adds to each step of each GPU batch (measured by the profiler)
    hw = replace(h200(), host_step_s=1e-3, lora_host_step_s=4e-4)
    steps = CostModel(spec, hw, Workload(512, 32, lora_ranks=(8,)), Choice(8, 3)).terms(xs)[("g", "mlp")]["host"]
    none = CostModel(spec, hw, Workload(512, 32), Choice(8, 3)).terms(xs)[("g", "mlp")]["host"]
    assert math.isclose(steps, 3 * 1.4e-3) and math.isclose(none, 3 * 1e-3)
    code = main(["policy", "search", "--model", "dummy:llama-7b", "--prompt-len", "512", "--gen-len", "32",
                 "--hardware", "h200", "--gpu-mem", "80GiB", "--lora-ranks", "8,16", "--lora-adapters", "4"])
    out = capsys.readouterr().out
    block = math.prod(int(n) for n in out.split("policy", 1)[1].split()[0].split("x"))  # e.g. 64x2
    used = min(4, block)  # adapters of mean rank 12 (8 and 16, two each); a block's rows use at most 4
    gib = used * 12 * width * 2 / 2**30
    assert code == 0 and f"a block uses {used}: {gib:.2f} GiB on the GPU (as much again" in out
    for bad in (["--lora-ranks", "8,x"], ["--lora-ranks", "0"], ["--lora-adapters", "3"]):
        code = main(["policy", "search", "--model", "dummy:llama-7b", "--prompt-len", "8", "--gen-len", "2",
                     "--hardware", "h200", *bad])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1


def test_a_job_short_of_host_memory_plans_a_cache_of_one_block():
    """Adapters read from files, a host cache of one block's (lora_cache_blocks=1): host memory
    for one block's adapters instead of two, and each later block's reads (at the disk's rate)
    before its prefill. OPT-30B with 14 adapters at 16 GiB GPU / 100 GiB CPU: two blocks' would
    push the KV cache to disk, so the search plans one, faster than any plan keeping two."""
    import math

    from flexoff.checkpoint import load_model
    from flexoff.policy.cost_model import Choice, CostModel, Workload, lora_cache_options
    from flexoff.policy.hardware import h200
    from flexoff.policy.search import Budget, search

    spec, hw = load_model("dummy:opt-30b").spec, h200()
    width = sum(sum(t.shape) for l in spec.layers if l.kind in ("attn", "mlp") for t in l.tensors if t.matmul)
    ranks = (8, 16, 8, 64, 8, 32, 32, 8, 8, 64, 16, 8, 64, 16)  # mean 25.14; a block of 72 of 144 rows uses 8
    work = Workload(512, 32, 2, 144, ranks, lora_held=0.0)
    x = {"wg": 0, "wc": 1, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 1, "hc": 0, "hd": 0}
    two, one = (CostModel(spec, hw, work, Choice(24, 3, cpu_cache_compute=True, lora_cache_blocks=b)) for b in (2, 1))
    block = 8 * sum(ranks) / 14 * width * 2  # bytes of a block's adapters
    # two blocks' room holds all 14 adapters (fewer than 16), one block's room a block's 8 and
    # the largest (rank 64) more
    assert math.isclose(two.memory(x)["cpu"] - one.memory(x)["cpu"], (sum(ranks) - 64) * width * 2 - block)
    # the second of the job's two blocks reads its adapters before its prefill
    assert math.isclose(one.evaluate(x).prefill_s - two.evaluate(x).prefill_s, block / hw.dtoc_bdw / 2)
    assert lora_cache_options(work, 72) == (2, 1)
    for other in (Workload(512, 32, 2, 144, ranks), Workload(512, 32, 2, 72, ranks, lora_held=0.0)):
        assert lora_cache_options(other, 72) == (2,)  # held adapters, or a job of one block: two blocks' room
    cands = search(spec, hw, work, Budget.of(hw, 16 * 2**30, 100 * 2**30))
    best = cands[0]
    assert best.policy.lora_cache_blocks == 1 and "lora cache 1 block" in best.policy.describe()
    assert best.prediction.throughput > max(c.prediction.throughput for c in cands if c.policy.lora_cache_blocks == 2)
    assert Policy.from_dict(best.policy.to_dict()) == best.policy
    with pytest.raises(PolicyError, match="lora_cache_blocks"):
        Policy(lora_cache_blocks=0)


def test_adapters_on_compressed_base_weights_equal_peft_on_the_same_values(tiny, tmp_path):
    """4-bit base weights with 16-bit adapters: PEFT on a copy whose linear weights hold the same
    dequantized 4-bit values (flexoff compresses output channels in groups of 64)."""
    from transformers import AutoModelForCausalLM

    from flexoff.quant import QuantConfig, dequantize, quantize

    path = tiny["llama"].path
    adapters = make_adapters(path, "llama", tmp_path / "ad")
    base = AutoModelForCausalLM.from_pretrained(path).float()
    cfg = QuantConfig(4, 64, dim=0)
    with torch.no_grad():
        for n, mod in base.named_modules():
            if isinstance(mod, torch.nn.Linear) and n.split(".")[-1] != "embed_tokens":
                mod.weight.copy_(dequantize(quantize(mod.weight, cfg)))
    base.save_pretrained(tmp_path / "fq")
    want = [peft_greedy(tmp_path / "fq", adapters[a] if a else None, p, 8) for a, p in zip(ASSIGN, PROMPTS)]
    with LLM(str(path), lora=adapters) as llm:
        for policy in (Policy(gpu_batch_size=5, compress_weight=True),
                       Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=0, w_cpu_percent=100,
                              compress_weight=True)):
            llm.policy_arg = policy
            got = llm.generate([{"prompt_ids": p, "adapter": a} for a, p in zip(ASSIGN, PROMPTS)], max_new_tokens=8)
            assert [c.token_ids for c in got.completions] == want, policy.describe()


@pytest.mark.parametrize("policy", [Policy(gpu_batch_size=3, num_gpu_batches=2),
                                    Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100,
                                           stash_gpu_percent=0, stash_cpu_percent=100)],
                         ids=["resident", "offloaded"])
def test_training_sweep_lora_gradients_equal_peft_autograd(tiny, tmp_path, policy):
    """The reverse sweep's gradients for each adapter's A and B (float64) equal autograd through
    PEFT with that adapter active, over the rows that use it (base rows and other adapters' rows in
    the same batches)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flexoff.adapters import load_adapter
    from flexoff.offload.adapters import AdapterPool
    from flexoff.offload.block import IGNORE
    from flexoff.offload.engine import Engine
    from reference import train_batches

    path = tiny["llama"].path
    made = make_adapters(path, "llama", tmp_path)
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]
    rows = [["a", None, "b"], ["b", "a", None]]
    batches = train_batches(3, prompts)
    for b, names in zip(batches, rows):
        b.adapters = names
    total = sum(int((b.labels != IGNORE).sum()) for b in batches)
    with LLM(str(path)) as llm:
        m = llm.model
        adapters = [load_adapter(n, made[n], m.spec) for n in ("a", "b")]
        pool = AdapterPool(adapters, torch.device("cpu"), torch.float64)
        e = Engine(m.family, m.spec, policy, device=torch.device("cpu"), dtype=torch.float64, max_prompt=16,
                   max_gen=1, training=True, adapter_need=pool.need([[a for b in batches for a in b.adapters]]))
        try:
            e.load_weights((j, m.source.layer(j, lay, torch.float64, e.device)) for j, lay in enumerate(m.spec.layers))
            e.adapters = pool
            got = e.run_train(batches)
        finally:
            e.close()
    names = {t.hf_names[0][:-len(".weight")]: (j, t.name) for j, lay in enumerate(m.spec.layers)
             for t in lay.tensors if t.matmul}
    for name in ("a", "b"):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path).double(), made[name],
                                          is_trainable=True)
        loss = 0
        for b, ad in zip(batches, rows):
            sel = [r for r, a in enumerate(ad) if a == name]
            mask = b.valid[sel].long()
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=b.ids[sel], attention_mask=mask, position_ids=pos).logits
            loss = loss + torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.labels[sel].flatten(),
                                                            ignore_index=IGNORE, reduction="sum") / total
        loss.backward()
        pairs = []
        for pname, prm in model.named_parameters():
            if "lora_" not in pname:
                continue
            module = pname.split("base_model.model.", 1)[1].rsplit(".lora_", 1)[0]
            key = names[module]
            gA, gBt = got.lora_grads[key][name]
            pairs.append((pname, gA if ".lora_A." in pname else gBt.t(), prm.grad))
        scale = max(float(ref.abs().max()) for _, _, ref in pairs)  # the adapter's largest gradient
        for pname, mine, ref in pairs:
            assert float((mine - ref).abs().max()) <= 1e-9 * scale, pname
        assert len(pairs) >= 6


def brute_linears(x, w, b, keys, outs, blk, adapters) -> torch.Tensor:
    """x @ w.T + b for projections stacked in w (keys, widths outs), plus each row's adapter's
    scaling * (x @ A.T) @ B.T from its modules (blk: the rows' adapter names, None: the base)."""
    want = torch.nn.functional.linear(x, w, b)
    for r, name in enumerate(blk):
        c0 = 0
        for key, n in zip(keys, outs):
            m = adapters[name].modules.get(key) if name else None
            if m is not None:
                want[r, :, c0:c0 + n] += m.scaling * (x[r] @ m.A.t()) @ m.B.t()
            c0 += n
    return want


@INTERPRETED
@pytest.mark.skipif(not __import__("flexoff.kernels.lora", fromlist=["HAVE_TRITON"]).HAVE_TRITON,
                    reason="triton is not installed")
@pytest.mark.parametrize("batched,segments", [(False, "expand"), (True, "expand"), (True, "both")])
def test_resident_pool_computes_deltas_as_each_adapter_would(batched, segments, monkeypatch):
    """A resident pool lays each matmul's adapters out as rank lanes (q, k and v side by side, so
    one matmul shrinks onto all three): decode rows through them (lora_linears' dense way) equal
    x @ w.T + b plus each row's own adapter's delta from its modules, for adapters of mixed ranks
    that adapt different matmuls, base rows, blocks of a row per token and of three, a block
    that leaves a cached adapter it does not use beside its own (whose index that adapter had
    before), and one that empties the cache; the plan's lanes per matmul are the most any
    block's adapters take there. Prefill rows (20 tokens, no bias) go by segments of one
    adapter through cuBLAS (`segments`: after the Triton shrink, or with cuBLAS's shrinks),
    projections of equal ranks and widths (gate and up) as one batched matmul."""
    from types import SimpleNamespace

    from flexoff.adapters.peft import Adapter, LoraModule
    from flexoff.checkpoint import load_model
    from flexoff.kernels import lora as L
    from flexoff.offload.adapters import AdapterPool

    monkeypatch.setattr(L, "BATCHED_EXPAND", batched)
    monkeypatch.setattr(L, "SEGMENTS", segments)
    monkeypatch.setattr(L, "SEGMENT_TOKENS", 1)
    calls = {"segments": 0, "grouped": 0}
    real_segments, real_spaced = L._segment_deltas, L._spaced

    def segmented(*a, **k):
        calls["segments"] += 1
        return real_segments(*a, **k)

    def spaced(ts):
        got = real_spaced(ts)
        calls["grouped"] += got is not None and len(ts[0]) > 0 and ts[0].shape[1] == 160  # gate and up's B
        return got

    monkeypatch.setattr(L, "_segment_deltas", segmented)
    monkeypatch.setattr(L, "_spaced", spaced)
    spec = load_model("dummy:llama-tiny").spec  # grouped KV heads: k and v narrower than q
    g = torch.Generator().manual_seed(0)
    mats = [(j, t.name, t.shape) for j, lay in enumerate(spec.layers) if lay.kind in ("attn", "mlp")
            for t in lay.tensors if t.matmul]

    def adapter(name, rank_of):
        mods = {(j, n): LoraModule(torch.randn(rank_of(j, n), fin, generator=g, dtype=torch.float64),
                                   torch.randn(fout, rank_of(j, n), generator=g, dtype=torch.float64), 0.5 + j / 8)
                for j, n, (fout, fin) in mats if rank_of(j, n)}
        return Adapter(name, "", mods)

    adapters = {"a": adapter("a", lambda j, n: 3), "b": adapter("b", lambda j, n: 0 if n == "v_proj.weight" else 8),
                "c": adapter("c", lambda j, n: 1 + (j + len(n)) % 5),
                "d": adapter("d", lambda j, n: 16 if n[0] in "qd" else 2)}
    pool = AdapterPool(list(adapters.values()), torch.device("cpu"), torch.float64, spec)
    blocks = [["a", "b", None, "b", "a"], ["b", None, "b"], ["c", "d", None, "c"], ["d", "a"]]
    need = pool.need(blocks)
    lanes = {}
    for blk in blocks:
        for j, n, _ in mats:
            r = sum(adapters[a].shapes[(j, n)].rank for a in set(blk) - {None} if (j, n) in adapters[a].shapes)
            lanes[(j, n)] = max(lanes.get((j, n), 0), r)
    assert dict(need.lanes) == lanes
    assert need.resident == sum(r * sum(shape) for (j, n, shape) in mats for r in [lanes[(j, n)]])
    resident = SimpleNamespace(splits=[SimpleNamespace(resident=True)], slots=[])
    groups = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    prefills = 0
    for blk, cached in zip(blocks, [{"a", "b"}, {"a", "b"}, {"c", "d"}, {"d", "a"}]):
        pool.begin(blk, need, resident)
        assert set(pool._cached) == cached
        ids, host = pool.ids(blk)
        for per_row in (1, 3, 20):
            for j in sorted({j for j, _, _ in mats}):
                for group in groups:
                    keys = [(j, f"{p}.weight") for p in group]
                    if keys[0] not in pool.packs:
                        continue
                    packs = [pool.packs[k] for k in keys]
                    assert len(L._lane_runs(packs)) == 1
                    outs = [p.fan_out for p in packs]
                    x = torch.randn(len(blk), per_row, packs[0].fan_in, generator=g, dtype=torch.float64)
                    w = torch.randn(sum(outs), packs[0].fan_in, generator=g, dtype=torch.float64)
                    b = torch.randn(sum(outs), generator=g, dtype=torch.float64) if per_row < 16 else None
                    prefills += per_row >= 16
                    got = torch.cat(L.lora_linears(x, w, b, outs, ids, packs, host, kernels=True), -1)
                    want = brute_linears(x, w, b, keys, outs, blk, adapters)
                    assert (got - want).abs().max() <= 1e-10 * want.abs().max(), (blk, keys, per_row)
    assert calls["segments"] == prefills  # every prefill went by segments
    assert calls["grouped"] > 0


@pytest.mark.skipif(not __import__("flexoff.kernels.lora_matmul", fromlist=["HAVE_TMA"]).HAVE_TMA,
                    reason="triton with tensor descriptors is not installed")
@pytest.mark.parametrize("tile", [{"bm": 16, "bn": 64, "bk": 32, "stages": 1, "warps": 4}, None],
                         ids=["small", "default"])
@pytest.mark.parametrize("dtype", [torch.float16] + [torch.bfloat16] * torch.cuda.is_available())
def test_resident_prefill_through_the_fused_matmul_equals_each_adapters_delta(dtype, tile, monkeypatch):
    """Prefill rows of a resident pool in 16-bit, rows of whole tiles, no bias: the base matmul
    with the deltas in its epilogue (kernels.lora_matmul, with small tiles and the default's; on
    the CPU under Triton's interpreter, whose descriptors misread bfloat16, so that runs on a GPU only)
    equals x @ w.T plus each row's own adapter's delta, in float64 from the same 16-bit values,
    for adapters of mixed ranks (one leaving v alone, q's rank past the tile's outputs), a row
    on the base model, stacked q/k/v of unequal widths, and outputs that end inside a tile;
    rows that are not whole tiles, or a bias, take the other ways."""
    from types import SimpleNamespace

    from flexoff.adapters.peft import Adapter, LoraModule
    from flexoff.checkpoint import load_model
    from flexoff.kernels import lora as L
    from flexoff.kernels import lora_matmul as M
    from flexoff.offload.adapters import AdapterPool

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if tile is not None:
        monkeypatch.setattr(M, "TILE", tile)
    bm = M.TILE["bm"]
    calls = []
    real = L.fused_matmul
    monkeypatch.setattr(L, "fused_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    spec = load_model("dummy:llama-tiny").spec
    g = torch.Generator().manual_seed(3)
    mats = [(j, t.name, t.shape) for j, lay in enumerate(spec.layers) if lay.kind in ("attn", "mlp")
            for t in lay.tensors if t.matmul]

    def adapter(name, rank_of):
        mods = {(j, n): LoraModule(torch.randn(rank_of(n), fin, generator=g).to(dtype).double(),
                                   (torch.randn(fout, rank_of(n), generator=g) / 4).to(dtype).double(), 0.5 + j / 8)
                for j, n, (fout, fin) in mats if rank_of(n)}
        return Adapter(name, "", mods)

    adapters = {"a": adapter("a", lambda n: 3), "b": adapter("b", lambda n: 0 if n == "v_proj.weight" else 8),
                "c": adapter("c", lambda n: 64 if n[0] == "q" else 1 + len(n) % 5)}
    pool = AdapterPool(list(adapters.values()), dev, dtype, spec)
    blk = ["b", "c", None, "a", "c"]
    pool.begin(blk, pool.need([blk]), SimpleNamespace(splits=[SimpleNamespace(resident=True)], slots=[]))
    ids, host = pool.ids(blk)
    groups = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    for per_row, bias in ((2 * bm, False), (bm, False), (bm + bm // 2, False), (2 * bm, True)):
        fused = per_row % bm == 0 and not bias
        for j in (1, 2):
            for group in groups:
                keys = [(j, f"{p}.weight") for p in group]
                if keys[0] not in pool.packs:
                    continue
                packs = [pool.packs[k] for k in keys]
                outs = [p.fan_out for p in packs]
                x = torch.randn(len(blk), per_row, packs[0].fan_in, generator=g).to(dtype)
                w = (torch.randn(sum(outs), packs[0].fan_in, generator=g) / 8).to(dtype)
                b = torch.randn(sum(outs), generator=g).to(dtype) if bias else None
                before = len(calls)
                got = torch.cat(L.lora_linears(x.to(dev), w.to(dev), None if b is None else b.to(dev), outs, ids,
                                               packs, host, kernels=True), -1).double().cpu()
                assert len(calls) - before == (len(group) if fused else 0), (per_row, bias, group)
                want = brute_linears(x.double(), w.double(), None if b is None else b.double(), keys, outs, blk,
                                     adapters)
                tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
                assert (got - want).abs().max() <= tol * want.abs().max(), (per_row, bias, keys)
    assert calls
    # a kernel the compiler refuses (out of shared memory): the other ways, and not tried again
    import triton

    class Refusing:
        def __getitem__(self, grid):
            def launch(*a, **k):
                calls.append("refused")
                raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
            return launch

    monkeypatch.setattr(M, "_fused", Refusing())
    monkeypatch.setattr(M, "REFUSED", set())
    packs = [pool.packs[(1, "o_proj.weight")]]
    x = torch.randn(len(blk), 2 * bm, 64, generator=g).to(dtype).to(dev)
    w = (torch.randn(64, 64, generator=g) / 8).to(dtype).to(dev)
    want = L.lora_linears(x, w, None, [64], ids, packs, host, kernels=False)[0].double()
    for _ in range(2):
        got = L.lora_linears(x, w, None, [64], ids, packs, host, kernels=True)[0].double()
        assert (got - want).abs().max() <= tol * want.abs().max()  # two orders of adding, one unit apart
        assert calls.count("refused") == 1


@INTERPRETED
@pytest.mark.skipif(not __import__("flexoff.kernels.lora", fromlist=["HAVE_TRITON"]).HAVE_TRITON,
                    reason="triton is not installed")
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("segments", ["tiles", "expand", "both"])
def test_the_kernels_in_the_engine_equal_peft(tiny, name, segments, tmp_path, monkeypatch):
    """With the kernels serving the engine (on the CPU through TRITON_INTERPRET): resident
    weights decode through the pool's rank lanes densely, and a prompt of 20 tokens prefills in
    tiles (the Triton passes, or by segments of rows of one adapter through cuBLAS); per row,
    greedy tokens equal PEFT's with the row's adapter active, over blocks that find adapters
    cached and blocks that copy their own."""
    from flexoff.kernels import lora as L

    if segments != "tiles":  # rows of 20 tokens are segments long enough
        monkeypatch.setattr(L, "SEGMENTS", segments)
        monkeypatch.setattr(L, "SEGMENT_TOKENS", 1)
    segmented = []
    real_segments = L._segment_deltas
    monkeypatch.setattr(L, "_segment_deltas", lambda *a, **k: segmented.append(1) or real_segments(*a, **k))

    path = tiny[name].path
    adapters = make_adapters(path, name, tmp_path)
    prompts, assign = PROMPTS + [list(range(3, 23))], ASSIGN + ["b"]
    want = [peft_greedy(path, adapters[a] if a else None, p, 6) for a, p in zip(assign, prompts)]
    monkeypatch.setattr(L, "_kernels", lambda x: not torch.is_grad_enabled())
    dense = []
    real = L._dense_linears
    monkeypatch.setattr(L, "_dense_linears", lambda *a, **k: dense.append(1) or real(*a, **k))
    with LLM(str(path), lora=adapters) as llm:
        llm.policy_arg = Policy(gpu_batch_size=2)
        got = llm.generate([{"prompt_ids": p, "adapter": a} for a, p in zip(assign, prompts)], max_new_tokens=6)
    assert [c.token_ids for c in got.completions] == want
    assert dense
    assert bool(segmented) == (segments != "tiles")
