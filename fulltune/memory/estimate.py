"""Analytic peak memory of one training step, as fulltune's trainer runs it.

The trainer (fulltune/runtime/train.py) runs, per optimizer step and per process:

    for each of gradient_accumulation_steps micro-batches:
        # lm_head runs on the t positions that have a target (fulltune/runtime/loss.py): a forward
        # pre-hook gathers its input (b, s, h) → (t, h); t ≤ b·(s-1)
        logits = model(input_ids, position_ids, attention_mask).logits.float()   # (t, V)
        loss = cross_entropy(logits, targets, reduction="sum") / tokens  # logits freed on return
        accelerator.backward(loss)
    accelerator.clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad(set_to_none=True)

The model walks that step as a timeline of allocations and frees and reports its maximum. Where each
part is counted:

| what | where |
|---|---|
| activations of a decoder layer and of the whole model | `fulltune/memory/activations.py` |
| the output head's logits and the loss (whole or chunked) | `fulltune/memory/head.py` |
| bytes the levers decide (weight dtype, optimizer states, host RAM) | `fulltune/memory/lever_bytes.py` |
| sharded shares, DDP buckets, FSDP2's units (gathers, reduce-scatters, its head) | `fulltune/memory/fsdp.py` |
| the shared per-step numbers and the phase records | `fulltune/memory/timeline.py` |
| the one walk of the step, driven by each layout's description | `fulltune/memory/walk.py` |
| gradients into `.grad` (one process, DDP, a pipeline stage): the replicated layout | here (`replicated`) |
| the whole process: loading, first step, checkpoint, export, evaluation | `fulltune/memory/process.py` |

Every byte count comes from the tensors autograd saves in the transformers 5 implementations (checked
with `saved_tensors_hooks` and MemTracker on CPU). What holds across the parts:

- Weights stay fp32 (4 B/param) under mixed precision; autocast makes a 16-bit copy of every
  linear weight the first time the forward uses it and the backward keeps it until that layer's
  gradient is computed (+2 B per matmul parameter from the forward until the layer's backward).
- Gradients are fp32 like the weights. With `zero_grad(set_to_none=True)` and no accumulation
  they appear layer by layer during backward; with accumulation they exist for the whole step.
- A checkpointed layer keeps only its input and rebuilds its activations during its backward.
- Keeping a reference to the logits through backward would add 4·t·V bytes at the peak; the
  trainer drops it (measured with Accelerate on CPU: +17.8% for a 3k vocabulary otherwise).
- The gather's backward scatters the head input's gradient into a zero (b, s, h) fp32 tensor.
"""

from __future__ import annotations

from typing import Any

from fulltune.memory.activations import compute_bytes
from fulltune.memory.fsdp import activation_settings, fsdp_layout, fsdp_walk, persistent
from fulltune.memory.head import chunked_head_phases, head_gradient, head_phases
from fulltune.memory.process import CPU_LIBRARY_PAGES_SPREAD, CPU_LOAD_PROCESS_BYTES, LOAD, STEP, TRAINING_PHASES, phase_tensors
from fulltune.memory.shapes import ModelShape, model_shape
from fulltune.memory.tensor_parallel import step_terms_tp, tp_layout
from fulltune.memory.timeline import Timeline, step_terms
from fulltune.memory.types import MemoryEstimate, Settings
from fulltune.memory.walk import Layout, walk

