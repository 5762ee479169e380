"""The `flexoff` command line: a thin layer of click options over the library.

Knows: flags, their parsing into library objects (Policy, SamplingParams,
byte sizes), printing errors as one line with exit code 2, the summary line.
Does not know: how anything is computed.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import click

from flexoff import parallel, validate
from flexoff.errors import FlexoffError, InputError, PolicyError

_ARGV: list[str] = []  # the command's arguments (--pipeline-parallel starts workers that run the same)

def parse_size(text: str | None) -> int | None:
    """'16GiB', '500MB', '2e9' -> bytes (validate.size, as a click error)."""
    try:
        return validate.size(text)
    except FlexoffError as e:
        raise click.BadParameter(str(e)) from None


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return parse_size(value)


def policy_options(f: Any) -> Any:
    """The FlexGen-style policy flags, shared by the commands that run a model."""
    opts = [
        click.option("--policy", "policy_arg", default=None, metavar="auto|FILE.json",
                     help="A policy file, or 'auto' to search one (default: everything on the compute device)."),
        click.option("--percent", nargs=6, type=float, default=None, metavar="W_G W_C C_G C_C A_G A_C",
                     help="FlexGen placement: % of weights, KV cache and activations on GPU and CPU (rest on disk)."),
        click.option("--gpu-batch-size", type=int, default=None),
        click.option("--num-gpu-batches", type=int, default=None),
        click.option("--cpu-cache-compute", is_flag=True, default=None, help="Decode attention on the CPU where the KV cache lives there."),
        click.option("--no-overlap", is_flag=True, default=None, help="Do not overlap transfers with compute."),
        click.option("--compress-weight", is_flag=True, default=None, help="4-bit group-wise weights."),
        click.option("--compress-cache", is_flag=True, default=None, help="4-bit group-wise KV cache."),
        click.option("--gpu-mem", callback=_size, default=None, help="GPU memory budget, e.g. 16GiB."),
        click.option("--cpu-mem", callback=_size, default=None, help="CPU memory budget."),
        click.option("--disk-mem", callback=_size, default=None, help="Disk budget in --offload-dir."),
        click.option("--offload-dir", type=click.Path(file_okay=False), default=None,
                     help="Folder for disk offloading (default: a private temporary folder)."),
        click.option("--hardware", default=None, help="Hardware profile for --policy auto: a JSON file or a preset name."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def adapter_paths(loras: tuple[str, ...], lora_dir: str | None) -> dict[str, str]:
    """--lora NAME=PATH flags and --lora-dir's subfolders holding adapter_config.json, by name."""
    from flexoff.errors import InputError

    out: dict[str, str] = {}
    if lora_dir is not None:
        d = Path(lora_dir)
        if not d.is_dir():
            raise InputError(f"--lora-dir {lora_dir} is not a folder")
        out.update({sub.name: str(sub) for sub in sorted(d.iterdir()) if (sub / "adapter_config.json").exists()})
        if not out:
            raise InputError(f"--lora-dir {lora_dir} holds no PEFT adapter folders")
    for item in loras:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise InputError(f"--lora {item!r}: give NAME=PATH")
        if name in out:
            raise InputError(f"--lora {item!r}: the name {name!r} is given twice")
        out[name] = path
    return out


def lora_rank_list(text: str | None, count: int | None) -> tuple[int, ...]:
    """--lora-ranks 8,16,32 [--lora-adapters N]: N adapters' ranks, cycling through the list."""
    from flexoff.errors import InputError

    if text is None:
        if count is not None:
            raise InputError("--lora-adapters needs --lora-ranks")
        return ()
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise InputError(f"--lora-ranks {text!r}: give integers like 8,16,32") from None
    if not ranks or min(ranks) < 1:
        raise InputError(f"--lora-ranks {text!r}: ranks must be positive")
    n = count or len(ranks)
    return tuple(ranks[i % len(ranks)] for i in range(n))


