"""The Python API: `LLM(model).generate(prompts, ...)`.

Knows: turning user prompts (text, chat messages, token ids, or dicts with
per-request settings) into validated requests; choosing device, dtype and
policy; creating the engine (reused while its policy and sizes fit) and loading
weights into it; running blocks and collecting completions and measurements.
The CLI is a thin layer over this.
Does not know: files and resumption (flexoff.jobs), the schedule (offload/).
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from tqdm import tqdm

from flexoff import validate
from flexoff.adapters import Adapter, load_adapter
from flexoff.checkpoint import LoadedModel, load_model
from flexoff.errors import FlexoffError, GpuOutOfMemoryError, InputError
from flexoff.generation import Completion, Request, RunStats, plan_blocks, run_block
from flexoff.parallel import World
from flexoff.offload.engine import Engine
from flexoff.offload.memory import oom_record
from flexoff.offload.adapters import AdapterPool, Need
from flexoff.offload.pipeline import heaviest_stage, stage_layers, stage_spec
from flexoff.offload.residency import Residency
from flexoff.offload.tiers import Budgets
from flexoff.policy.policy import CACHE_BLOCKS, Policy
from flexoff.sampling import FIELDS, SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_BATCH = 16
OOM_RETRIES = 2  # searches again with less GPU memory after running out, for --policy auto


def oom_step(gpu_budget: int) -> int:
    """GPU bytes a search leaves unplanned more after the GPU ran out of memory."""
    return min(2 << 30, gpu_budget // 8)


def pick_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise FlexoffError(f"unknown device {device!r}; use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FlexoffError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise FlexoffError(f"device type {dev.type!r} is not supported; use cpu or cuda")
    return dev


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise FlexoffError(f"unknown dtype {dtype!r}; use auto, float32, float16 or bfloat16")
    return DTYPES[dtype]


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's API names it."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None  # per token: {token id: log-probability}, the chosen first


@dataclass
class RequestOutput:
    """A request's results, as vLLM's API names them."""
    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def request_output(comps: list[Completion], prompt_ids: list[int]) -> RequestOutput:
    def lps(c: Completion) -> list[dict[int, float]] | None:
        if c.logprobs is None:
            return None
        return [{t: ch, **{i: v for i, v in top if i != t}} for t, ch, top in zip(c.token_ids, c.logprobs.chosen,
                                                                                   c.logprobs.top)]

    return RequestOutput(comps[0].id, comps[0].prompt, prompt_ids,
                         [CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, lps(c)) for c in comps])


@dataclass
class GenerationOutput:
    """Every sample of every request (`completions`, in input order, samples together) and the
    run's measurements; iterating gives one vLLM-style RequestOutput per request."""
    completions: list[Completion]
    stats: RunStats
    policy: Policy | None = None
    requests: list[Request] = field(default_factory=list)

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self.outputs())

    def __len__(self) -> int:
        return len(self.outputs())

    def __getitem__(self, i: int) -> RequestOutput:
        return self.outputs()[i]

    def outputs(self) -> list[RequestOutput]:
        groups: dict[str, list[Completion]] = {}
        for c in self.completions:
            groups.setdefault(c.id, []).append(c)
        ids = {r.id: r.prompt_ids for r in self.requests}
        return [request_output(g, ids.get(rid, [])) for rid, g in groups.items()]


def _settings(sp: SamplingParams) -> dict[str, Any]:
    """A SamplingParams as a request's own settings."""
    return {f: getattr(sp, f) for f in FIELDS}


@dataclass
class EngineOptions:
    offload_dir: str | None = None
    budgets: Budgets = field(default_factory=Budgets)


