"""GPU checks, run on the device (skipped without CUDA): the engine's policy matrix in float16
against transformers on the GPU, the Triton kernels against their references, and compression."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch

from flexoff import LLM, Policy
from policy_matrix import pairwise
from reference import PROMPTS, rel_err

pytestmark = pytest.mark.gpu

LOGIT_TOL = 1e-2  # max |logit difference| / max |logit|, float16 against float16 transformers


@pytest.fixture(scope="module")
def gpu_refs(tiny):
    """transformers in float16 on the GPU: greedy tokens and per-step logits of PROMPTS."""
    out = {}
    for name, m in tiny.items():
        hf = copy.deepcopy(m.hf).half().cuda()
        refs = []
        for p in PROMPTS:
            g = hf.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                            device="cuda"), max_new_tokens=8, do_sample=False, output_scores=True,
                            return_dict_in_generate=True, pad_token_id=0)
            refs.append((g.sequences[0, len(p):].tolist(), [s[0].float().cpu() for s in g.scores]))
        out[name] = refs
    return out


def _run(llm: LLM, prompts):
    logits: dict[str, list[torch.Tensor]] = {}

    def grab(step, ids, lg):
        for rid, row in zip(ids, lg):
            logits.setdefault(rid, []).append(row.float().cpu())

    out = llm.generate([{"prompt_ids": p} for p in prompts], max_new_tokens=8, on_logits=grab)
    return [c.token_ids for c in out.completions], [logits[str(i)] for i in range(len(prompts))]


EXTRA = [Policy(gpu_batch_size=5, w_gpu_percent=0, w_cpu_percent=100, cache_gpu_percent=0, cache_cpu_percent=100,
                act_gpu_percent=0, act_cpu_percent=100, cpu_cache_compute=True),
         Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=0, w_cpu_percent=0, cache_gpu_percent=0,
                cache_cpu_percent=0, act_gpu_percent=0, act_cpu_percent=0)]


@pytest.mark.parametrize("name", ["opt", "llama", "qwen2"])
def test_policy_matrix_fp16_matches_transformers_on_gpu(tiny, gpu_refs, name):
    with LLM(str(tiny[name].path), device="cuda", dtype="float16") as llm:
        for p in pairwise() + EXTRA:
            llm.policy_arg = p
            tokens, logits = _run(llm, PROMPTS)
            for (ref_t, ref_l), got_t, got_l in zip(gpu_refs[name], tokens, logits):
                assert got_t == ref_t, p.describe()
                assert max(rel_err(a, b) for a, b in zip(got_l, ref_l)) < LOGIT_TOL, p.describe()


def test_kernels_equal_references_on_gpu():
    from flexoff.kernels import quant as K
    from flexoff.quant.format import QuantConfig, dequantize_rows, quantize_rows

    torch.manual_seed(0)
    for bits, group, dtype in [(4, 64, torch.float16), (4, 32, torch.bfloat16), (8, 64, torch.float16)]:
        cfg = QuantConfig(bits, group)
        x = torch.randn(301, 7 * group, device="cuda", dtype=dtype)
        got = K.quantize_rows(x, cfg)
        want = quantize_rows(x.float(), cfg)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        d, s, m = want
        assert torch.equal(K.dequantize_rows(d, s, m, cfg, dtype), dequantize_rows(d, s, m, cfg, dtype))
        for rows in (1, 16, 64):
            xx = torch.randn(rows, 301, device="cuda", dtype=torch.float16)
            y = K.qmatmul(xx, d.view(301, -1), s.view(301, -1), m.view(301, -1), cfg, 7 * group - 5)
            ref = xx.double() @ dequantize_rows(d, s, m, cfg, torch.float16).double()[:, :7 * group - 5]
            assert ((y.double() - ref).norm() / ref.norm()) < 2e-3
    from flexoff.quant.engine import QuantKV  # the KV cache's one-kernel encode against the CPU's reference
    for heads, dim, bits, group in [(56, 128, 4, 64), (8, 80, 4, 32), (4, 64, 8, 64)]:
        codec = QuantKV(heads, dim, torch.float16, bits, group)
        k, v = (torch.randn(3, 9, heads, dim, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(2))
        assert torch.equal(codec.encode(k, v).cpu(), codec.encode(k.cpu(), v.cpu()))


def test_compression_on_gpu_is_deterministic_under_placements(tiny):
    with LLM(str(tiny["llama"].path), device="cuda", dtype="float16") as llm:
        for p in pairwise()[::3] + EXTRA:
            llm.policy_arg = p.replace(compress_weight=True, compress_cache=True, quant_group=16)
            a, _ = _run(llm, PROMPTS)
            b, _ = _run(llm, PROMPTS)
            assert a == b and all(len(t) == 8 for t in a), p.describe()


def _tokens_and_logprobs(llm: LLM, prompts, policies):
    """Per policy: each prompt's tokens and the log-probabilities of its chosen tokens."""
    out = []
    for p in policies:
        llm.policy_arg = p
        got = llm.generate(prompts).completions
        out.append(([c.token_ids for c in got], torch.tensor([c.logprobs.chosen for c in got])))
        llm.drop_engine()
    return out