def build_policy(policy_arg: str | None, percent: tuple[float, ...] | None, gpu_batch_size: int | None,
                 num_gpu_batches: int | None, cpu_cache_compute: bool | None, no_overlap: bool | None,
                 compress_weight: bool | None, compress_cache: bool | None) -> Any:
    """A Policy (or 'auto', or None for the default) from the flags."""
    from flexoff.policy.policy import Policy

    changes: dict[str, Any] = {}
    if gpu_batch_size is not None:
        changes["gpu_batch_size"] = gpu_batch_size
    if num_gpu_batches is not None:
        changes["num_gpu_batches"] = num_gpu_batches
    for name, flag in (("cpu_cache_compute", cpu_cache_compute), ("compress_weight", compress_weight),
                       ("compress_cache", compress_cache)):
        if flag:
            changes[name] = True
    if no_overlap:
        changes["overlap"] = False
    if policy_arg == "auto":
        placement = {k for k in changes if k not in ("compress_weight", "compress_cache")}
        if placement or percent:
            raise PolicyError("--policy auto chooses the placement and batch shape itself; drop the explicit "
                              "policy flags (--compress-weight and --compress-cache are allowed)")
        return "auto"
    if policy_arg is None and not changes and percent is None:
        return None
    base = Policy.load(policy_arg) if policy_arg else Policy()
    if percent is not None:
        base = base.with_percent(tuple(percent))
    return base.replace(**changes)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="flexoff")
def cli() -> None:
    """flexoff: high-throughput offline inference for models larger than GPU memory."""


@cli.command()
@click.option("--model", default=None, help="smollm2 (default), a checkpoint folder, a .gguf file, or dummy:NAME.")
@click.option("--input", "input_path", default="-", show_default=True, help="Prompts JSONL ('-' for stdin).")
@click.option("--output", "output_path", default="-", show_default=True,
              help="Completions JSONL, appended block by block; a rerun skips ids already there ('-' for stdout).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 keeps all tokens.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, help="Stop token id (repeatable).")
@click.option("--n", "n", type=int, default=1, show_default=True, help="Samples per prompt (seeds seed, seed + 1, ...).")
@click.option("--logprobs", type=int, default=None, help="Top log-probabilities per generated token (0: the chosen one's).")
@click.option("--min-tokens", type=int, default=0, show_default=True, help="No end-of-sequence before this many tokens.")
@click.option("--ignore-eos", is_flag=True, help="Generate past end-of-sequence tokens.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--presence-penalty", type=float, default=0.0, show_default=True)
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap plain prompts as a user message in the model's chat template.")
@click.option("--input-format", type=click.Choice(["auto", "flexoff", "openai"]), default="auto", show_default=True,
              help="flexoff JSONL or an OpenAI batch file (auto: by the first line's shape).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--allow-pickle", is_flag=True, help="Allow pickled .bin weights (loaded with weights_only=True).")
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH",
              help="A PEFT LoRA adapter folder, used by lines whose 'adapter' is NAME (repeatable).")
@click.option("--lora-dir", default=None, type=click.Path(file_okay=False),
              help="A folder whose subfolders are PEFT adapters, each named after its subfolder.")
@click.option("--default-adapter", default=None, help="The adapter of lines that name none.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--finetune", "finetune_jobs", multiple=True, metavar="JOB.yaml",
              help="Co-serve a LoRA finetuning job (YAML or JSON: data, output, lora_r, steps, ...; repeatable).")
@click.option("--finetune-batches", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPU batches of every block given to the finetuning jobs' training windows (with "
                   "--policy auto: the most a block may take; the co-served plan picks how many).")
@click.option("--max-inference-slowdown", "max_slowdown", default=None, metavar="PCT",
              help="With --finetune: the time training windows may add to inference (10% or 0.1); each "
                   "block takes as many of its --finetune-batches as that leaves room for.")
@click.option("--pipeline-parallel", type=click.IntRange(min=1), default=None,
              help="Pipeline stages, one process and GPU each; outside torchrun, starts N workers on this "
                   "host. Under torchrun: stages per replica (default: the host's processes).")
