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
  the optimizer states, so beside the weights and states only one tensor-sized buffer is new; under FSDP on
  CPU the export's streamed file of gathered tensors is rank 0's own memory too (`export_phase_bytes`). A
  background write (`train.checkpoint_async`) copies the weights and states first and the steps go on beside
  the copy: on a CPU device the phase is the step plus the copy (`checkpoint_staging_bytes`), on a GPU the copy
  is host RAM.
- **evaluation** runs in the evaluate stage's own process after training, or sharded over the training's
  processes for a run trained sharded: it is planned (per process) from the pipeline's `evaluate.*` settings in
  `memory/evaluation.py`, and the planner adds it to the plan's phases.

The runtime overhead (`overhead.training_overhead`) is added to every phase; the load phase's is its own.

Host RAM is planned per machine (`node_host_bytes`): the offloaded tensors of every process on it, the copies a
background checkpoint write stages (`checkpoint_staging_bytes`) and, under FSDP, the export's gathered tensors
(one file's on rank 0: the export streams, `export_host_bytes`). The
training data costs a machine what `data_host_bytes` counts: train.arrow mapped once (its pages in the page
cache, shared by every rank that reads them) and each rank's row index and micro-batch buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fulltune.memory.lever_bytes import lever_bytes
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings

LOAD, FIRST_STEP, STEP, CHECKPOINT, EXPORT, EVALUATION = (
    "load", "first optimizer step", "training step", "checkpoint save", "final export", "evaluation")
# The phases of the training process, in the order it runs them; the evaluation stage is its own process.
TRAINING_PHASES = (LOAD, FIRST_STEP, STEP, CHECKPOINT, EXPORT)
# A CPU training process before its first step, measured with its model not yet loaded: the interpreter,
# torch, transformers and accelerate imported (MLflow then too), the accelerator, the tokenizer and the rows set up,
# transformers' loading machinery (benchmarks/process_memory.py: 522-528 MiB on 6.5M and 76M Llamas; the
# constant keeps ~6% above the largest), plus the ~110 MiB more of the shared libraries' file pages a freshly
# installed environment keeps resident (see CPU_PROCESS_BYTES in memory/overhead.py).
# The most gathered weights rank 0 holds at once while exporting (fulltune/runtime/sharding.py `save_pretrained`):
# one safetensors file's worth (a tensor larger than this is a file of its own). transformers' own
# max_shard_size convention names the files.
EXPORT_SHARD_BYTES = 2 * 2**30
CPU_LIBRARY_PAGES_SPREAD = 128 * 2**20  # ~110 MiB measured; the rest is margin (a fresh clone's export peaked 2 MiB over 110)
# Without MLflow in the trainer the load phase measured 48 MiB less (525 -> 477 MiB, 6.5M Llama fp32).
CPU_LOAD_PROCESS_BYTES = 512 * 2**20 + CPU_LIBRARY_PAGES_SPREAD

# Per row, in every rank (fulltune/data/batching.py): its length, targets and attention pairs (int64, int64,
# float64) beside the mapped offsets and counts they are read from, and the epoch's step schedule, a list of
# Python ints (8-byte slot + 32-byte int). Measured 52-65 bytes a row for the rows and 42-51 for the schedule
# (3M and 12M tokens, benchmarks/data_memory.py's rows).
DATA_ROW_BYTES = 120
# Per token of a micro-batch: `TokenizedRows.rows` turns the mapped rows into Python lists (3 columns, an
# 8-byte slot and at worst a 32-byte int each), collate makes int64 tensors of them and the attention mask.
DATA_TOKEN_BYTES = 3 * (8 + 32) + 4 * 8


def data_host_bytes(mapped_bytes: int, rows: int, ranks_per_node: int, micro_batch_size: int,
                    seq_len: int) -> dict[str, int]:
    """Host RAM one machine spends on the training data, in bytes:

    - `mapped`: train.arrow (`mapped_bytes`), memory-mapped by every rank: at most one copy of its pages in
      the machine's page cache however many ranks read it (clean file pages: the kernel may drop and reread
      them, and a rank only pages in the rows it trains on);
    - `row_index`: every rank's per-row numbers (`DATA_ROW_BYTES` per row of the data);
    - `batches`: every rank's micro-batch as lists and tensors (`DATA_TOKEN_BYTES` per position);
    - `total`: their sum.
    """
    index = rows * DATA_ROW_BYTES * ranks_per_node
    batches = micro_batch_size * seq_len * DATA_TOKEN_BYTES * ranks_per_node
    return {"mapped": int(mapped_bytes), "row_index": int(index), "batches": int(batches),
            "total": int(mapped_bytes + index + batches), "ranks_per_node": int(ranks_per_node)}


def tokenized_data_host(data: Any, ranks_per_node: int, settings: Settings) -> dict[str, int] | None:
    """`data_host_bytes` of a tokenize stage's output (fulltune/data/store.py `TokenizedData`: its train.arrow
    and rows) trained with `settings`; None without one (not tokenized yet, or written before train.arrow)."""
    mapped = Path(data.train_rows_file) if data is not None else None
    if mapped is None or not mapped.is_file():
        return None
    return data_host_bytes(mapped.stat().st_size, data.num_train_rows, ranks_per_node, settings.micro_batch_size,
                           settings.seq_len)


def phase_tensors(shape: ModelShape, settings: Settings, step_tensors: int) -> dict[str, int]:
    """Tensor bytes (file pages included on CPU) at the peak of each phase of the training process;
    `step_tensors` is the steady step's peak (the step walk's `peak_bytes`)."""
    levers = lever_bytes(shape, settings)
    share = 1.0 / settings.num_processes if settings.dims.fsdp_enabled else 1.0
    P = shape.num_params
    weights = int(levers.weight_bytes * P * share)
    states = int(levers.states * share)
    largest = shape.largest_param_numel * levers.weight_bytes
    if settings.device == "cpu":
        # The file's pages are resident memory; weights in another dtype are copies beside them.
        cast = levers.weight_bytes != shape.stored_bytes
        load = int(shape.stored_bytes * P * share) + weights if cast else weights
    else:
        load = weights  # read on the host, then moved: the device holds the weights
    out = {LOAD: load, FIRST_STEP: step_tensors, STEP: step_tensors,
           CHECKPOINT: weights + states + largest, EXPORT: weights + states + export_phase_bytes(shape, settings)}
    if levers.sharded_offload and settings.device != "cpu":
        # FSDP's CPU offload: the shards are read into host RAM and the optimizer's states live there;
        # saving passes one parameter at a time through the device (its shard up, the full tensor gathered).
        out[LOAD] = 0
        out[CHECKPOINT] = out[EXPORT] = largest + int(largest / settings.num_processes)
    if settings.offload_optimizer and settings.device == "cpu":
        # The host masters and states are in the same memory as everything else.
        out[CHECKPOINT] = out[EXPORT] = max(out[CHECKPOINT], step_tensors)
    if settings.checkpoint_async and settings.device == "cpu":
        # The staged copy is in the same memory, and the steps after the boundary run beside it until it is
        # written (on a GPU it is host RAM: `checkpoint_staging_bytes` in the host figure).
        out[CHECKPOINT] = max(out[CHECKPOINT], step_tensors) + checkpoint_staging_bytes(shape, settings)
    return out


def checkpoint_staging_bytes(shape: ModelShape, settings: Settings) -> int:
    """Host RAM one process holds for a background checkpoint write (`train.checkpoint_async`,
    fulltune/runtime/async_checkpoints.py): a copy of the weights and optimizer states the checkpoint holds, from
    the step boundary until the write is published, while the next steps run. Under FSDP each process copies its
    own shards (each writes them); otherwise the main process copies the whole model's states, which it alone
    writes, and that is the figure (the other DDP processes write only their RNG states). 0 without the lever.

    The states are the optimizer's as `fulltune.memory.lever_bytes` counts them: on the device, or in host RAM under
    an offload (the masters and states the offloading optimizer's state dict holds beside the device weights)."""
    if not settings.checkpoint_async:
        return 0
    levers = lever_bytes(shape, settings)
    if levers.sharded_offload:  # FSDP's CPU offload: the host shards are the parameters
        return levers.host_masters + levers.host_states
    share = 1.0 / settings.num_processes if settings.dims.fsdp_enabled else 1.0
    device = levers.weight_bytes * shape.num_params + levers.states
    return int(device * share) + levers.host_masters + levers.host_states


def export_phase_bytes(shape: ModelShape, settings: Settings, file_bytes: int | None = None) -> int:
    """What the final export adds to a process's tensors beside its weights and states: one tensor-sized buffer,
    or under FSDP on CPU, where the device is host memory, rank 0's streamed file of gathered tensors (at most
    `file_bytes`, default `sharding.EXPORT_SHARD_BYTES`) and the current all-gather's buffers (`export_host_bytes`;
    on a GPU the file is in host RAM, `node_host_bytes`, and the device holds the one tensor being gathered)."""
    weight_bytes = lever_bytes(shape, settings).weight_bytes
    if settings.dims.fsdp_enabled and settings.device == "cpu":
        return export_host_bytes(shape, weight_bytes, gathers_on_host=True, file_bytes=file_bytes)
    return shape.largest_param_numel * weight_bytes


def node_host_bytes(shape: ModelShape, settings: Settings, rank_host: int, ranks_per_node: int) -> dict[str, int]:
    """Host RAM of one machine running `ranks_per_node` processes of `settings`, each holding `rank_host`
    bytes of offloaded tensors at its peak (the estimate's `host_bytes`): what `budget.host_memory` (per
    machine) must hold. Parts:

    - `shards`: every rank's host tensors (under FSDP's CPU offload its parameter, gradient and optimizer-state
      shards, and the host step's temporaries);
    - `pinned`: of those, the page-locked parameter and gradient shards (FSDP2 pins them for asynchronous
      copies; pinned pages cannot be swapped or shared);
    - `export`: under FSDP, the final export's gathered tensors while every rank's shards are still held:
      rank 0 holds one safetensors file's (`sharding.save_pretrained` streams file by file, at most
      `EXPORT_SHARD_BYTES` or the largest tensor: `export_host_bytes`), and where the all-gathers run in host
      RAM (FSDP's CPU offload) every rank's gather buffers;
    - `checkpoint`: the copies staged for a background checkpoint write (`checkpoint_staging_bytes`): every
      rank's shards under FSDP, the main process's whole copy otherwise;
    - `total`: the machine's peak, the larger of the step (with a checkpoint write in flight) and the export
      (which waits for the write).

    One process without FSDP: its own host bytes (`export` 0: it writes its weights as they are).
    """
    levers = lever_bytes(shape, settings)
    staged = checkpoint_staging_bytes(shape, settings)
    checkpoint = staged * (ranks_per_node if settings.dims.fsdp_enabled else 1)
    shards = (rank_host - staged) * ranks_per_node
    grads = int(levers.weight_bytes * shape.num_params / settings.num_processes) if levers.sharded_offload else 0
    pinned = (levers.pinned + grads) * ranks_per_node
    export = 0
    if settings.dims.fsdp_enabled:
        # The gathers run where the shards are: in host RAM under FSDP's CPU offload, else on the devices.
        on_host = levers.sharded_offload
        export = (export_host_bytes(shape, levers.weight_bytes, on_host)
                  + (ranks_per_node - 1) * (_gather_bytes(shape, levers.weight_bytes) if on_host else 0))
    # At the export the step's temporaries are gone; the shards (masters, gradients, states) are not.
    held = (levers.host_masters + grads + levers.host_states) * ranks_per_node if levers.sharded_offload else 0
    return {"shards": shards, "pinned": pinned, "export": export, "checkpoint": checkpoint,
            "total": max(shards + checkpoint, held + export)}


def export_host_bytes(shape: ModelShape, weight_bytes: int, gathers_on_host: bool,
                      file_bytes: int | None = None) -> int:
    """Rank 0's host RAM at the streamed FSDP export: one file's gathered tensors (at most `file_bytes`,
    default `EXPORT_SHARD_BYTES`, or the largest tensor when it is larger, never more than the model)
    and, when the all-gathers run in host RAM (`gathers_on_host`: CPU shards), the current gather's buffers."""
    largest = shape.largest_param_numel * weight_bytes
    one_file = max(min(file_bytes or EXPORT_SHARD_BYTES, weight_bytes * shape.num_params), largest)
    return one_file + (_gather_bytes(shape, weight_bytes) if gathers_on_host else 0)


def _gather_bytes(shape: ModelShape, weight_bytes: int) -> int:
    """A CPU all-gather's transient for the largest tensor: its output and the copy it is assembled from
    (benchmarks/export_memory.py: gathering a 16 MB tensor over gloo peaks 2.0× its size above the RSS before)."""
    return 2 * shape.largest_param_numel * weight_bytes