def test_overlap_gives_the_tokens_of_no_overlap_when_offloaded_and_compressed(tmp_path):
    """Copies that overlap compute are ordered against it: OPT-30B-sized layers (the races need
    real kernel times), cache compressed in CPU memory with CPU attention, and weights, cache and
    activations mostly in CPU memory with GPU attention, give with overlap on the tokens they give
    with it off, and log-probabilities within float16 kernel differences, all finite. (Two races
    once gave NaN here: a prompt's KV records copied off the GPU before their encoding ended, and
    activations loaded into memory that compute kernels still queued were using.)"""
    import json

    from flexoff.dummy import dummy_config

    cfg = dict(dummy_config("opt-30b"), num_hidden_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_ids": torch.randint(3, cfg["vocab_size"], (560 + 8 * (i % 7),), generator=g).tolist(),
                "logprobs": 0, "max_new_tokens": 4} for i in range(64)]
    cpu_attention = Policy(gpu_batch_size=32, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100,
                           cache_gpu_percent=0, cache_cpu_percent=100, cpu_cache_compute=True, compress_cache=True)
    streamed = Policy(gpu_batch_size=16, num_gpu_batches=4, w_gpu_percent=0, w_cpu_percent=100,
                      cache_gpu_percent=12.5, cache_cpu_percent=87.5, act_gpu_percent=0, act_cpu_percent=100,
                      compress_weight=True, compress_cache=True)
    with LLM(f"dummy:{tmp_path / 'config.json'}", device="cuda", dtype="float16") as llm:
        llm.model.tokenizer.eos_ids = ()
        for p in (cpu_attention, streamed):
            (t_on, lp_on), (t_off, lp_off) = _tokens_and_logprobs(llm, prompts, [p, p.replace(overlap=False)])
            assert torch.isfinite(lp_on).all() and torch.isfinite(lp_off).all(), p.describe()
            assert t_on == t_off, p.describe()
            assert (lp_on - lp_off).abs().max() < 2e-2, p.describe()  # float16 kernels may differ


def test_budget_is_enforced_on_the_gpu(tiny):
    from flexoff.errors import MemoryBudgetError

    with LLM("dummy:opt-1.3b", device="cuda", gpu_mem=1 << 30, policy=Policy(gpu_batch_size=4)) as llm:
        with pytest.raises(MemoryBudgetError, match="--gpu-mem"):
            llm.generate(["hello"], max_new_tokens=2)


