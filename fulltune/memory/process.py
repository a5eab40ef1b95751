"""The whole training process, not one step: loading, the first step, a checkpoint, the final export.

A run fails on its peak wherever that is, and the steady step is only one candidate. Measured phase by
phase on CPU, where `budget.memory` is the process's resident memory (benchmarks/process_memory.py):

- **load**: `from_pretrained` maps the safetensors file and reads it page by page; the pages it touched
  stay resident until the mapping closes. Weights kept in the checkpoint's dtype are views of those pages
  (they are the parameters); weights cast to another dtype (pure bf16 from an fp32 checkpoint, fp32 from a
  bf16 one) are new tensors beside every page of the file. The process holds its libraries and set-up
  (`CPU_LOAD_PROCESS_BYTES`) but nothing of the training loop yet.
- **first optimizer step**: the optimizer allocates its states during it, so its tensors never exceed the
  steady step's (measured: within 1% of the second step's RSS).
- **checkpoint save** and **final export**: safetensors writes tensors by pointer and torch.save streams
  the optimizer states, so beside the weights and states only one tensor-sized buffer is new.
- **evaluation** runs in the evaluate stage's own process (fulltune/evaluation/evaluate.py): fp32 weights as it
  loads them (beside the exported file's pages when the run trained another dtype), one held-out batch's
  forward and the KV cache of greedy generation. It is reported, not planned for: its size does not depend
  on the settings the planner chooses.

The runtime overhead (`estimate._runtime_overhead`) is added to every phase; the load phase's is its own.

Host RAM is planned per machine (`node_host_bytes`): the offloaded tensors of every process on it and, under
FSDP, rank 0's gathered copy of the whole model at the export.
"""

from __future__ import annotations

from dataclasses import dataclass

from fulltune.memory.lever_bytes import lever_bytes
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings

LOAD, FIRST_STEP, STEP, CHECKPOINT, EXPORT, EVALUATION = (
    "load", "first optimizer step", "training step", "checkpoint save", "final export", "evaluation")
# The phases of the training process, in the order it runs them; the evaluation stage is its own process.
TRAINING_PHASES = (LOAD, FIRST_STEP, STEP, CHECKPOINT, EXPORT)
# A CPU training process before its first step, measured with its model not yet loaded: the interpreter,
# torch, transformers, accelerate and MLflow imported, the accelerator, the tokenizer and the rows set up,
# transformers' loading machinery (benchmarks/process_memory.py: 522-528 MiB on 6.5M and 76M Llamas; the
# constant keeps ~6% above the largest), plus the ~110 MiB more of the shared libraries' file pages a freshly
# installed environment keeps resident (see CPU_PROCESS_BYTES in memory/estimate.py).
CPU_LIBRARY_PAGES_SPREAD = 128 * 2**20  # ~110 MiB measured; the rest is margin (a fresh clone's export peaked 2 MiB over 110)
CPU_LOAD_PROCESS_BYTES = 560 * 2**20 + CPU_LIBRARY_PAGES_SPREAD
# What the evaluate stage generates and reads per batch (spec.EvaluateSpec defaults).
EVAL_BATCH_SIZE = 8
EVAL_NEW_TOKENS = 32


@dataclass(frozen=True)
class Evaluation:
    """The evaluate stage's batch: held-out rows per forward, their length, tokens generated."""

    batch_size: int = EVAL_BATCH_SIZE
    seq_len: int = 0  # 0: the training rows' length
    new_tokens: int = EVAL_NEW_TOKENS