class LLM:
    """A model ready to generate: `LLM("smollm2").generate(["Hello"])`."""

    def __init__(self, model: str | None = None, *, policy: Policy | str | None = None,
                 device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                 allow_pickle: bool = False, offload_dir: str | None = None,
                 gpu_mem: int | str | None = None, cpu_mem: int | str | None = None,
                 disk_mem: int | str | None = None,
                 seed: int = 0, progress: bool = False, hardware: str | None = None,
                 compression: tuple[str, str] = ("off", "off"), lora: Mapping[str, str] | None = None,
                 default_adapter: str | None = None, world: World | None = None):
        self.world = world  # this process's pipeline stage and replica (flexoff.parallel), if several
        if world is not None:
            if str(device) == "auto":
                device = world.device()
            cpu_mem, disk_mem = (world.share(validate.size(m)) for m in (cpu_mem, disk_mem))
            if offload_dir is not None:
                offload_dir = f"{offload_dir}/rank-{world.rank}"
            if lora and world.link is not None:
                raise InputError("LoRA adapters are not served by pipeline stages yet; run them with "
                                 "--pipeline-parallel 1 (data parallel) or in one process")
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.model: LoadedModel = load_model(model, allow_pickle)
        self.policy_arg = policy
        gpu_mem, cpu_mem, disk_mem = (validate.size(m) for m in (gpu_mem, cpu_mem, disk_mem))
        self.options = EngineOptions(offload_dir, Budgets(gpu_mem, cpu_mem, disk_mem))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._gpu_cap = gpu_mem if self.device.type == "cuda" else None
        self._capped = False
        self.seed = seed
        self.progress = progress
        self.hardware = hardware
        self.last_policy: Policy | None = None
        self.gpu_margin = 0  # GPU bytes --policy auto leaves unplanned, raised after running out
        self.last_trials: list[Any] = []  # `--policy auto`'s last trials (flexoff.trials.Trial)
        self.last_oom: dict[str, Any] | None = None  # what the GPU's last running out looked like
        self.compression = compression  # what --policy auto may use: off / on / auto, weights and cache
        self.engine: Engine | None = None
        # --policy auto for training: micro-batch -> (longest window planned, policy, prediction)
        self._training_plans: dict[int, tuple[int, Policy, Any]] = {}
        self.training_prediction: Any = None  # the cost model's Prediction of the last auto training step
        self.coserve_plan: Any = None  # the last auto co-served plan (policy.coserve_cost.CoServePlan)
        # the tiers and weights, which outlive engines
        link = world.link if world is not None else None
        if link is not None and link.stages > self.model.spec.num_layers:
            raise InputError(f"{link.stages} pipeline stages for a model of {self.model.spec.num_layers} blocks")
        # the layers this process runs (a pipeline stage's share), and the stage a policy is planned for
        self.engine_spec = stage_spec(self.model.spec, link.stage, link.stages) if link else self.model.spec
        self.plan_spec = stage_spec(self.model.spec, heaviest_stage(self.model.spec, link.stages),
                                    link.stages) if link else self.model.spec
        self.residency = Residency(self.model.family, self.engine_spec, self.device, self.dtype, offload_dir,
                                   self.options.budgets, link)
        self.allow_pickle = allow_pickle
        self.adapters: dict[str, Adapter] = {}  # LoRA adapters by name
        self._pool: tuple[tuple[tuple[str, int], ...], AdapterPool] | None = None
        self._job: Sequence[Request] = ()  # the requests being run (for --policy auto and the adapters' room)
        for name, path in (lora or {}).items():
            self.load_lora(name, path)
        if default_adapter is not None and default_adapter not in self.adapters:
            raise InputError(f"--default-adapter {default_adapter!r} is not a loaded adapter")
        self.default_adapter = default_adapter

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA folder under a name, checked against this model (one-line errors)."""
        if not name or "=" in name:
            raise InputError(f"adapter name {name!r}: give a non-empty name without '='")
        self.adapters[name] = load_adapter(name, path, self.model.spec, self.allow_pickle)

    def add_adapter(self, adapter: Adapter) -> None:
        """Serve an adapter made in memory (flexoff.adapters.Adapter, keyed by this model's layers
        and tensor names), as load_lora serves a folder."""
        if not adapter.name or "=" in adapter.name:
            raise InputError(f"adapter name {adapter.name!r}: give a non-empty name without '='")
        self.adapters[adapter.name] = adapter

    def adapter_need(self, block_size: int, requests: Sequence[Request] | None = None,
                     riders: Sequence[str] = ()) -> Need:
        """The device room the LoRA adapters of a job's blocks need (the job: `requests`, or the
        one being run; `riders`: adapters of co-served training windows, in any block)."""
        reqs = self._job if requests is None else requests
        pool = self.adapter_pool()
        if pool is None or not (riders or any(r.adapter for r in reqs)):
            return Need()
        return pool.need([r.adapter for r in b] + list(riders) for b in plan_blocks(reqs, block_size))

    def adapter_host_bytes(self, need: Need | None = None, blocks: int = CACHE_BLOCKS) -> int:
        """Host bytes of the loaded adapters in the compute dtype that the engine's plan counts:
        the held ones, and of those read from files what the cache keeps for `blocks` blocks of
        `need` (a policy's lora_cache_blocks)."""
        pool = self.adapter_pool()
        return pool.host_bytes(need, blocks) if pool is not None else 0

    def _used_adapters(self) -> list[str]:
        """The adapters the job uses (every loaded one, outside a job), in loading order."""
        used = {r.adapter for r in self._job} - {None} if self._job else set(self.adapters)
        return [n for n in self.adapters if n in used]

    def lora_held(self) -> float:
        """The part of lora_ranks() held in memory (the rest is read from files into a cache)."""
        return sum(self.adapter_rank(n) for n in self._used_adapters() if self.adapters[n].held)

    def lora_ranks(self) -> tuple[float, ...]:
        """Each adapter the job uses (every loaded one, outside a job) as the cost model sees it:
        the rank that on every linear layer would hold as many values."""
        return tuple(self.adapter_rank(n) for n in self._used_adapters())

    def adapter_rank(self, name: str) -> float:
        """A loaded adapter as the cost model sees it: the rank that on every linear layer would
        hold as many values."""
        per_rank = sum(self.model.spec.lora_width(j) for j in range(len(self.model.spec.layers)))
        return self.adapters[name].numel / per_rank

    def adapter_pool(self) -> AdapterPool | None:
        """The loaded adapters (made again when the set changes, or a name is loaded again)."""
        if not self.adapters:
            return None
        names = tuple((n, id(a)) for n, a in self.adapters.items())
        if self._pool is None or self._pool[0] != names:
            self._pool = (names, AdapterPool(list(self.adapters.values()), self.device, self.dtype,
                                                 self.model.spec))
        return self._pool[1]

    @property
    def tokenizer(self):
        return self.model.tokenizer

    # ---- requests ------------------------------------------------------
    def make_requests(self, prompts: Iterable[Any], defaults: SamplingParams) -> list[Request]:
        """Validate and tokenize prompts: str, list of chat messages, list of ids, or a dict
        with one of `prompt` / `messages` / `prompt_ids`, an optional `id` and settings."""
        out, seen = [], set()
        for n, p in enumerate(prompts):
            d = p if isinstance(p, dict) else {"prompt": p}
            where = f"line {d['_line']}" if "_line" in d else f"request {d.get('id', n)}"
            d = validate.request(d, where)
            rid = str(d.get("id", n))
            if rid in seen:
                raise InputError(f"{where}: duplicate id {rid!r}")
            seen.add(rid)
            settings = {k: v for k, v in d.items() if k in FIELDS}
            try:
                params = SamplingParams(**{**{f: getattr(defaults, f) for f in FIELDS}, **settings})
            except InputError as e:
                raise InputError(f"{where}: {e}") from None
            shown, ids = self._tokenize(d, where)
            self._check_length(where, len(ids), params.max_new_tokens)
            adapter = d.get("adapter", self.default_adapter)
            if adapter is not None and adapter not in self.adapters:
                known = ", ".join(sorted(self.adapters)) or "none loaded (--lora NAME=PATH)"
                raise InputError(f"{where}: unknown adapter {adapter!r}; loaded: {known}")
            out += [Request(rid, shown, ids, params, j, adapter) for j in range(params.n)]
        return out

    def _tokenize(self, d: dict[str, Any], where: str) -> tuple[Any, list[int]]:
        """The prompt as the output shows it, and its token ids (d passed validate.request)."""
        p = d.get("prompt")
        if "messages" in d or (isinstance(p, list) and isinstance(p[0], dict)):
            shown = d.get("messages", p)
            ids = self.tokenizer.chat(shown)
        elif "prompt_ids" in d or isinstance(p, list):
            shown = ids = d.get("prompt_ids", p)
            vocab = self.model.spec.vocab_size
            if max(ids) >= vocab:
                raise InputError(f"{where}: prompt_ids must be token ids below {vocab}, got {max(ids)}")
        else:
            shown, ids = p, self.tokenizer.encode(p)
        if not ids:
            raise InputError(f"{where}: the prompt is empty")
        return shown, ids

    def _check_length(self, where: str, n: int, gen: int) -> None:
        ctx = self.model.spec.max_positions
        if n + gen > ctx:
            what = "is longer than" if n > ctx else f"plus max_new_tokens {gen} exceeds"
            raise InputError(f"{where}: the prompt of {n} tokens {what} the model's context of {ctx} tokens")
        check = getattr(self.model.family, "check_length", None)
        if check:
            check(n + gen)

    # ---- engine --------------------------------------------------------
    def choose_policy(self, requests: Sequence[Request]) -> Policy:
        p = self.policy_arg
        if isinstance(p, Policy):
            return p
        if p is None:
            return Policy(gpu_batch_size=max(1, min(DEFAULT_BATCH, len(requests))))
        if p == "auto":
            from flexoff.autopolicy import auto_policy

            prompt = max(len(r.prompt_ids) for r in requests)
            gen = max(1, max(r.params.max_new_tokens for r in requests))
            job, self._job = self._job, requests  # the search plans these requests' adapters
            try:
                return auto_policy(self, prompt, gen, len(requests))
            finally:
                self._job = job
        return Policy.load(p)

    def choose_coserve_policy(self, requests: Sequence[Request], rider: Any) -> Policy:
        """`--policy auto` for inference with finetuning windows riding on its blocks: the searched
        co-served plan (policy/coserve_cost.py) for these requests and the rider's jobs, kept in
        `coserve_plan`. The rider takes the plan's window batches (at most the `batches` it had),
        and its slowdown bound the share of blocks the plan gives windows."""
        from flexoff.autopolicy import auto_coserve_plan

        names = rider.adapters
        plan = auto_coserve_plan(
            self, max(len(r.prompt_ids) for r in requests), max(1, max(r.params.max_new_tokens for r in requests)),
            len(requests), seq_len=rider.max_len, window_rows=max(1, sum(j.trainer.cfg.per_step for j in rider.jobs)),
            lora_rank=sum(self.adapter_rank(a) for a in names) / max(1, len(names)),
            limit=rider.bound.limit if rider.bound is not None else None, max_windows=rider.batches,
            need=self.adapter_need(len(requests), requests, names))
        self.coserve_plan = plan
        if plan.share == 0:  # the bound leaves windows no block: inference alone, the jobs after it
            rider.batches = 0
            return self.choose_policy(requests)
        rider.batches = plan.windows
        if rider.bound is not None:
            rider.bound.limit = plan.runtime_limit
        return plan.policy

    def choose_policy_for_training(self, n: int, seq_len: int, adapter: str) -> Policy:
        """The policy training steps of n sequences of up to seq_len tokens (of the loaded
        adapter `adapter`) run under: the one given, everything on the compute device, or (auto)
        the searched one, planned once for the longest window asked for so far (shorter steps run
        on the same engine)."""
        p = self.policy_arg
        if isinstance(p, Policy):
            return p
        if p == "auto":
            planned = self._training_plans.get(n)
            if planned is None or planned[0] < seq_len:
                from flexoff.autopolicy import auto_training_policy

                cand = auto_training_policy(self, seq_len, n, adapter)
                self._training_plans[n] = planned = (seq_len, cand.policy, cand.prediction)
            self.training_prediction = planned[2]
            return planned[1]
        return Policy.load(p) if p else Policy(gpu_batch_size=max(1, min(DEFAULT_BATCH, n)))

    def engine_for(self, policy: Policy, max_prompt: int, max_gen: int, training: bool = False,
                   need: Need = Need(), windows: int | None = None) -> Engine:
        """An engine for this policy and these sizes (and room for `need` of LoRA adapters): the
        current one while it fits (a training engine runs inference blocks too: finetuning's eval
        loss), else a new one whose weights the residency keeps, moves or
        reads again (offload.residency)."""
        from flexoff.quant.engine import formats

        e = self.engine
        # room for the windows' stash, and KV cache homes for the other batches (none for windows)
        room = e is not None and (e.windows is None or windows == e.windows)
        trains = not training or e is not None and e.training
        if e is not None and e.policy == policy and e.max_prompt >= max_prompt and e.max_gen >= max_gen \
                and trains and room and e.adapter_need.covers(need):
            return e
        if e is not None:  # its memory back to the device before the new engine's plan is checked
            self.drop_engine()
        if self._gpu_cap is not None and not self._capped:  # the allocator itself refuses more
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self._gpu_cap / total), self.device.index)
            self._capped = True
        m, link = self.model, self.residency.pipe
        fmt, codec = formats(policy, self.engine_spec, self.dtype)
        layers = m.spec.layers
        mine = stage_layers(m.spec, link.stage, link.stages) if link else tuple(range(len(layers)))

        def read(j: int, dev: torch.device) -> Mapping[str, torch.Tensor]:  # the stage's layer j
            g = mine[j]
            return {} if g is None else m.source.layer(g, layers[g], self.dtype, dev)

        # a checkpoint is read into CPU memory; dummy weights are made where they go
        read_dev = self.device if m.name.startswith("dummy:") else torch.device("cpu")
        self.engine = self.residency.engine(self.stage_policy(policy), fmt, codec, max_prompt, max_gen, read,
                                            read_dev, self.progress, need,
                                            self._keep_adapters(need, policy.lora_cache_blocks), training, windows)
        return self.engine

    def _keep_adapters(self, need: Need, blocks: int) -> int:
        """The host cache sized for an engine's blocks (room for `blocks` of them); the host bytes
        its plan counts."""
        pool = self.adapter_pool()
        return pool.keep_for(need, blocks) if pool is not None else 0

    def stage_policy(self, policy: Policy) -> Policy:
        """The policy a pipeline stage's engine runs: room for as many of the policy's blocks as
        there are stages, which follow each other through the stages as groups of one block."""
        link = self.residency.pipe
        return policy if link is None else policy.replace(num_gpu_batches=policy.num_gpu_batches * link.stages)

    def drop_engine(self) -> None:
        """Close the engine (after a failed run, or for another), keeping the resident weights,
        and give the CUDA allocator's cached blocks back (those of tensors a failed step's
        frames still held are given back by a later call, once the frames are gone; until then
        they count against the GPU budget, and a retry's peaks start from them)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.device.type == "cuda":
            gc.collect()  # tensors held only in reference cycles (tracebacks' frames)
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Give back every buffer: the engine's, the weights', the offload folder."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if getattr(self, "residency", None) is not None:
            self.residency.close()
        if getattr(self, "_capped", False):
            torch.cuda.set_per_process_memory_fraction(1.0, self.device.index)
            self._capped = False

    # ---- generation ----------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] | None = None,
                 prompt_logprobs: bool = False,
                 on_block: Callable[[list[Completion], RunStats], None] | None = None,
                 on_logits: Callable[[int, list[str], torch.Tensor], None] | None = None,
                 requests: list[Request] | None = None,
                 adapters: Sequence[str | None] | None = None, policy: Policy | None = None,
                 rider: Any = None) -> GenerationOutput:
        """Complete every prompt; completions come back in input order (a request's samples
        together). `sampling_params` (vLLM's form: one for all prompts, or one per prompt) takes
        the place of the keyword settings; a prompt's own settings (a dict's keys) win over both.
        `policy`: run under this one instead of the LLM's (finetuning's evaluation runs on the
        training engine). `rider` (flexoff.finetune.coserve.CoTrainer): finetuning jobs whose
        training windows take `rider.batches` GPU batches of every block."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if adapters is not None:  # one adapter name (or None) per prompt
            prompts = list(prompts)
            if len(adapters) != len(prompts):
                raise InputError(f"{len(adapters)} adapters for {len(prompts)} prompts")
            prompts = [{**(p if isinstance(p, dict) else {"prompt": p}), "adapter": a}
                       for p, a in zip(prompts, adapters)]
        if isinstance(sampling_params, SamplingParams):
            defaults = sampling_params
        elif sampling_params is not None:  # one per prompt: each becomes that prompt's own settings
            prompts = list(prompts)
            if len(sampling_params) != len(prompts):
                raise InputError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
            prompts = [{**(p if isinstance(p, dict) else {"prompt": p}), **_settings(sp)}
                       for p, sp in zip(prompts, sampling_params)]
            defaults = SamplingParams()
        else:
            defaults = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop or ()))
        reqs = requests if requests is not None else self.make_requests(prompts, defaults)
        link = self.residency.pipe
        if link is not None and on_logits is not None:
            raise InputError("pipeline stages do not report logits (on_logits); run in one process")
        stats = RunStats()
        if not reqs:
            return GenerationOutput([], stats)
        self._job = reqs
        if policy is None and rider is not None and self.policy_arg == "auto":
            policy = self.choose_coserve_policy(reqs, rider)
        policy = self.last_policy = policy or self.choose_policy(reqs)
        spare = rider.batches if rider is not None else 0  # GPU batches a block leaves to training windows
        if spare and self.stage_policy(policy).num_gpu_batches <= spare:
            raise InputError(f"co-serving gives {spare} GPU batches of each block to training; the policy "
                             f"{policy.describe()} has {policy.num_gpu_batches}: raise --num-gpu-batches")
        done: dict[str, Completion] = {}
        bar = tqdm(total=len(reqs), desc="generating", unit="prompt", disable=not self.progress)
        try:
            for attempt in range(OOM_RETRIES + 1):
                if attempt:  # the failed attempt's tensors went with its handler: give back their blocks
                    self.drop_engine()
                todo = [r for r in reqs if r.key not in done]
                try:  # setting up the engine may run out too (weights loaded through the GPU)
                    per_block = self.stage_policy(policy).block_size - spare * policy.gpu_batch_size
                    longest = max([len(r.prompt_ids) for r in todo] + ([rider.max_len] if spare else []))
                    engine = self.engine_for(policy, longest, max(1, max(r.params.max_new_tokens for r in todo)),
                                             training=bool(spare),
                                             need=self.adapter_need(per_block, todo, rider.adapters if spare else ()),
                                             windows=spare or None)
                    engine.adapters = pool = self.adapter_pool()
                    blocks = plan_blocks(todo, per_block)
                    for i, block in enumerate(blocks):
                        if pool is not None:  # the next block's adapters, read while this one runs
                            pool.upcoming = [r.adapter for r in blocks[i + 1]] if i + 1 < len(blocks) else []
                        comps, st = run_block(engine, self.tokenizer, block, self.seed, prompt_logprobs, on_logits,
                                              rider if spare else None)
                        st.peak_bytes = engine.peaks()
                        if link is not None:  # the last stage sampled them
                            comps, st = link.results((comps, st))
                        stats.add(st)
                        for r, c in zip(block, comps):
                            done[r.key] = c
                        if on_block is not None:
                            on_block(comps, st)
                        bar.update(len(block))
                        bar.set_postfix_str(f"{stats.generation_throughput:.1f} tok/s")
                    break
                except torch.OutOfMemoryError as e:
                    self.last_oom = oom_record(e, policy, self.device)
                    policy = self.last_policy = self._after_oom(policy, todo, attempt)
        finally:
            bar.close()
            self._job = ()
        return GenerationOutput([done[r.key] for r in reqs], stats, policy, reqs)

    def finetune(self, data: str | Sequence[Mapping[str, Any]], output: str, lora_config: Any = None, *,
                 init_adapter: str | None = None, steps: int | None = None, epochs: float | None = None,
                 config: Any = None, eval_data: str | Sequence[Mapping[str, Any]] | None = None,
                 max_seq_len: int = 1024, seed: int = 0, save_every: int = 10) -> list[float]:
        """Train a LoRA adapter into the PEFT folder `output`, as `flexoff finetune` does: `data`
        (and `eval_data`) a JSONL path or a list of records (text, prompt + completion, or
        messages); `lora_config` a finetune.LoraSpec, a peft.LoraConfig or a dict of its `r`,
        `lora_alpha`, `target_modules`; `config` a finetune.TrainConfig. Returns each step's loss;
        `load_lora(name, output)` serves the result."""
        import json
        import tempfile

        from flexoff.finetune.run import DEFAULT_TARGETS, LoraSpec, finetune as run_finetune
        from flexoff.finetune.trainer import TrainConfig

        lora = lora_config
        if lora is not None and not isinstance(lora, LoraSpec):
            get = (lambda k, d: lora.get(k, d)) if isinstance(lora, Mapping) else (lambda k, d: getattr(lora, k, d))
            targets = get("target_modules", None)
            lora = LoraSpec(int(get("r", 16)), float(get("lora_alpha", 32)),
                            tuple([targets] if isinstance(targets, str) else targets or DEFAULT_TARGETS))
        with tempfile.TemporaryDirectory(prefix="flexoff-data-") as tmp:
            def as_file(d: Any, name: str) -> str | None:
                if d is None or isinstance(d, str):
                    return d
                path = f"{tmp}/{name}.jsonl"
                with open(path, "w", encoding="utf-8") as f:
                    f.writelines(json.dumps(r) + "\n" for r in d)
                return path

            return run_finetune(self, as_file(data, "train"), output, lora=lora, init_adapter=init_adapter,
                                steps=steps, epochs=epochs, cfg=config or TrainConfig(), max_seq_len=max_seq_len,
                                seed=seed, progress=self.progress, save_every=save_every,
                                eval_data=as_file(eval_data, "eval"))

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             **kw: Any) -> GenerationOutput:
        """Complete one conversation (a list of {role, content}) or a list of them, each rendered
        with the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([{"messages": m} for m in convs], sampling_params, **kw)

    def _after_oom(self, policy: Policy, todo: list[Request], attempt: int) -> Policy:
        """The GPU ran out of memory setting up or in a block (finished blocks are kept). A searched
        policy is searched again with less GPU memory; a given one is an error that says what to
        change."""
        self.drop_engine()
        if self.policy_arg != "auto" or attempt == OOM_RETRIES:
            raise GpuOutOfMemoryError(
                f"the GPU ran out of memory running {policy.describe()}: lower --gpu-mem, move more "
                "weights or cache off the GPU, or use a smaller --gpu-batch-size") from None
        self.leave_more_gpu_memory()
        warnings.warn(f"out of GPU memory with {policy.describe()}; searching again with "
                      f"{self.gpu_margin / 2**30:.2f} GiB less GPU memory", stacklevel=3)
        return self.choose_policy(todo)

    def leave_more_gpu_memory(self) -> None:
        """After the GPU ran out of memory: policy searches leave oom_step more of it unplanned."""
        cap = self.options.budgets.gpu or (torch.cuda.get_device_properties(self.device).total_memory
                                           if self.device.type == "cuda" else 0)
        self.gpu_margin += oom_step(cap)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