def test_stores_deliver_outputs_whose_memory_the_caller_let_go():
    """Device-to-host stores of transient outputs queued behind a busy store stream: the caller
    lets each output go at once and the compute stream allocates and fills memory right after;
    every copy still delivers its output's bytes, with the mover holding the outputs (a budget
    smaller than all of them, so the host also waits for the oldest) and with record_stream."""
    from flexoff.offload.lanes import Lanes
    from flexoff.offload.mover import Mover, Span, span_of
    from flexoff.offload.tiers import Ledger, Tiers

    dev = torch.device("cuda", torch.cuda.current_device())
    n, count = 8 << 20, 12
    for hold in (0, 5 * n):
        lanes, tiers = Lanes(dev), Tiers(dev, None)
        mem = Ledger(tiers)
        mover = Mover(lanes, mem, hold_bytes=hold)
        homes = [mem.alloc("cpu", n) for _ in range(count)]
        with torch.cuda.stream(lanes.store.stream):
            torch.cuda._sleep(10**8)  # the copies queue behind this
        for i, home in enumerate(homes):
            out = torch.full((n,), i, dtype=torch.uint8, device=dev)
            mover.copy(Span(home, 0, n), span_of(out), [lanes.compute.mark()], lane="store", transient=True)
            del out
            torch.full((n,), 255, dtype=torch.uint8, device=dev)  # may take the memory let go
        lanes.sync()
        mover.settle()
        assert [int(h.min()) for h in homes] == [int(h.max()) for h in homes] == list(range(count))
        # the sixth output waited for the first (the stream still asleep); later ones may find theirs done
        assert (1 <= mover.hold_waits <= count - 5) if hold else mover.hold_waits == 0
        lanes.close()
        mem.release()
        tiers.close()


def test_paced_copies_deliver_every_byte():
    """Large host-to-device copies go through the feed thread chunk by chunk, after their
    dependencies; the bytes arrive whole and the returned event covers all of them."""
    from flexoff.offload.lanes import Lanes
    from flexoff.offload.mover import IN_FLIGHT, LINK_CHUNK, Mover, Span
    from flexoff.offload.tiers import Ledger, Tiers

    dev = torch.device("cuda", torch.cuda.current_device())
    lanes = Lanes(dev)
    tiers = Tiers(dev, None)
    mem = Ledger(tiers)
    n = (IN_FLIGHT + 3) * LINK_CHUNK + 12345
    src = mem.alloc("cpu", n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    dst.fill_(7)
    torch.cuda._sleep(10**7)  # the compute stream stays busy: the copy must wait for it
    dep = lanes.compute.mark()
    ev = Mover(lanes, mem).copy(Span(dst, 0, n), Span(src, 0, n), [dep])
    lanes.compute.wait([ev])
    assert torch.equal(dst.cpu(), src)
    lanes.sync()
    lanes.close()
    mem.release()
    tiers.close()


def test_weights_streamed_from_the_cpu_give_the_same_tokens():
    """OPT-1.3B-shaped dummy weights (layers larger than a copy chunk, so paced) streamed from
    pinned CPU memory produce exactly what the same weights resident on the GPU produce."""
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_ids": torch.randint(3, 50000, (int(n),), generator=g).tolist()} for n in (40, 17, 64, 5)]
    outs = []
    for w in ((100, 0), (0, 100), (30, 70)):
        with LLM("dummy:opt-1.3b", policy=Policy(2, 2, *w, 100, 0, 100, 0), dtype="float16") as llm:
            outs.append([c.token_ids for c in llm.generate(prompts, max_new_tokens=6).completions])
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("name", ["opt", "llama", "qwen2"])
def test_lean_path_with_and_without_cuda_graphs_gives_transformers_tokens(tiny, gpu_refs, name, monkeypatch):
    for shape in ((5, 1), (2, 3), (2, 1)):  # (2, 1): three blocks of other prompt lengths, the last of one row
        got = {}
        for graphs in ("1", "0"):
            monkeypatch.setenv("FLEXOFF_CUDA_GRAPHS", graphs)
            with LLM(str(tiny[name].path), device="cuda", dtype="float16",
                     policy=Policy(gpu_batch_size=shape[0], num_gpu_batches=shape[1])) as llm:
                tokens, logits = _run(llm, PROMPTS)
                lean = llm.engine.lean
                assert lean is not None and lean.graphs == (graphs == "1") and not lean.failed
            for (ref_t, ref_l), got_l in zip(gpu_refs[name], logits):
                for a, b in zip(got_l, ref_l):
                    assert rel_err(a, b) < LOGIT_TOL
            got[graphs] = tokens
        assert got["1"] == got["0"] == [t for t, _ in gpu_refs[name]], shape


def test_training_sweep_on_the_gpu_matches_the_cpu(tiny):
    """The reverse sweep's input gradients on CUDA (float32, weights streamed from CPU memory)
    against the same engine on the CPU (float64)."""
    from flexoff.offload.engine import Engine
    from reference import train_batches

    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]
    p = Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100,
               stash_gpu_percent=0, stash_cpu_percent=100)
    with LLM(str(tiny["llama"].path)) as llm:
        m = llm.model
        batches = train_batches(3, prompts)
        res = {}
        for dev, dt in (("cpu", torch.float64), ("cuda", torch.float32)):
            e = Engine(m.family, m.spec, p, device=torch.device(dev), dtype=dt, max_prompt=16, max_gen=1,
                       training=True)
            try:
                e.load_weights((j, m.source.layer(j, lay, dt, e.device)) for j, lay in enumerate(m.spec.layers))
                res[dev] = e.run_train(batches)
            finally:
                e.close()
    assert abs(res["cuda"].loss - res["cpu"].loss) < 1e-4 * abs(res["cpu"].loss)
    for a, b, bt in zip(res["cuda"].input_grads, res["cpu"].input_grads, batches):
        assert rel_err(a.cpu()[bt.valid], b[bt.valid]) < 1e-3