def phase_tensors(shape: ModelShape, settings: Settings, step_tensors: int) -> dict[str, int]:
    """Tensor bytes (file pages included on CPU) at the peak of each phase of the training process, and of
    the evaluation stage; `step_tensors` is the steady step's peak (the step walk's `peak_bytes`)."""
    levers = lever_bytes(shape, settings)
    share = 1.0 / settings.num_processes if settings.strategy in ("fsdp", "deepspeed_zero3") else 1.0
    P = shape.num_params
    weights = int(levers.weight_bytes * P * share)
    states = int(levers.states * (1.0 / settings.num_processes if settings.strategy != "none"
                                  and settings.strategy != "ddp" else 1.0))
    largest = max((_numel(s) for s in shape.param_shapes), default=0) * levers.weight_bytes
    if settings.device == "cpu":
        # The file's pages are resident memory; weights in another dtype are copies beside them.
        cast = levers.weight_bytes != shape.stored_bytes
        load = int(shape.stored_bytes * P * share) + weights if cast else weights
    else:
        load = weights  # read on the host, then moved: the device holds the weights
    out = {LOAD: load, FIRST_STEP: step_tensors, STEP: step_tensors,
           CHECKPOINT: weights + states + largest, EXPORT: weights + states + largest}
    if levers.sharded_offload and settings.device != "cpu":
        # FSDP's CPU offload: the shards are read into host RAM and the optimizer's states live there;
        # saving passes one parameter at a time through the device (its shard up, the full tensor gathered).
        out[LOAD] = 0
        out[CHECKPOINT] = out[EXPORT] = largest + int(largest / settings.num_processes)
    if settings.offload_optimizer and settings.device == "cpu":
        # The host masters and states are in the same memory as everything else.
        out[CHECKPOINT] = out[EXPORT] = max(out[CHECKPOINT], step_tensors)
    out[EVALUATION] = evaluation_tensors(shape, settings, Evaluation())
    return out


def node_host_bytes(shape: ModelShape, settings: Settings, rank_host: int, ranks_per_node: int) -> dict[str, int]:
    """Host RAM of one machine running `ranks_per_node` processes of `settings`, each holding `rank_host`
    bytes of offloaded tensors at its peak (the estimate's `host_bytes`): what `budget.host_memory` (per
    machine) must hold. Parts:

    - `shards`: every rank's host tensors (under FSDP's CPU offload its parameter, gradient and optimizer-state
      shards, and the host step's temporaries);
    - `pinned`: of those, the page-locked parameter and gradient shards (FSDP2 pins them for asynchronous
      copies; pinned pages cannot be swapped or shared);
    - `export`: under FSDP, the final export gathers the whole model as CPU tensors on rank 0
      (`sharding.full_state_dict`, weight dtype) while every rank's shards are still held;
    - `total`: the machine's peak, the larger of the step and the export.

    One process without FSDP: its own host bytes (`export` 0: it writes its weights as they are).
    """
    levers = lever_bytes(shape, settings)
    shards = rank_host * ranks_per_node
    grads = int(levers.weight_bytes * shape.num_params / settings.num_processes) if levers.sharded_offload else 0
    pinned = (levers.pinned + grads) * ranks_per_node
    export = levers.weight_bytes * shape.num_params if settings.strategy == "fsdp" else 0
    # At the export the step's temporaries are gone; the shards (masters, gradients, states) are not.
    held = (levers.host_masters + grads + levers.host_states) * ranks_per_node if levers.sharded_offload else 0
    return {"shards": shards, "pinned": pinned, "export": export, "total": max(shards, held + export)}


def evaluation_tensors(shape: ModelShape, settings: Settings, evaluation: Evaluation) -> int:
    """The evaluate stage's peak tensors: fp32 weights (beside the exported file's pages when it holds another
    dtype, on CPU), one batch's logits at every target position and one layer's forward, or the KV cache."""
    P = shape.num_params
    exported = 2 if settings.pure_bf16 else 4
    weights = 4 * P + (exported * P if exported != 4 and settings.device == "cpu" else 0)
    b = evaluation.batch_size
    s = (evaluation.seq_len or settings.seq_len) + evaluation.new_tokens
    kv_cache = 2 * shape.num_layers * b * s * shape.kv_heads * shape.head_dim * 4
    logits = 4 * b * s * shape.vocab  # fp32 logits of a batch, the loss's upcast beside them
    layer = 4 * b * s * (2 * shape.hidden + 2 * shape.intermediate)
    return weights + max(kv_cache + 4 * b * shape.vocab, 2 * logits) + layer


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