# CUDA context + cuBLAS workspace on a recent GPU with lazy module loading (torch 2.x): ~0.5 GiB.
CUDA_CONTEXT_BYTES = 600 * 2**20
# The caching allocator reserves more than it hands out; 8% of the peak is typical for training
# steps with varying activation sizes (torch.cuda.memory_reserved vs max_memory_allocated).
CUDA_ALLOCATOR_SLACK = 0.08
# A CPU training process, measured (benchmarks/cpu_rss.py and benchmarks/process_memory.py: peak RSS of real
# runs, MLflow on, one OpenMP thread, 0.02M-124M parameters, with the trainer's allocator setting,
# runtime/allocator.py): 590-635 MiB beside the step's tensors (interpreter, torch, transformers, accelerate,
# MLflow, the accelerator, tokenizer and rows, kernels' workspaces), and what the heap keeps of freed
# tensors below the mmap threshold: a few % of the tensor peak. Computing in bf16 with the optimizer
# stepped in backward, the process holds about one more bf16 copy of the weights than its tensors (76M
# Llama: +94 MiB with pure bf16, +136 MiB under autocast; without the step in backward, bf16 runs show
# none: a 124M GPT-2 and a 7M Llama under autocast). With these constants the estimate is 3-9% above
# every measured peak (11 configurations; BENCHMARKS.md).
# The file-backed part of that (torch's and transformers' shared libraries) is not fixed: the same libraries
# map ~110 MiB more resident pages when their files sit in the page cache as freshly written (large folios:
# libtorch_cpu.so alone 93 MiB against 48 MiB, measured in /proc/self/smaps of `import torch` in a just-built
# virtual environment and in an older one). A new installation is the common case (CI, containers), so the
# constant holds it (128 MiB with a margin); an older one measures up to that much less (CPU_LIBRARY_PAGES_SPREAD,
# memory/process.py).
# The trainer imports neither MLflow nor matplotlib (the launcher forwards its metrics: runtime/run_tracking.py):
# 104-107 MiB less at the peak than with them (benchmarks/process_memory.py, 6.5M Llama fp32, 764 -> 657 MiB), so
# its constant is 96 MiB below the 656 MiB measured with MLflow. The evaluate stage's process still imports MLflow
# and Prefect, and keeps the measured 656 MiB (CPU_EVAL_PROCESS_BYTES).
CPU_PROCESS_BYTES = 560 * 2**20 + CPU_LIBRARY_PAGES_SPREAD
CPU_EVAL_PROCESS_BYTES = 656 * 2**20 + CPU_LIBRARY_PAGES_SPREAD
CPU_ALLOCATOR_SLACK = 0.03
CPU_16BIT_IN_BACKWARD_BYTES = 2  # per parameter: 16-bit compute with the optimizer stepped in backward




def estimate_memory(config: Any, settings: Settings) -> MemoryEstimate:
    """Peak memory of one steady-state optimizer step of `config` trained with `settings`.

    Pure arithmetic (no torch); per process. See the module docstring for what is counted.

    Raises:
        MemoryConfigError: the config lacks the dimensions of a decoder-only causal LM.
    """
    shape = model_shape(config)
    return _estimate(shape, settings)


def rank_peak_bytes(config: Any, settings: Settings, rank: int) -> int:
    """The tensors at process `rank`'s step peak (`MemoryEstimate.peak_bytes`, what the trainer measures per
    rank: `fulltune.runtime.step_memory`): its pipeline stage's under `pipeline_parallel` > 1 (a stage is
    `ParallelDims.stage`'s consecutive ranks), otherwise the one figure every process shares."""
    shape = model_shape(config)
    if settings.pipeline_parallel > 1:
        from fulltune.memory.pipeline import estimate_stages, per_stage

        stages = estimate_stages(shape, per_stage(settings), settings.pipeline_parallel, settings.pipeline_schedule)
        return stages[settings.dims.stage(rank)].peak_bytes
    return _estimate(shape, settings).peak_bytes


def _estimate(shape: ModelShape, settings: Settings, timeline: list | None = None) -> MemoryEstimate:
    """`estimate_memory` on a parsed shape; `timeline` (if given) receives every (phase, bytes, parts)."""
    if settings.pipeline_parallel > 1:  # the largest pipeline stage (memory/pipeline.py, which imports this module)
        from fulltune.memory.pipeline import stage_memory_estimate

        return stage_memory_estimate(shape, settings)
    if settings.tensor_parallel > 1:
        # A tensor-parallel rank: FSDP over the data-parallel processes of the rank's own shape, with the
        # sequence-parallel blocks' activations and the vocabulary-parallel head (memory/tensor_parallel.py).
        x = step_terms_tp(shape, settings, activation_settings(settings))
        tl = Timeline(x, persistent(x))
        walk(tl, tp_layout(tl))
        return _result(x.shape, tl.phases, timeline, x.settings, _notes(shape, settings))
    x = step_terms(shape, settings, activation_settings(settings))
    tl = Timeline(x, persistent(x))
    walk(tl, fsdp_layout(tl) if fsdp_walk(settings) else replicated(tl))
    return _result(shape, tl.phases, timeline, settings, _notes(shape, settings))