@policy_options
def run(model: str | None, input_path: str, output_path: str, max_new_tokens: int, temperature: float,
        top_p: float, top_k: int, seed: int, stop: tuple[str, ...], stop_token_ids: tuple[int, ...], n: int,
        logprobs: int | None, min_tokens: int, ignore_eos: bool, repetition_penalty: float, presence_penalty: float,
        frequency_penalty: float, chat: bool, input_format: str, dtype: str, device: str,
        allow_pickle: bool, loras: tuple[str, ...], lora_dir: str | None, default_adapter: str | None, quiet: bool,
        finetune_jobs: tuple[str, ...], finetune_batches: int, max_slowdown: str | None,
        pipeline_parallel: int | None, policy_arg: str | None, percent: Any, gpu_batch_size: Any,
        num_gpu_batches: Any, cpu_cache_compute: Any, no_overlap: Any, compress_weight: Any,
        compress_cache: Any, gpu_mem: Any, cpu_mem: Any, disk_mem: Any, offload_dir: Any, hardware: Any) -> None:
    """Generate completions for a JSONL file of prompts."""
    from flexoff.api import LLM
    from flexoff.jobs import read_prompts, run_job
    from flexoff.sampling import SamplingParams

    policy = build_policy(policy_arg, percent, gpu_batch_size, num_gpu_batches, cpu_cache_compute,
                          no_overlap, compress_weight, compress_cache)
    defaults = SamplingParams(max_new_tokens, temperature, top_p, top_k, None, tuple(stop), n, logprobs,
                              stop_token_ids, ignore_eos, min_tokens, repetition_penalty, presence_penalty,
                              frequency_penalty)
    if input_path != "-":
        read_prompts(input_path, chat, input_format)  # fail fast on a bad file, before loading the model
    validate.output_file(output_path, "--output", input_path)
    limit = validate.fraction(max_slowdown, "--max-inference-slowdown") if max_slowdown is not None else None
    if limit is not None and not finetune_jobs:
        raise InputError("--max-inference-slowdown bounds co-served finetuning: give --finetune JOB.yaml")
    if finetune_jobs:
        if pipeline_parallel is not None or parallel.in_torchrun():
            raise InputError("--finetune co-serves in one process; drop --pipeline-parallel and torchrun")
        from flexoff.finetune.jobfile import read_job

        specs = [read_job(path) for path in finetune_jobs]  # every file checked before the model loads
        names = [n for n, _ in specs]
        clash = sorted({n for n in names if names.count(n) > 1} | set(names) & set(adapter_paths(loras, lora_dir)))
        if clash:
            raise InputError(f"--finetune: the adapter name {clash[0]!r} is taken twice (give the job a 'name')")
        if policy is None:  # the default: a block of inference batches plus the windows' batches
            from flexoff.policy.policy import Policy

            policy = Policy(gpu_batch_size=8, num_gpu_batches=1 + finetune_batches)
    if pipeline_parallel is not None and not parallel.in_torchrun():
        if input_path == "-":
            raise InputError("--pipeline-parallel reads --input from a file; give its path")
        raise click.exceptions.Exit(parallel.launch(pipeline_parallel, _ARGV))
    world = parallel.init(pipeline_parallel) if parallel.in_torchrun() else None
    try:
        llm = LLM(model, policy=policy, device=device, dtype=dtype, allow_pickle=allow_pickle,
                  offload_dir=offload_dir, gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem, seed=seed,
                  progress=not quiet and (world is None or world.leader), hardware=hardware,
                  compression=("on" if compress_weight else "off", "on" if compress_cache else "off"),
                  lora=adapter_paths(loras, lora_dir), default_adapter=default_adapter, world=world)
        try:
            if finetune_jobs:
                res, trained = _coserve(llm, specs, finetune_batches, limit, quiet, input_path, output_path,
                                        defaults, chat, input_format)
            else:
                res, trained = run_job(llm, input_path, output_path, defaults, chat, input_format), []
        finally:
            llm.close()
    finally:
        if world is not None:
            world.close()
    if world is not None and not world.leader:
        return
    st = res.stats
    if res.skipped:
        click.echo(f"resumed: {res.skipped} of {res.total} prompts were already answered", err=True)
    where = ""
    if world is not None:
        where = f"{world.stages} pipeline stages: " if world.stages > 1 else ""
        where = f"replica {world.replica + 1} of {world.replicas}, {where}" if world.replicas > 1 else where
    if llm.last_policy is not None:
        click.echo(f"{where}policy: {llm.last_policy.describe()}", err=True)
    peaks = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in st.peak_bytes.items())
    click.echo(where + st.summary() + (f"; peak memory {peaks}" if peaks else ""), err=True)
    for line in trained:
        click.echo(line, err=True)