@pytest.mark.parametrize("segments", ["tiles", "expand", "both"])
def test_lora_adapters_on_the_gpu_equal_peft(tiny, tmp_path, monkeypatch, segments):
    """Mixed adapters (the Triton kernels; resident weights: the dense decode, and over several
    blocks the next block's adapters staged while one runs; prompts padded to 20 tokens prefill
    in tiles, or by segments of rows of one adapter through cuBLAS) in float16 on the GPU
    against PEFT in float16 on the GPU."""
    from flexoff.kernels import lora as L
    from flexoff.offload.adapters import AdapterPool
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from reference import make_adapters

    if segments != "tiles":
        monkeypatch.setattr(L, "SEGMENTS", segments)
        monkeypatch.setattr(L, "SEGMENT_TOKENS", 1)
    segmented = []
    real_segments = L._segment_deltas
    monkeypatch.setattr(L, "_segment_deltas", lambda *a, **k: segmented.append(1) or real_segments(*a, **k))
    path = tiny["llama"].path
    adapters = make_adapters(path, "llama", tmp_path)
    prompts, assign = PROMPTS + [list(range(3, 23))], ["a", None, "b", "c", "a", "b"]
    want = []
    for a, p in zip(assign, prompts):
        model = AutoModelForCausalLM.from_pretrained(path).half().cuda().eval()
        if a is not None:
            model = PeftModel.from_pretrained(model, adapters[a]).half().eval()
        out = model.generate(input_ids=torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"), pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    staged, read_ahead = [], []
    real, real_next = AdapterPool._staging, AdapterPool._stage_next
    monkeypatch.setattr(AdapterPool, "_staging", lambda self, m: staged.append(out := real(self, m)) or out)

    def stage_next(self, names, main):
        real_next(self, names, main)
        read_ahead.append((threading.current_thread().name, len(self._staged)))

    monkeypatch.setattr(AdapterPool, "_stage_next", stage_next)
    from flexoff.offload import lean

    readers = []  # the adapter reader at each decode graph's capture: none may run then
    real_capture = lean._Batch.capture

    def capture(self, pool):
        readers.append(self.dec.engine.adapters._reading)
        real_capture(self, pool)

    monkeypatch.setattr(lean._Batch, "capture", capture)
    with LLM(str(path), device="cuda", dtype="float16", lora=adapters) as llm:
        for policy in (Policy(gpu_batch_size=2), Policy(gpu_batch_size=5),
                       Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=0, w_cpu_percent=100)):
            llm.policy_arg = policy
            with warnings.catch_warnings(record=True) as caught:  # the decode graphs capture the side stream too
                warnings.simplefilter("always")
                got = llm.generate([{"prompt_ids": p, "adapter": a} for a, p in zip(assign, prompts)],
                                   max_new_tokens=8)
            assert not [w for w in caught if "graph capture failed" in str(w.message)]
            assert [c.token_ids for c in got.completions] == want, policy.describe()
    assert any(staged)  # three blocks of two rows: adapters moved into their lanes from the staging buffer
    # the first policy's blocks read the next block's adapters from their files in the reader's
    # thread, which staged them on the device too
    assert any(thread == "flexoff-adapters" and n for thread, n in read_ahead), read_ahead
    assert readers and all(r is None for r in readers)
    assert bool(segmented) == (segments != "tiles")