class ReplicatedGradients:
    """Gradients into `.grad` on a process holding every parameter it trains (one process, DDP, a pipeline
    stage): with `zero_grad(set_to_none=True)` and no accumulation they appear layer by layer; accumulating,
    they exist through the step and each new one is a temporary added into them; with the gradient hooks
    (step in backward, optimizer offload) a hook takes each one as it is made."""

    def __init__(self, tl: Timeline) -> None:
        x = tl.terms
        shape, wb = x.shape, x.levers.weight_bytes
        self.first = x.layer.mlp_first_grad * wb // 4  # the down/output projection's weight gradient
        head_grad = head_gradient(tl)  # 0 on a rank without the head (its vocabulary is 0)
        # After the head's backward: its weight gradient and the final norm's.
        norms = wb * sum(p[0] for p in shape.other_params if len(p) == 1)
        self.grads = x.grads_before if x.accumulating else head_grad + norms
        # Tied: the head's weight gradient waits in autograd's input buffer for the embedding's share
        # (when accumulating it is not yet added into .grad, so it is extra; with the gradient hooks it
        # is not a .grad yet, so the hook has not taken it).
        self.waiting = head_grad if shape.tied and (x.accumulating or x.hooks) else 0
        self.grads += self.waiting if not x.hooks else 0

    def partial(self, tl: Timeline, i: int, first: bool) -> dict:
        x = tl.terms
        if first:
            # Made before the MLP backward peak; when accumulating, a new tensor added into the existing .grad.
            made = int(self.first * x.grad_shard)
            return {"grads": self.grads + (0 if x.accumulating else made), "now": self.waiting + made,
                    "temp": self.first if x.new_grad_added else 0}
        mlp = 0 if x.accumulating else int(x.layer.mlp_grads * x.grad_shard * x.levers.weight_bytes // 4)
        return {"grads": self.grads + mlp, "now": self.waiting, "temp": 0}

    def finish(self, tl: Timeline, name: str, i: int, acts: int) -> None:
        x = tl.terms
        self.grads += 0 if x.accumulating else int(x.layer.grads * x.grad_shard * x.levers.weight_bytes // 4)

    def embeddings(self, tl: Timeline, acts: int) -> None:
        """A dense (V, h) gradient. Tied, autograd then sums it with the waiting head gradient out of place
        (three (V, h) tensors at once, .grad not yet among them unless accumulating); untied and accumulating,
        it is added into the existing .grad. At the end of backward every gradient exists."""
        x = tl.terms
        shape, settings = x.shape, x.settings
        rows = next(p[0] for p in shape.other_params if len(p) == 2)  # the embedding table's
        emb_grad = int(x.levers.weight_bytes * rows * shape.hidden * x.grad_shard)
        if shape.tied:
            emb_tmp = (3 if x.new_grad_added else 2) * emb_grad
        else:
            emb_tmp = emb_grad if x.new_grad_added else 0
        # With the hooks: the embedding's gradient (tied: the sum) is the one the hook takes; stepping
        # inside backward adds the optimizer's own temporaries there.
        hook_tmp = x.levers.states_temp if settings.optimizer_in_backward else 0
        tl.add("backward of the embeddings", x.grads_total, acts, 0,
               emb_tmp if not x.hooks else (emb_tmp if shape.tied else 0) + hook_tmp,
               now=0 if shape.tied else emb_grad)

    def step(self, tl: Timeline) -> None:
        """All gradients, states, the optimizer's own temporaries (on the host when offloaded; nothing left to
        do when stepped in backward)."""
        x = tl.terms
        settings = x.settings
        if not settings.optimizer_in_backward:
            step_temp = x.levers.host_temp if settings.offload_optimizer else x.levers.states_temp
            tl.add("optimizer step", x.grads_total, 0, 0,
                   step_temp if (settings.device == "cpu" or not settings.offload_optimizer) else 0)


def replicated(tl: Timeline, layers: tuple[int, int] | None = None, embedding: bool = True,
               head: bool = True) -> Layout:
    """The walk of a process that holds every parameter it trains: nothing gathered, gradients into `.grad`.
    A pipeline stage owns `layers` and the embedding or the head or neither."""
    x = tl.terms
    return Layout(layers=layers or (0, x.shape.num_layers), embedding=embedding,
                  head=_replicated_head if head else None, gradients=ReplicatedGradients(tl))


def _replicated_head(tl: Timeline, gradients: object) -> int:
    (chunked_head_phases if tl.terms.settings.chunked_loss else head_phases)(tl)
    return tl.terms.acts.below_head


def _result(shape: ModelShape, phases: list, timeline: list | None, settings: Settings,
            notes: list[str]) -> MemoryEstimate:
    """The estimate: the step at the largest of `phases` (and the timeline, if asked for), and the whole
    process's phases (`process.py`) around it."""
    if timeline is not None:
        timeline.extend(phases)
    phase, peak, parts = max(phases, key=lambda p: p[1])
    overhead = _runtime_overhead(settings, peak, STEP, shape)
    breakdown = {key: int(value) for key, value in parts.items() if key != "host"}
    breakdown["runtime_overhead"] = int(overhead)
    host = max(p[2]["host"] for p in phases)
    process_phases = {name: tensors + _runtime_overhead(settings, tensors, name, shape)
                      for name, tensors in phase_tensors(shape, settings, int(peak)).items()}
    training = {name: process_phases[name] for name in TRAINING_PHASES}
    # A tie between the first and a later step is the training step's.
    process_peak = max(training, key=lambda name: (training[name], name == STEP))
    return MemoryEstimate(
        peak_bytes=int(peak),
        device_bytes=int(training[process_peak]),
        breakdown=breakdown,
        peak_phase=phase,
        notes=tuple(notes),
        host_bytes=int(host),
        step_device_bytes=int(peak + overhead),
        phases={name: int(value) for name, value in process_phases.items()},
        process_peak_phase=process_peak,
    )


def _notes(shape: ModelShape, settings: Settings) -> list[str]:
    notes: list[str] = []
    if shape.approximate:
        notes.append(f"model_type {shape.model_type!r} is modelled as a Llama-like decoder; expect a few % error")
    if settings.mixed_precision == "fp16" and settings.device == "cpu":
        notes.append("Accelerate does not autocast fp16 on CPU: counted as fp32")
    if settings.gradient_checkpointing > shape.num_layers:
        notes.append(f"gradient_checkpointing={settings.gradient_checkpointing} capped at {shape.num_layers} layers")
    if settings.device == "cpu" and (settings.offload_optimizer or settings.offload_activations):
        notes.append("on a CPU device host RAM is the device memory: offloading moves bytes, it saves none")
    return notes


def _runtime_overhead(settings: Settings, peak: int, phase: str, shape: ModelShape) -> int:
    """What the device needs beyond `peak` tensor bytes in `phase`: the CUDA context and allocator slack,
    or on CPU the process itself (a CPU process loading its model holds less than a training one)."""
    if settings.device == "cuda":
        return int(CUDA_CONTEXT_BYTES + CUDA_ALLOCATOR_SLACK * peak)
    if phase == LOAD:
        return CPU_LOAD_PROCESS_BYTES
    sixteen_bit = compute_bytes(activation_settings(settings)) == 2
    converted = CPU_16BIT_IN_BACKWARD_BYTES * shape.num_params if sixteen_bit and settings.optimizer_in_backward else 0
    return int(CPU_PROCESS_BYTES + CPU_ALLOCATOR_SLACK * peak + converted)


def num_parameters(config: Any) -> int:
    """Parameter count of `config` as the memory model counts it."""
    return model_shape(config).num_params


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of rows of one `seq_len`-token document with a target at every position
    (fulltune/memory/flops.py; no recompute)."""
    from fulltune.memory import flops

    return flops.from_shape(model_shape(config)).per_token_of_rows(seq_len)