def _coserve(llm: Any, specs: list[tuple[str, Any]], batches: int, limit: float | None, quiet: bool,
             *job: Any) -> tuple[Any, list[str]]:
    """The prompts of `job` (run_job's arguments) with the finetuning jobs riding on their blocks
    (as many window batches as `limit`, the inference slowdown allowed, leaves room for), then
    the jobs' remaining steps; each job's adapter saved in its output folder."""
    from contextlib import ExitStack

    from flexoff.finetune.coserve import CoTrainer, SlowdownBound
    from flexoff.finetune.jobfile import job_summary
    from flexoff.finetune.run import FinetuneJob
    from flexoff.jobs import run_job

    with ExitStack() as stack:
        runs = [stack.enter_context(FinetuneJob(llm, spec, name, progress=not quiet, position=1 + i))
                for i, (name, spec) in enumerate(specs)]
        bound = SlowdownBound(limit) if limit is not None else None
        rider = CoTrainer([r.job for r in runs], batches, bound)
        res = run_job(llm, *job, rider=rider)
        carried = [len(r.job.losses) for r in runs]
        rider.finish()
    lines = [job_summary(name, r.job.losses, spec.output) for (name, spec), r in zip(specs, runs)]
    if llm.coserve_plan is not None:
        plan = llm.coserve_plan
        lines.append(f"co-serving plan: {plan.describe()}" if plan.share == 0 else
                     f"co-serving plan: {plan.policy.describe()}; {plan.describe()}")
    if bound is not None:
        lines.append(f"co-serving: training windows added {100 * bound.slowdown:.1f}% to inference's "
                     f"{bound.inference_s:.1f} s (bound {100 * limit:g}%); {sum(carried)} steps rode on "
                     "inference blocks, the rest ran after them")
    return res, lines