@pytest.mark.parametrize("policy", [Policy(gpu_batch_size=2, num_gpu_batches=2),
                                    Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=100,
                                           stash_gpu_percent=0, stash_cpu_percent=100)],
                         ids=["resident", "streamed"])
def test_finetune_steps_on_the_gpu_equal_peft(tiny, tmp_path, policy):
    """float32 on the GPU: AdamW steps through the engine (master weights and optimizer on the GPU;
    streamed: weights, LoRA pages and the stash through CPU memory) give PEFT + AdamW's losses."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flexoff.finetune import LoraTrainer, TrainConfig, to_example
    from flexoff.finetune.trainer import batch_input
    from reference import peft_losses

    path = tiny["llama"].path
    torch.manual_seed(0)
    init = tmp_path / "init"
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj", "down_proj"])).save_pretrained(init)
    cfg = TrainConfig(lr=5e-3, batch_size=4, max_grad_norm=0.5)
    texts = ["the quick brown fox", "jumps over the lazy dog", "a b c d e f g", "hello world, hello",
             "lorem ipsum dolor", "sit amet consectetur"]
    with LLM(str(path), policy=policy, device="cuda", dtype="float32", lora={"mine": str(init)}) as llm:
        ex = [to_example({"text": t}, llm.tokenizer, "t", 64) for t in texts]
        groups = [ex[0:4], ex[2:6]]
        trainer = LoraTrainer(llm, "mine", cfg)
        ours = [trainer.step(groups[s % 2]) for s in range(8)]
    want, _ = peft_losses(path, str(init), [batch_input(g, "mine") for g in groups], cfg, 8, device="cuda")
    assert ours[0] > ours[-1] + 0.1
    for a, b in zip(ours, want):  # TF32 is off by default for float32 matmuls in both
        assert abs(a - b) < 1e-3 * abs(b), (ours, want)


def test_joint_read_windows_measure_both_streams():
    """The profile's joint windows: each gives the copies' and CPU attention's rates over one
    span; the copies beside CPU attention are no faster than the same copies alone (timed here
    with CUDA events), and CPU attention reads at a positive rate beside them."""
    from flexoff.policy.hardware import joint_read_samples

    windows = joint_read_samples(windows=2)
    src = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)
    start.record()
    for _ in range(32):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    alone = 32 * src.numel() / (start.elapsed_time(end) / 1e3)
    assert len(windows) == 2
    for link, attention in windows:
        assert 0 < link <= 1.05 * alone and attention > 0
