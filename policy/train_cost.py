"""The cost of a LoRA training step through the engine, in FlexGen's terms (cost_model.py).

Knows: for a model, hardware, training window (S tokens per sequence, one adapter of rank r on
the adapted matmuls) and the discrete part of a policy (batch shape, 4-bit base weights,
overlap, whether the forward's autograd graphs are kept for the reverse sweep), the time of
each engine layer in the forward sweep ("f") and the reverse sweep ("b") as the max (overlap
on) or sum of its transfer and compute terms, and the peak memory of each tier as the engine
plans it (offload.memory with training on); every term is linear in the twelve placement
fractions, so the same code builds the LP (search.py) and evaluates a concrete policy.
Does not know: the LP solver or rounding, the engine, the optimizer (its update is small beside
two sweeps of the base and is left out).

The forward sweep is inference's prefill over every token of the window (the head computes the
logits of all of them), with each layer's input stashed; the reverse sweep stages every layer's
weights again, in reverse order, loads its stashed input and computes the vector-Jacobian product
through the frozen layer: the recomputed forward (not where graphs are kept), the input gradient
(one transposed matmul per weight) and attention's backward (twice its forward); LoRA's A and B
gradients cost twice their forward. Names beyond cost_model.py's:

| name | meaning |
|------|---------|
| sg, sc, sd | fraction of each GPU batch's stashed layer inputs on GPU, CPU, disk |
| S | tokens per training window (the longest sequence of the step) |
| keep | the forward's graphs kept on the GPU for the reverse sweep (weights and stash all there) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flexoff.models.spec import ModelSpec
from flexoff.policy.cost_model import KINDS, VARS, Choice, CostModel, Prediction, Workload
from flexoff.policy.hardware import Hardware

TRAIN_VARS = VARS + ("sg", "sc", "sd")
SWEEPS = ("f", "b")
# bytes per trained LoRA parameter on the compute device, beyond the adapter the engine reads: the
# float32 master copy, its gradient and AdamW's two moments, the float32 gradient being summed from
# a block, plus the engine's gradient in the compute dtype (optimizer_bytes adds its size)
OPTIMIZER_BYTES = 5 * 4


def optimizer_bytes(params: float, elem_bytes: int) -> float:
    """What training `params` LoRA parameters holds on the compute device besides the adapter."""
    return params * (OPTIMIZER_BYTES + elem_bytes)


# a training layer step's host work (autograd's recompute and vector-Jacobian product, in Python)
# in engine steps of the hardware profile (host_step_s, a decode step's): 2.2 ms against 0.65 ms
# in a torch.profiler trace of resident LLaMA-7B training on the H200 (RESULTS.md)
TRAIN_HOST_STEPS = 3.0

CACHE_PREFERENCE = 1e-6  # of the LP's time unit, per fraction: a step reads no KV cache; keep it in CPU memory


@dataclass(frozen=True)
class TrainChoice(Choice):
    """The discrete part of a training policy, fixed while the LP picks the placement (the KV
    cache is neither compressed nor attended on the CPU: training reads none)."""

    keep_graphs: bool = False  # needs wg = sg = 1
    # without kept graphs, what is not all on the GPU (else the engine would keep them): "stash"
    # (a row of each batch's stash at least) or "weights"
    apart: str = "stash"


def graph_token_elems(spec: ModelSpec, window: int) -> list[int]:
    """Per layer, the values per token an autograd graph of it holds (attention: its projections
    and its scores, two per head and key; MLP: its activations); 0 for the embedding and head."""
    h, f, heads = spec.hidden_size, spec.intermediate_size, spec.num_heads
    return [8 * h + 2 * heads * window if l.kind == "attn" else h + 5 * f if l.kind == "mlp" else 0
            for l in spec.layers]


class TrainCostModel(CostModel):
    """A training block: bls sequences of S tokens, one forward and one reverse sweep."""

    vars = TRAIN_VARS

    def __init__(self, spec: ModelSpec, hw: Hardware, seq_len: int, choice: TrainChoice, lora_rank: float = 16,
                 elem_bytes: int = 2):
        super().__init__(spec, hw, Workload(seq_len, 1, elem_bytes, None, (lora_rank,)), choice)
        self.S = seq_len
        self.cache_ahead = self.staged_pool = self.pooled = False  # training reads no KV cache
        elems = graph_token_elems(spec, seq_len)
        self.graph_total = sum(elems) * elem_bytes  # per token, all layers
        self.graph_layer = max(elems) * elem_bytes  # per token, the largest layer

    @property
    def train(self) -> TrainChoice:
        """self.ch, with the training fields."""
        assert isinstance(self.ch, TrainChoice)
        return self.ch

    def sweep_count(self, sweep: str) -> int:
        return 1

    def bounds(self) -> dict[str, tuple[float, float]]:
        """Fractions a choice bounds: kept graphs need every weight and the whole stash on the
        GPU; the engine recomputes only where one of them is not."""
        if self.train.keep_graphs:
            return {"wg": (1.0, 1.0), "sg": (1.0, 1.0)}
        if self.train.apart == "stash":
            return {"sg": (0.0, 1 - 1 / self.ch.gpu_batch_size)}
        return {"wg": (0.0, 0.999)}

    def preference(self, x: Mapping[str, Any]) -> Any:
        """A negligible cost that puts the unused KV cache in CPU memory when the LP is free to."""
        return CACHE_PREFERENCE * (x["cg"] + 2 * x["cd"])

    # ---- time ----------------------------------------------------------
    def terms(self, x: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        hw, ch, spec, S = self.hw, self.ch, self.spec, self.S
        bls, keep = ch.bls, self.train.keep_graphs
        act = bls * S * self.A  # one layer's input (or output) for the block
        attn_f = bls * spec.attn_flops(1) * S * (S + 1) / 2 / hw.bmm_flops_p
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for k in KINDS:
            W = self.W[k]
            deq_w = self.W_dense[k] / hw.dequant_bdw if ch.compress_weight else 0
            lin = bls * S * self.F[k] / self.mm_p
            lora = bls * S * self.lora_F[k] / self.mm_p
            elem = bls * S * self.E[k]  # a forward's elementwise passes (a backward's: about twice)
            attn = attn_f if k == "attn" else 0.0
            stashed = k != "embed" and (k == "head" or not keep)  # the head's input is stashed always
            # weights staged in both sweeps (the embedding's too: the schedule stages it last)
            w_link = (x["wc"] + x["wd"]) * (W + self.lora_layer[k])
            for sweep in SWEEPS:
                fwd = sweep == "f"
                h_in, h_out = fwd and k != "embed", fwd and k != "head"  # the forward's hidden states
                s_out, s_in = stashed and fwd, stashed and not fwd  # stored in one sweep, loaded in the other
                t = {
                    "ctog": (w_link + (x["hc"] + x["hd"]) * act * h_in + (x["sc"] + x["sd"]) * act * s_in)
                    / hw.ctog_bdw,
                    "gtoc": ((x["hc"] + x["hd"]) * act * h_out + (x["sc"] + x["sd"]) * act * s_out)
                    / hw.gtoc_bdw_hidden,
                    "dtoc": (x["wd"] * W + x["hd"] * act * h_in + x["sd"] * act * s_in) / hw.dtoc_bdw,
                    "ctod": (x["hd"] * act * h_out + x["sd"] * act * s_out) / hw.ctod_bdw_hidden,
                }
                if fwd:
                    comp = lin + lora + attn + deq_w + elem
                elif k == "embed":
                    comp = 0.0
                elif k == "head":  # the logits again, then their gradient through the head
                    comp = 2 * lin + deq_w
                else:  # [recompute] + input gradient + attention's backward + LoRA's gradients
                    comp = (0 if keep else lin + lora + attn + deq_w + elem) + lin + 2 * attn + 2 * lora + 2 * elem
                t["comp"] = comp
                t["host"] = ch.num_gpu_batches * hw.host_step_s * TRAIN_HOST_STEPS
                out[(sweep, k)] = t
        return out

    # ---- memory --------------------------------------------------------
    def memory(self, x: Mapping[str, Any]) -> dict[str, Any]:
        """The engine's plan for a training engine: inference's (weights, an unused KV cache of
        S + 1 tokens, the hidden state, working memory, the adapter) plus training's own."""
        mem, extra = super().memory(x), self.training_memory(x)
        return {t: mem[t] + extra[t] for t in mem}

    def training_memory(self, x: Mapping[str, Any]) -> dict[str, Any]:
        """What training adds to an inference engine's memory: the stash or the kept graphs, the
        graph of one layer of one GPU batch that the reverse sweep's recompute holds, and the
        optimizer's float32 copies of the adapter."""
        mem: dict[str, Any] = {"gpu": 0.0, "cpu": 0.0, "disk": 0.0}
        ch, S = self.ch, self.S
        eb = self.work.elem_bytes
        mem["gpu"] += optimizer_bytes(self.lora_bytes / eb, eb)
        if ch.compress_weight:  # the reverse sweep dequantizes a whole layer, not one matmul
            mem["gpu"] += self.spec.dequantized_bytes(eb, True) - self.spec.dequantized_bytes(eb, ch.num_gpu_batches > 1)
        layers = len(self.spec.layers) - 1  # every layer's input but the embedding's
        stash = ch.bls * S * self.A * layers
        mem["gpu"] += ch.gpu_batch_size * S * self.graph_layer
        if self.train.keep_graphs:
            mem["gpu"] += ch.bls * S * self.graph_total
        else:
            mem["gpu"] += x["sg"] * stash
            mem["cpu"] += x["sc"] * stash
            mem["disk"] += x["sd"] * stash
        return mem

    # ---- evaluation ----------------------------------------------------
    def evaluate(self, x: Mapping[str, float]) -> Prediction:
        """prefill_s: the forward sweep; decode_s: the reverse sweep; throughput: training tokens/s
        of the block."""
        terms = self.terms(x)
        sweep = {s: sum(self.count[k] * self.layer_time(terms[(s, k)]) for k in KINDS) for s in SWEEPS}
        worst_s, worst_k = max(((s, k) for s in SWEEPS for k in KINDS),
                               key=lambda sk: self.count[sk[1]] * self.layer_time(terms[sk]))
        term = max(terms[(worst_s, worst_k)].items(), key=lambda kv: kv[1])[0]
        latency = sweep["f"] + sweep["b"]
        return Prediction(sweep["f"], sweep["b"], self.ch.bls * self.S / latency,
                          f"{term} ({worst_k} layers, {'forward' if worst_s == 'f' else 'reverse'} sweep)",
                          {t: float(v) for t, v in self.memory(x).items()},
                          {f"{s}/{k}": {a: float(b) for a, b in v.items()} for (s, k), v in terms.items()})