@cli.command()
@click.option("--model", default=None, help="As for `flexoff run`.")
@click.option("--data", "data_path", required=True, help="Training JSONL: text, prompt + completion, or messages.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Folder for the PEFT adapter.")
@click.option("--lora-r", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--lora-alpha", type=float, default=32.0, show_default=True)
@click.option("--lora-targets", default=None, help="Comma-separated module names (default: every linear layer).")
@click.option("--init-adapter", default=None, type=click.Path(file_okay=False), help="Start from this PEFT adapter.")
@click.option("--steps", type=click.IntRange(min=1), default=None)
@click.option("--epochs", type=click.FloatRange(min=0, min_open=True), default=None)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=2e-4, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sequences per micro-batch.")
@click.option("--grad-accum", type=click.IntRange(min=1), default=1, show_default=True,
              help="Micro-batches per optimizer step (one mean loss over all their tokens).")
@click.option("--eval-data", default=None, help="Validation JSONL: its loss every --save-every steps and at the end.")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=1024, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--schedule", type=click.Choice(["constant", "linear", "cosine"]), default="cosine", show_default=True)
@click.option("--max-grad-norm", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--save-every", type=click.IntRange(min=1), default=10, show_default=True,
              help="Steps between checkpoints (a rerun of the same command continues from the last).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto")
@click.option("--device", default="auto")
@click.option("--quiet", "-q", is_flag=True)
@policy_options
def finetune(model: str | None, data_path: str, output: str, lora_r: int, lora_alpha: float, lora_targets: str | None,
             init_adapter: str | None, steps: int | None, epochs: float | None, lr: float, batch_size: int,
             grad_accum: int, eval_data: str | None, max_seq_len: int, warmup: int, schedule: str, max_grad_norm: float, seed: int, save_every: int,
             dtype: str, device: str, quiet: bool, policy_arg: Any, percent: Any, gpu_batch_size: Any, num_gpu_batches: Any,
             cpu_cache_compute: Any, no_overlap: Any, compress_weight: Any, compress_cache: Any, gpu_mem: Any,
             cpu_mem: Any, disk_mem: Any, offload_dir: Any, hardware: Any) -> None:
    """Train a LoRA adapter (a PEFT folder) while the base model streams through the tiers."""
    from flexoff.api import LLM
    from flexoff.finetune.run import DEFAULT_TARGETS, LoraSpec, finetune as run_finetune
    from flexoff.finetune.trainer import TrainConfig

    policy = build_policy(policy_arg, percent, gpu_batch_size, num_gpu_batches, cpu_cache_compute,
                          no_overlap, compress_weight, compress_cache)
    validate.output_folder(output, "--output")
    cfg = TrainConfig(lr=lr, batch_size=batch_size, grad_accum=grad_accum,
                      max_grad_norm=max_grad_norm if max_grad_norm > 0 else None, warmup=warmup, schedule=schedule)
    targets = tuple(t.strip() for t in lora_targets.split(",")) if lora_targets else DEFAULT_TARGETS
    with LLM(model, policy=policy, device=device, dtype=dtype, offload_dir=offload_dir, gpu_mem=gpu_mem,
             cpu_mem=cpu_mem, disk_mem=disk_mem, progress=False, hardware=hardware,
             compression=("on" if compress_weight else "off", "off")) as llm:
        losses = run_finetune(llm, data_path, output, lora=LoraSpec(lora_r, lora_alpha, targets),
                              init_adapter=init_adapter, steps=steps, epochs=epochs, cfg=cfg,
                              max_seq_len=max_seq_len, seed=seed, progress=not quiet, save_every=save_every,
                              eval_data=eval_data)
    if llm.last_policy is not None:
        pred = llm.training_prediction
        planned = f" (planned: {pred.latency:.3g} s a block, {pred.throughput:.0f} training tok/s)" if pred else ""
        click.echo(f"policy: {llm.last_policy.describe()}{planned}", err=True)
    from flexoff.finetune.jobfile import job_summary

    click.echo(job_summary(Path(output).name, losses, output), err=True)


@cli.command()
@click.option("--model", default=None, help="As for `flexoff run`.")
@click.option("--text", "text_path", required=True, type=click.Path(dir_okay=False), help="A UTF-8 text file.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None, help="Score only the first N tokens.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto")
@click.option("--device", default="auto")
@click.option("--compress-weight", is_flag=True, help="4-bit group-wise weights.")
@click.option("--compress-cache", is_flag=True, help="4-bit group-wise KV cache.")
@click.option("--gpu-batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--lora", default=None, metavar="PATH", help="Score with this PEFT LoRA adapter.")
def ppl(model: str | None, text_path: str, max_tokens: int | None, dtype: str, device: str,
        compress_weight: bool, compress_cache: bool, gpu_batch_size: int, lora: str | None) -> None:
    """Perplexity of a model on a text (the last line is `perplexity <value>`)."""
    from flexoff.api import LLM
    from flexoff.errors import InputError
    from flexoff.policy.policy import Policy
    from flexoff.ppl import perplexity

    try:
        text = open(text_path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {text_path}: {e}") from None
    policy = Policy(gpu_batch_size=gpu_batch_size, compress_weight=compress_weight, compress_cache=compress_cache)
    with LLM(model, policy=policy, device=device, dtype=dtype, lora={"lora": lora} if lora else None,
             default_adapter="lora" if lora else None) as llm:
        r = perplexity(llm, text, max_tokens)
    click.echo(f"model {llm.model.name}, dtype {str(llm.dtype).replace('torch.', '')}, "
               f"weights {'4-bit' if compress_weight else 'dense'}, cache {'4-bit' if compress_cache else 'dense'}")
    click.echo(f"{r.tokens} tokens scored in {r.windows} non-overlapping windows of {r.window} tokens "
               f"(the smaller of the model's context and {512})")
    click.echo(f"perplexity {r.value:.4f}")


@cli.command()
@click.option("--offload-dir", type=click.Path(file_okay=False), default=None, help="Where disk bandwidth is measured.")
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Also write the profile here.")
def profile(offload_dir: str | None, output: str | None) -> None:
    """Measure this machine for the cost model (about two minutes) and cache the result."""
    from flexoff import profiler
    from flexoff.policy import calibration, hardware

    if output:
        validate.output_file(output, "--output")
    hw = profiler.measure(offload_dir, log=lambda m: click.echo(m, err=True))
    hardware.save(hw, hardware.cache_path())
    calibration.forget()  # the engine's rates kept so far start over with the new profile
    if output:
        hardware.save(hw, Path(output))
    click.echo(hardware_table(hw))
    click.echo(f"cached in {hardware.cache_path()}")


def hardware_table(hw: Any) -> str:
    from dataclasses import asdict

    rows = []
    for k, v in asdict(hw).items():
        if isinstance(v, str):
            rows.append(f"{k:18} {v}")
        elif isinstance(v, tuple):  # prefill matmuls by hidden size
            rows.append(f"{k:18} " + (", ".join(f"{h}: {f / 1e12:.3g} TFLOP/s" for h, f in v) or "-"))
        elif k.endswith("_mem"):
            rows.append(f"{k:18} {v / 2**30:10.1f} GiB")
        elif "flops" in k:
            rows.append(f"{k:18} {v / 1e12:10.3f} TFLOP/s")
        elif k.endswith("_s"):
            rows.append(f"{k:18} {v * 1e3:10.3f} ms")
        else:
            rows.append(f"{k:18} {v / 1e9:10.2f} GB/s")
    return "\n".join(rows)


@cli.group()
def policy() -> None:
    """Search offloading policies with the cost model."""


@policy.command("search")
@click.option("--model", required=True, help="Any model name flexoff accepts (dummy:NAME needs no weights).")
@click.option("--prompt-len", type=click.IntRange(min=1), required=True)
@click.option("--gen-len", type=click.IntRange(min=1), required=True)
@click.option("--num-prompts", type=click.IntRange(min=1), default=None, help="Sequences in the job (default: unbounded).")
@click.option("--gpu-mem", callback=_size, default=None)
@click.option("--cpu-mem", callback=_size, default=None)
@click.option("--disk-mem", callback=_size, default=None)
@click.option("--hardware", default=None, help="A profile file or preset (flexgen-t4, h200); default: this machine.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16", show_default=True)
@click.option("--compress-weight", "cw", type=click.Choice(["off", "on", "auto"]), default="off", show_default=True)
@click.option("--compress-cache", "cc", type=click.Choice(["off", "on", "auto"]), default="off", show_default=True)
@click.option("--cpu-attention", type=click.Choice(["off", "on", "auto"]), default="auto", show_default=True)
@click.option("--no-overlap", is_flag=True)
@click.option("--max-latency", type=click.FloatRange(min=0, min_open=True), default=None, help="Seconds per block.")
@click.option("--objective", type=click.Choice(["throughput", "latency"]), default="throughput", show_default=True)
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Runner-up policies to show.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the chosen Policy here.")
@click.option("--lora-ranks", default=None, metavar="R1,R2,...",
              help="LoRA adapters the job uses, each on every linear layer with its rank (e.g. 8,16,32,64).")
@click.option("--lora-adapters", type=click.IntRange(min=1), default=None,
              help="How many adapters, cycling through --lora-ranks (default: one per rank).")
def policy_search(model: str, prompt_len: int, gen_len: int, num_prompts: int | None, gpu_mem: Any, cpu_mem: Any,
                  disk_mem: Any, hardware: str | None, dtype: str, cw: str, cc: str, cpu_attention: str,
                  no_overlap: bool, max_latency: float | None, objective: str, top: int, json_path: str | None,
                  lora_ranks: str | None, lora_adapters: int | None) -> None:
    """Find the best policy for a model and workload, and explain it."""
    from flexoff.checkpoint import load_model
    from flexoff import profiler
    from flexoff.policy.cost_model import Workload
    from flexoff.policy.search import Budget, search

    if json_path:
        validate.output_file(json_path, "--json")
    spec = load_model(model).spec
    hw = profiler.load(hardware, log=lambda m: click.echo(m, err=True))
    budget = Budget.of(hw, gpu_mem, cpu_mem, disk_mem)
    ranks = lora_rank_list(lora_ranks, lora_adapters)
    # adapters from folders, as `flexoff run --lora` reads them: host memory caches two blocks' worth
    work = Workload(prompt_len, gen_len, {"float32": 4}.get(dtype, 2), num_prompts, ranks, lora_held=0.0)
    cands = search(spec, hw, work, budget, compress_weight=cw, compress_cache=cc, cpu_attention=cpu_attention,
                   overlap=not no_overlap, max_latency=max_latency, objective=objective)
    best = cands[0]
    p, gib = best.prediction, 2**30
    click.echo(f"model {spec.name} on {hw.name}, prompt {prompt_len} + gen {gen_len}, budgets GPU "
               f"{budget.gpu / gib:.1f} GiB, CPU {budget.cpu / gib:.1f} GiB, disk {budget.disk / gib:.1f} GiB")
    click.echo(f"policy      {best.policy.describe()}")
    click.echo(f"prefill     {p.prefill_s:.3f} s per block of {best.policy.block_size}")
    click.echo(f"decode      {p.decode_s:.3f} s per block")
    click.echo(f"throughput  {p.throughput:.3f} tokens/s (predicted)")
    click.echo(f"bottleneck  {p.bottleneck}")
    click.echo("memory      " + ", ".join(f"{t} {v / gib:.2f} GiB" for t, v in p.memory.items()))
    if ranks:
        from flexoff.policy.cost_model import lora_host_ranks, lora_per_block, lora_staged

        width = sum(spec.lora_width(j) for j in range(len(spec.layers)))
        used, mean = lora_per_block(work, best.policy.block_size)
        held = used * mean * width * work.elem_bytes / gib
        where = "paged in with each layer's weights"
        if best.policy.w_gpu_percent >= 100:
            where = "on the GPU" + (" (as much again for the next block's, staged)"
                                    if lora_staged(work, best.policy.block_size) else "")
        blocks = best.policy.lora_cache_blocks
        cached = lora_host_ranks(work, best.policy.block_size, blocks) * width * work.elem_bytes / gib
        reads = "ahead" if blocks > 1 else "as each block begins"
        click.echo(f"lora        {len(ranks)} adapters (mean rank {mean:g}) on every linear layer; a block uses "
                   f"{used}: {held:.2f} GiB {where}, {cached:.2f} GiB cached in CPU memory for {blocks} "
                   f"block{'s' * (blocks > 1)} (the rest read from their files {reads}), "
                   f"{2 * mean * width:.3g} FLOPs per token (base "
                   f"{sum(spec.linear_flops(j) for j in range(len(spec.layers))):.3g})")
    if len(cands) > 1:
        click.echo("runners-up:")
        for c in cands[1:top + 1]:
            q = c.prediction
            click.echo(f"  {c.policy.describe():60} {q.throughput:9.3f} tok/s  latency {q.latency:9.2f} s  {q.bottleneck}")
    if json_path:
        best.policy.save(json_path)
        click.echo(f"wrote {json_path}")


@cli.group("eval")
def eval_group() -> None:
    """HELM runs on flexoff (needs crfm-helm: pip install -e '.[eval]')."""


@eval_group.command("run")
@click.option("--run-entries", "-r", "entries", multiple=True, metavar="SCENARIO:KEY=VALUE,...",
              help="HELM run entries, e.g. synthetic_reasoning:mode=pattern_match (repeatable).")
@click.option("--conf-paths", "confs", multiple=True, type=click.Path(dir_okay=False),
              help="HELM run-entry files (.conf, HOCON) (repeatable).")
@click.option("--model", default=None, help="As for `flexoff run`; in HELM its name is flexoff/<name>.")
@click.option("--max-eval-instances", type=click.IntRange(min=1), default=None)
@click.option("--num-train-trials", type=click.IntRange(min=1), default=None)
@click.option("--suite", default="default", show_default=True)
@click.option("--output-path", "-o", default="benchmark_output", show_default=True, type=click.Path(file_okay=False))
@click.option("--local-path", default="prod_env", show_default=True, type=click.Path(file_okay=False),
              help="Where the model's HELM metadata is written (helm-summarize reads it from here).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto")
@click.option("--device", default="auto")
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH",
              help="A PEFT LoRA adapter, used by run entries with adapter=NAME (repeatable).")
@click.option("--lora-dir", default=None, type=click.Path(file_okay=False), help="As for `flexoff run`.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option("--verbose", "-v", is_flag=True, help="HELM's own log of every step.")
@policy_options
def eval_run(entries: tuple[str, ...], confs: tuple[str, ...], model: str | None, max_eval_instances: int | None,
             num_train_trials: int | None, suite: str, output_path: str, local_path: str, dtype: str, device: str,
             loras: tuple[str, ...], lora_dir: str | None, quiet: bool, verbose: bool, policy_arg: Any, percent: Any,
             gpu_batch_size: Any, num_gpu_batches: Any, cpu_cache_compute: Any, no_overlap: Any, compress_weight: Any,
             compress_cache: Any, gpu_mem: Any, cpu_mem: Any, disk_mem: Any, offload_dir: Any, hardware: Any) -> None:
    """Run HELM evaluations; each lands in OUTPUT/runs/SUITE/RUN_NAME/ and resumes if interrupted."""
    from flexoff.eval.helm_env import announce, helm_name, register, require_helm

    require_helm()
    from helm.benchmark.runner import set_benchmark_output_path

    from flexoff.api import LLM
    from flexoff.eval.runner import closing_row, closing_table, parse_entries, quiet_helm, run_specs, run_suite, \
        safe_part

    if not entries and not confs:
        raise InputError("give --run-entries or --conf-paths")
    safe_part(suite, "--suite")
    validate.output_folder(output_path)
    name = model or "smollm2"
    quiet_helm(not verbose)
    parsed = parse_entries(list(entries), list(confs), name, helm_name(name))
    announce(name)
    set_benchmark_output_path(output_path)
    specs = run_specs(parsed, max_eval_instances, num_train_trials)  # refused here, before any loading
    lora = adapter_paths(loras, lora_dir)
    for _, adapter in specs:
        if adapter is not None and adapter not in lora:
            raise InputError(f"adapter={adapter}: not loaded (give --lora {adapter}=PATH)")
    policy = build_policy(policy_arg, percent, gpu_batch_size, num_gpu_batches, cpu_cache_compute,
                          no_overlap, compress_weight, compress_cache)
    llm = LLM(model, policy=policy, device=device, dtype=dtype, offload_dir=offload_dir,
              lora=lora, gpu_mem=gpu_mem,
              cpu_mem=cpu_mem, disk_mem=disk_mem, hardware=hardware, progress=False,
              compression=("on" if compress_weight else "off", "on" if compress_cache else "off"))
    try:
        register(name, llm, local_path)
        for line in run_suite(llm, specs, output_path, suite, local_path, quiet):
            click.echo(line, err=True)
    finally:
        llm.close()
    runs = Path(output_path) / "runs" / suite
    click.echo(closing_table([(spec.name, closing_row(runs / spec.name)) for spec, _ in specs]))
    click.echo(f"results in {runs}; tables: helm-summarize --suite {suite} -o {output_path} "
               f"--local-path {local_path}", err=True)


@eval_group.command("summarize")
@click.option("--suite", default="default", show_default=True)
@click.option("--output-path", "-o", default="benchmark_output", show_default=True, type=click.Path(file_okay=False))
@click.option("--local-path", default="prod_env", show_default=True, type=click.Path(file_okay=False))
def eval_summarize(suite: str, output_path: str, local_path: str) -> None:
    """HELM's own helm-summarize for the suite (its tables under OUTPUT/runs/SUITE/)."""
    import subprocess

    from flexoff.eval.helm_env import require_helm
    from flexoff.eval.runner import safe_part

    require_helm()
    safe_part(suite, "--suite")
    if not (Path(output_path) / "runs" / suite).is_dir():
        raise InputError(f"no runs of suite {suite!r} under {output_path}/runs")
    done = subprocess.run([sys.executable, "-m", "helm.benchmark.presentation.summarize", "--suite", suite,
                           "-o", output_path, "--local-path", local_path], capture_output=True, text=True)
    if done.returncode != 0:
        raise FlexoffError(f"helm-summarize failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    click.echo(f"wrote HELM's summary of {suite} under {Path(output_path) / 'runs' / suite}", err=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors are one line on stderr and exit code 2."""
    global _ARGV
    _ARGV = list(argv) if argv is not None else sys.argv[1:]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run cleanups (offload folder) on kill
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))  # and when the terminal closes
    try:
        cli.main(args=argv, prog_name="flexoff", standalone_mode=False)
        return 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.UsageError as e:
        click.echo(f"flexoff: error: {e.format_message()}", err=True)
        return 2
    except click.Abort:
        click.echo("flexoff: interrupted", err=True)
        return 130
    except FlexoffError as e:
        click.echo(f"flexoff: error: {e}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo("flexoff: interrupted", err=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
