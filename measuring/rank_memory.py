"""Each rank's memory in real multi-process training steps, measured, for the memory model's per-rank estimates.

torchrun starts the ranks (gloo, CPU) of one run: `python -m measuring.rank_memory SPEC.json OUT.json`
in every rank, SPEC naming the layout, the model's config and the settings. Each rank builds the same
`from_config` Llama, splits it as the trainer does and runs optimizer steps of the trainer's step
(`fulltune.runtime.step.run_step`) under one of torch's memory trackers; rank 0 writes every rank's result
(`measuring.measure.send_to_driver`).

- `fsdp`: FSDP2 shards (`sharding.shard_model`) and the trainer's optimizer builder, under FSDPMemTracker;
- `tensor_parallel`: the tensor-parallel plan (`parallel.apply`, FSDP2 over "dp") and fused AdamW, under
  FSDPMemTracker;
- `context_parallel`: Ulysses over the "cp" group and FSDP2 over every process (`parallelize.apply`, as the
  trainer), each micro-batch this rank's share of its rows (`ContextParallel.shard`: packed rows when
  `attention_mask`), under FSDPMemTracker;
- `pipeline`: this rank's stage (`pipeline_parallel.PipelineRun`) under the schedule, under MemTracker (its
  peak only), then untracked steps for their wall times; `pipeline_reference` runs the same steps in one
  process;
- `export`: the final export of FSDP2 shards (`sharding.save_pretrained`, one file at a time), this process's
  resident set sampled every 2 ms (`measuring.measure.peak_during`), beside the plan's host figures
  (`memory.process.export_host_bytes`, `export_phase_bytes`).

Measured: every tensor torch allocates on CPU. Not measured: the process itself, gloo's own buffers, CUDA.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fulltune.memory import Settings

KINDS = ("fsdp", "tensor_parallel", "context_parallel", "pipeline", "export")
STEPS = 2  # tracked optimizer steps of `fsdp` and `tensor_parallel`
COLLECTIVE_TIMEOUT_S = 120  # a pipeline rank's every collective


def measure_ranks(kind: str, config: dict[str, Any], settings: Settings, processes: int, *, timeout_s: float = 900,
                  **options: Any) -> list[dict[str, Any]]:
    """Run `kind` (see the module's docstring) of the Llama `config` (LlamaConfig keyword arguments) under
    `settings` in `processes` torchrun ranks; every rank's result, in rank order. `options`: the pipeline's
    `schedule`, `steps` and `timed_steps`; the export's `out` (a directory), `shard_bytes` and `whole`; fsdp's and
    tensor_parallel's `cases` (`against_estimates`: a list of {"config", "settings"} measured in turn; each rank's
    result is the list of its cases' results).

    Raises:
        RuntimeError: no result came back (torchrun's output); subprocess.TimeoutExpired past `timeout_s`.
    """
    from measuring.measure import torchrun_results

    with tempfile.TemporaryDirectory(prefix="fulltune-ranks-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"kind": kind, "config": config, "settings": asdict(settings), **options}))
        out = Path(tmp) / "ranks.json"
        return torchrun_results(["--module", "measuring.rank_memory", str(spec), str(out)], processes, out,
                                timeout_s=timeout_s, what=f"{kind} {json.dumps(options)}")


def against_estimate(kind: str, config: dict[str, Any], settings: Settings, processes: int) -> dict[str, Any]:
    """`kind` (fsdp or tensor_parallel) measured in every rank against `estimate_memory`'s per-rank peak:
    {"estimate_peak_bytes", "estimate_peak_phase", "ranks": [{"rank", "measured_peak_bytes",
    "measured_breakdown", "fsdp_categories", "error"}]}, `error` the estimate's relative to the rank's peak."""
    return against_estimates(kind, [(config, settings)], processes)[0]


def against_estimates(kind: str, cases: list[tuple[dict[str, Any], Settings]], processes: int) -> list[dict[str, Any]]:
    """`against_estimate` of each (config, settings) of `cases`, one after another in the same `processes` ranks
    (one torchrun: the ranks start once); the results in the order of `cases`."""
    from fulltune.memory import estimate_memory

    (config, settings), *_ = cases
    measured = measure_ranks(kind, config, settings, processes,
                             cases=[{"config": config, "settings": asdict(settings)} for config, settings in cases])
    results = []
    for i, (config, settings) in enumerate(cases):
        estimate = estimate_memory(_config(config), settings)
        results.append({
            "estimate_peak_bytes": estimate.peak_bytes, "estimate_peak_phase": estimate.peak_phase,
            "ranks": [{"rank": rank, "measured_peak_bytes": r[i]["peak_bytes"], "measured_breakdown": r[i]["breakdown"],
                       "fsdp_categories": r[i]["raw"], "error": estimate.peak_bytes / r[i]["peak_bytes"] - 1}
                      for rank, r in enumerate(measured)]})
    return results


def _llama(config: dict[str, Any], settings: Settings) -> Any:
    """The `from_config` Llama every rank builds alike (seed 0), in training mode with its checkpointed layers."""
    import torch
    from transformers import AutoModelForCausalLM

    from fulltune.attention import kernel
    from fulltune.runtime.checkpointing import apply_gradient_checkpointing

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(config), attn_implementation=kernel(settings.attn_implementation))
    model.train()
    apply_gradient_checkpointing(model, settings.gradient_checkpointing)
    return model


def fsdp_rank(config: dict[str, Any], settings: Settings, steps: int = STEPS) -> dict[str, Any]:
    """`steps` optimizer steps of FSDP2 shards in this rank under FSDPMemTracker; its peak and breakdown."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fulltune.runtime import optim, sharding
    from fulltune.runtime.loss import TargetHead

    sharding.init_process_group("cpu")
    model = _llama(config, settings)
    head = TargetHead(model, chunked=settings.chunked_loss)
    sharding.shard_model(model, device="cpu", mixed_precision=settings.mixed_precision)
    optimizer = optim.optimizer_for(model, settings)  # the trainer's builder: fused AdamW, or stepped in backward
    return _tracked_steps(FSDPMemTracker(model, optimizer), model, head, optimizer, settings, steps)


def tensor_parallel_rank(config: dict[str, Any], settings: Settings, steps: int = STEPS) -> dict[str, Any]:
    """`steps` optimizer steps of the tensor-parallel plan in this rank under FSDPMemTracker; its peak and
    breakdown."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fulltune.runtime import parallel, sharding
    from fulltune.runtime.loss import TargetHead

    sharding.init_process_group("cpu")
    model = _llama(config, settings)
    head = TargetHead(model)
    parallel.apply(model, settings.dims, "cpu", settings.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return _tracked_steps(FSDPMemTracker(model, optimizer), model, head, optimizer, settings, steps)


def context_parallel_rank(config: dict[str, Any], settings: Settings, steps: int = STEPS) -> dict[str, Any]:
    """`steps` optimizer steps of context parallel over FSDP2 in this rank under FSDPMemTracker (the trainer's
    `parallelize.apply`, its optimizer builder, each micro-batch's share of the rows); its peak and breakdown."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fulltune.runtime import context_parallel, optim, parallelize, sharding
    from fulltune.runtime.loss import TargetHead

    sharding.init_process_group("cpu")
    model = _llama(config, settings)
    head = TargetHead(model, chunked=settings.chunked_loss)
    parallelize.apply(model, settings.dims, "cpu", settings.mixed_precision)
    optimizer = optim.optimizer_for(model, settings)
    return _tracked_steps(FSDPMemTracker(model, optimizer), model, head, optimizer, settings, steps,
                          context=context_parallel.active())


def _tracked_steps(tracker: Any, model: Any, head: Any, optimizer: Any, settings: Settings,
                   steps: int, context: Any = None) -> dict[str, Any]:
    """The trainer's step `steps` times under `tracker`, on the batch the estimate assumes (a padded row, every
    position a target; with `context`, its share of rows packed with two documents each when the estimate assumes
    a mask, else whole rows); the tracker's peak. bf16 is FSDP's MixedPrecisionPolicy here, not autocast."""
    from fulltune.planning.trace import make_batch
    from fulltune.runtime.step import LocalAccelerator, StepParts, run_step

    accumulation = settings.gradient_accumulation_steps
    accelerator = LocalAccelerator("cpu", "no", accumulation)
    parts = StepParts.assemble(accelerator, model, head, optimizer, settings,
                               before_micro_batch=tracker.reset_mod_stats)  # the tracker needs the reset
    targets = settings.micro_batch_size * settings.targets_per_row * accumulation * accelerator.num_processes

    def batch() -> tuple[dict[str, Any], Any]:
        inputs, step_targets = make_batch(model.config.vocab_size, settings, "cpu")
        if context is None:
            return inputs, step_targets
        if settings.attention_mask:  # packed rows: two documents each (the position ids restart)
            s = settings.seq_len
            inputs["position_ids"] = inputs["position_ids"] % max(s // 2, 1)
        return context.shard(inputs, step_targets)

    with tracker:
        for step in range(1, steps + 1):
            run_step(parts, (batch() for _ in range(accumulation)), step, targets)
    return tracked_peak(tracker)


def _category(name: str) -> str:
    key = name.lower()
    if "param" in key or "buffer" in key or "all gather" in key:
        return "parameters"
    if "grad" in key or "reduce scatter" in key:
        return "gradients"
    if "optstate" in key:
        return "optimizer_states"
    return "activations_logits_temporary"


def tracked_peak(tracker: Any) -> dict[str, Any]:
    """A tracker's peak: total bytes, the memory model's categories, and the tracker's own categories."""
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    parts: dict[str, int] = {}
    for key, value in snapshot.items():
        if key != "Total":
            name = _category(getattr(key, "value", str(key)))
            parts[name] = parts.get(name, 0) + int(value)
    return {"peak_bytes": int(snapshot["Total"]), "breakdown": parts,
            "raw": {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items()}}


# ---------------------------------------------------------------------------------------------------
# Pipeline stages


def step_batch(vocab: int, settings: Settings, step: int) -> tuple[Any, Any, Any]:
    """The step's B = b·M rows, the same in every process and in the reference: random tokens, the first row of
    each micro-batch left-padded (transformers then builds a real mask, as `trace.make_batch`), a target at
    every position but a row's last (labels are the tokens)."""
    import torch

    b, M, s = settings.micro_batch_size, settings.gradient_accumulation_steps, settings.seq_len
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, vocab, (b * M, s), generator=generator)
    attention_mask = None
    if settings.attention_mask:
        attention_mask = torch.ones(b * M, s, dtype=torch.long)
        attention_mask[::b, : max(1, s // 16)] = 0
    return input_ids, attention_mask, input_ids.clone()


def micro_batches(vocab: int, settings: Settings, step: int) -> tuple[list, int]:
    """The step's M micro-batches as the trainer's step takes them ((inputs, targets) each) and its target tokens."""
    import torch

    from fulltune.runtime.loss import Targets

    input_ids, attention_mask, labels = step_batch(vocab, settings, step)
    b, M, s = settings.micro_batch_size, settings.gradient_accumulation_steps, settings.seq_len
    position_ids = torch.arange(s).expand(b, s).contiguous()
    micro = []
    for j in range(M):
        rows = slice(j * b, (j + 1) * b)
        inputs = {"input_ids": input_ids[rows], "position_ids": position_ids}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[rows]
        micro.append((inputs, Targets.from_labels(labels[rows])))
    return micro, sum(len(t) for _, t in micro)


def _pipeline_model(config: dict[str, Any], settings: Settings) -> Any:
    model = _llama(config, settings)
    if settings.pure_bf16:
        import torch

        model.to(torch.bfloat16)  # as the trainer's levers do (fulltune/runtime/train.py apply_levers)
    return model


def pipeline_rank(config: dict[str, Any], settings: Settings, schedule: str, steps: int, timed_steps: int,
                  stages: int, data_parallel: str = "none") -> dict[str, Any]:
    """This rank's stage under `schedule`: `steps` tracked optimizer steps (their losses and the stage's peak),
    then `timed_steps` untracked ones (MemTracker intercepts every op in Python) for the step times. With more
    ranks than `stages`, each stage is sharded (`data_parallel` fsdp) or replicated (ddp) over its replicas, every
    replica given the same rows (the memory is what is compared; the step's targets are every replica's, so the
    loss is one process's)."""
    import datetime

    import torch.distributed as dist

    from fulltune.degrees import ParallelDims
    from fulltune.runtime.optim import optimizer_for
    from fulltune.runtime.pipeline_parallel import PipelineRun
    from fulltune.runtime.step import LocalAccelerator, OptimizerStep, StepParts, run_step
    from fulltune.runtime.step_memory import peak_tracker, tracked_peak_bytes

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    replicas = dist.get_world_size() // stages
    model = _pipeline_model(config, settings)
    vocab = model.config.vocab_size
    run = PipelineRun.create(model, settings, schedule=schedule, length=settings.seq_len,
                             dims=ParallelDims(stages * replicas, 1, stages, data_parallel))
    del model  # this process keeps only its stage's modules
    optimizer = optimizer_for(run.stage, settings)
    accelerator = LocalAccelerator("cpu", settings.mixed_precision, settings.gradient_accumulation_steps)
    # The trainer's step: the schedule in place of the micro-batch loop, then its OptimizerStep.
    parts = StepParts(accelerator, run.stage, None, optimizer, OptimizerStep(accelerator, run.stage, optimizer, None, 1.0),
                      settings.gradient_accumulation_steps, pipeline=run)
    tracker = peak_tracker()
    tracker.track_external(run.stage, optimizer)
    seconds = []

    def step_of(step: int) -> float:
        micro, step_targets = micro_batches(vocab, settings, step)
        dist.barrier()
        start = time.perf_counter()
        outcome = run_step(parts, micro, step, step_targets * replicas)
        seconds.append(time.perf_counter() - start)
        return float(outcome.loss_sum) / (step_targets * replicas)

    with tracker:
        losses = [step_of(step) for step in range(1, steps + 1)]
    for step in range(steps + 1, steps + timed_steps + 1):
        step_of(step)
    return {"peak_bytes": tracked_peak_bytes(tracker), "losses": losses, "seconds": seconds,
            "parameters": sum(p.numel() for p in run.stage.parameters())}


def pipeline_reference(config: dict[str, Any], settings: Settings, steps: int) -> tuple[list[float], list[float]]:
    """The same steps in one process (one thread): the trainer's step over M accumulated micro-batches; the
    per-step losses and wall times."""
    import torch

    from fulltune.runtime.optim import optimizer_for
    from fulltune.runtime.step import local_parts, run_step

    torch.set_num_threads(1)
    model = _pipeline_model(config, settings)
    optimizer = optimizer_for(model, settings)
    losses, seconds = [], []
    with local_parts(model, optimizer, settings, device="cpu", max_grad_norm=1.0) as parts:
        for step in range(1, steps + 1):
            micro, step_targets = micro_batches(model.config.vocab_size, settings, step)
            start = time.perf_counter()
            outcome = run_step(parts, micro, step, step_targets)
            losses.append(float(outcome.loss_sum) / step_targets)
            seconds.append(time.perf_counter() - start)
    return losses, seconds


def pipeline_against_estimate(config: dict[str, Any], settings: Settings, schedule: str, stages: int, steps: int = 3,
                              timed_steps: int = 3, timeout_s: float = 240, data_parallel: str = "none",
                              replicas: int = 1) -> dict[str, Any]:
    """`stages` × `replicas` pipeline ranks (`pipeline_rank`) against `estimate_pipeline`'s stages and against
    the same steps in one process (`pipeline_reference`): the losses, the step times and each rank's peak (rank
    r is stage r // replicas, `fulltune.degrees.ParallelDims.stage`)."""
    import statistics
    from dataclasses import replace

    from fulltune.planning.pipeline import estimate_pipeline

    started = time.perf_counter()
    ranks = measure_ranks("pipeline", config, settings, stages * replicas, timeout_s=timeout_s, schedule=schedule,
                          steps=steps, timed_steps=timed_steps, stages=stages, data_parallel=data_parallel)
    wall = time.perf_counter() - started
    per_stage = replace(settings, strategy=data_parallel, num_processes=replicas) if replicas > 1 else settings
    estimate = estimate_pipeline(_config(config), per_stage, stages, schedule)
    reference, reference_seconds = pipeline_reference(config, settings, steps)
    pipelined = ranks[-1]["losses"][:steps]
    measured_step = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(steps, steps + timed_steps))
    return {
        "schedule": schedule, "stages": stages, "config": config, "settings": settings.to_dict(),
        "torchrun_seconds": round(wall, 1), "losses": pipelined, "reference_losses": reference,
        "max_loss_difference": max(abs(a - b) for a, b in zip(pipelined, reference)),
        "bubble": estimate.bubble, "predicted_step_seconds": estimate.step_seconds,
        "measured_step_seconds": measured_step, "one_process_step_seconds": statistics.median(reference_seconds[1:]),
        "ranks": [
            {"stage": st.stage, "rank": rank, "layers": list(st.layers), "in_flight": st.in_flight,
             "parameters": r["parameters"], "estimate_peak_bytes": st.peak_bytes,
             "estimate_peak_phase": st.peak_phase, "measured_peak_bytes": r["peak_bytes"],
             "error": st.peak_bytes / r["peak_bytes"] - 1}
            for rank, (st, r) in enumerate((estimate.stages[i // replicas], r) for i, r in enumerate(ranks))
        ],
    }


def _config(config: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**config)


# ---------------------------------------------------------------------------------------------------
# The final export


def export_rank(config: dict[str, Any], settings: Settings, out: Path, shard_bytes: int,
                whole: bool = False) -> dict[str, Any]:
    """Shard the Llama `config` (fp32, seed 0) with FSDP2 over this torchrun's processes and export it to
    `out`/model in files of `shard_bytes` (or, `whole`, gather the whole state dict on rank 0 instead): what
    the export added to this process's RSS beside the plan's figures for rank 0 and for the process's export
    phase (under `settings`)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM

    from fulltune.memory.process import export_host_bytes, export_phase_bytes
    from fulltune.memory.shapes import model_shape
    from fulltune.runtime import sharding
    from measuring.measure import peak_during

    sharding.init_process_group("cpu")
    torch.manual_seed(0)
    model = sharding.shard_model(LlamaForCausalLM(_config(config)), device="cpu")
    if whole:
        def work() -> None:
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        def work() -> None:
            sharding.save_pretrained(model, out / "model", max_shard_bytes=shard_bytes)
    before, peak = peak_during(work)
    shape = model_shape(_config(config))
    return {"added_bytes": peak - before, "rss_before": before, "peak_rss": peak,
            "planned_rank0_bytes": export_host_bytes(shape, 4, True, shard_bytes),
            # what the training process's export phase (memory/process.py) adds beside weights and states
            "planned_phase_added": export_phase_bytes(shape, settings, shard_bytes),
            "model_bytes": 4 * shape.num_params, "shard_bytes": shard_bytes, "whole": whole}


def main(argv: list[str] | None = None) -> int:
    """One rank: `python -m measuring.rank_memory SPEC.json OUT.json` under torchrun."""
    from measuring.measure import send_to_driver

    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    config, settings = spec["config"], Settings(**spec["settings"])
    if spec["kind"] == "export":
        from fulltune.runtime import allocator

        allocator.return_large_blocks()  # as `python -m fulltune.runtime.train` does on CPU
        measured = export_rank(config, settings, Path(spec["out"]), spec["shard_bytes"], spec["whole"])
    elif spec["kind"] == "pipeline":
        measured = pipeline_rank(config, settings, spec["schedule"], spec["steps"], spec["timed_steps"],
                                 spec["stages"], spec["data_parallel"])
    else:  # fsdp, tensor_parallel, context_parallel: each case of `cases` in turn, the last one's tensors freed first
        import gc

        measure = {"fsdp": fsdp_rank, "tensor_parallel": tensor_parallel_rank,
                   "context_parallel": context_parallel_rank}[spec["kind"]]
        measured = []
        for case in spec["cases"]:
            gc.collect()
            measured.append(measure(case["config"], Settings(**case["settings"])))
    send_to_driver(measured, Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
