"""Run the trainer's step on a real model and read its memory: traced (no memory spent) or measured.

Both run the trainer's own step, `fulltune.runtime.step.run_step` (see `estimate.py`): the optimizer from
`fulltune.runtime.optim.optimizer_for`, autocast for mixed precision with the logits upcast to fp32, the summed
cross-entropy of the target positions normalised by the step's targets (`fulltune.runtime.loss`), clipping, the
optimizer step and `zero_grad(set_to_none=True)`, with the levers' hooks. Accelerate's `Accelerator` is
replaced by `fulltune.runtime.step.LocalAccelerator`: its process-wide state cannot change mixed precision between
two measurements in one process.

- `simulate_memory` builds the model under `FakeTensorMode` and records every storage with
  `torch.distributed._tools.mem_tracker.MemTracker`: a 1B-parameter model traces in ~20 s on CPU
  with no memory spent. CPU only (CPU builds of torch cannot make fake CUDA tensors); CPU SDPA
  keeps the same tensors for backward as the CUDA flash kernel (q, k, v, output, logsumexp).
- `measure_memory` runs real steps: CUDA reports `torch.cuda.max_memory_allocated`, CPU uses the
  same MemTracker on real tensors.
"""

from __future__ import annotations

import contextlib
import copy
import time
import gc
import json
from pathlib import Path
from typing import Any, Iterator

from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.types import BREAKDOWN_KEYS, MemoryEstimate, Settings


def make_batch(vocab: int, settings: Settings, device: str) -> tuple[dict[str, Any], Any]:
    """Inputs and targets of one micro-batch: every position but a row's last has a target (the
    worst case the estimate assumes) unless `settings.target_fraction` leaves the first ones out.
    Packed rows (`settings.document_length`) hold documents of that length (the last one the rest of the row),
    passed to the model as `documents` (fulltune/attention.py), as the trainer's `collate` does."""
    import torch

    from fulltune.attention import Documents
    from fulltune.runtime.loss import Targets

    b, s = settings.micro_batch_size, settings.seq_len
    input_ids = torch.randint(0, vocab, (b, s), device=device)
    position_ids = torch.arange(s, device=device).expand(b, s).contiguous()
    documents = None
    if settings.document_length and not settings.attention_mask:
        row = [i % settings.document_length for i in range(s)]
        position_ids = torch.tensor([row] * b, device=device)
        documents = Documents.from_positions([row] * b)
    attention_mask = None
    if settings.attention_mask:
        # One padded row makes transformers build and pass a real (b, 1, s, s) mask.
        attention_mask = torch.ones(b, s, dtype=torch.long, device=device)
        attention_mask[0, : max(1, s // 16)] = 0
    # Built from shapes, not from labels: nonzero() has no static shape under FakeTensorMode.
    first = (s - 1) - settings.targets_per_row
    index = torch.arange(b * s, device=device).view(b, s)[:, first : s - 1].reshape(-1)
    targets = Targets(index=index, tokens=input_ids.view(-1).index_select(0, index + 1))
    inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
    if documents is not None:
        inputs["documents"] = documents
    return inputs, targets


def _micro_batches(settings: Settings, steps: int, short: bool) -> list[int]:
    """Micro-batches to run in each of `steps` optimizer steps.

    `short` (the trace) runs what decides the peak and skips repeats: one micro-batch in the steps
    before the last (they only create the optimizer states), and at most two in the last — the
    second and every later micro-batch of a step find the accumulated gradients allocated, so they
    are alike. A 4-step accumulation traces 3 passes instead of 8 with the same peak (checked to the
    byte against the full schedule in tests/test_plan_margin.py).
    """
    ga = settings.gradient_accumulation_steps
    if not short:
        return [ga] * steps
    return [1] * (steps - 1) + [min(ga, 2)]


def train_steps(model: Any, optimizer: Any, settings: Settings, steps: int, device: str, tracker: Any = None,
                short: bool = False) -> None:
    """`steps` optimizer steps of the one training step (fulltune/runtime/step.py) on micro-batches of `settings`' shape.

    Under FakeTensorMode (`tracker` given on fake tensors) nothing can be read back: the step's finite checks
    pass without a sync. MemTracker refuses a second forward of the root module unless its module stats are
    reset before each micro-batch; the global peak survives the reset.
    """
    from torch._subclasses.fake_tensor import is_fake

    from fulltune.runtime.step import local_parts, run_step

    fake = is_fake(next(model.parameters()))
    reset = tracker.reset_mod_stats if tracker is not None else None
    ga = settings.gradient_accumulation_steps
    with local_parts(model, optimizer, settings, device=device, can_sync=not fake, before_micro_batch=reset) as parts:
        for step, count in enumerate(_micro_batches(settings, steps, short), start=1):
            # Made one at a time, as the trainer makes them: a micro-batch is freed before the next is built.
            batches = (make_batch(model.config.vocab_size, settings, device) for _ in range(count))
            targets = settings.micro_batch_size * settings.targets_per_row * ga
            # The short schedule's micro-batches are the step's last ones.
            run_step(parts, batches, step, max(targets, 1), first_micro_batch=ga - count)


def timed_train_steps(model: Any, optimizer: Any, settings: Settings, steps: int, device: str,
                      warmup: int = 1) -> float:
    """Seconds of `steps` optimizer steps (`train_steps`) after `warmup` untimed ones (the first allocates the
    optimizer's states, and a compiled model compiles there), the device synchronised around them."""
    import torch

    train_steps(model, optimizer, settings, warmup, device)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    train_steps(model, optimizer, settings, steps, device)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _check_single_process(settings: Settings) -> None:
    if not settings.dims.alone or settings.num_processes != 1:
        raise MemoryConfigError(
            "simulate_memory/measure_memory run one process; use strategy='none' and num_processes=1 "
            "(the analytic estimate covers ddp and fsdp)"
        )


def build_model(config: Any, settings: Settings) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from fulltune.attention import kernel
    from fulltune.runtime.checkpointing import apply_model_levers

    # bf16 weights are made bf16 from the start: `model.to` cannot swap FakeTensor parameters, and the
    # trainer's cast of a fp32 model ends in the same tensors.
    dtype = {"dtype": torch.bfloat16} if settings.pure_bf16 else {}
    # from_config writes the dtype into the config it is given: a copy keeps the caller's intact.
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                             attn_implementation=kernel(settings.attn_implementation), **dtype)
    model.train()
    apply_model_levers(model, settings)  # as the trainer does (fulltune/runtime/train.py apply_levers)
    return model


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _tracker_result(tracker: Any, source: str) -> MemoryEstimate:
    peak = 0
    snap: dict[Any, int] = {}
    for dev, value in tracker._peak_mem.items():  # MemTracker keeps no public per-device peak getter
        if value > peak:
            peak, snap = value, tracker._peak_mem_snap[dev]
    named = {str(k).split(".")[-1].lower(): int(v) for k, v in snap.items()}
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    breakdown["parameters"] = named.get("param", 0) + named.get("buffer", 0)
    breakdown["gradients"] = named.get("grad", 0)
    breakdown["optimizer_states"] = named.get("opt", 0)
    breakdown["activations"] = named.get("act", 0) + named.get("oth", 0)
    breakdown["temporary"] = named.get("temp", 0)
    return MemoryEstimate(
        peak_bytes=int(peak),
        device_bytes=int(peak),
        breakdown=breakdown,
        peak_phase="traced step",
        notes=(f"{source}: MemTracker categories (logits are counted as activations/temporary)",),
        source=source,
    )


@contextlib.contextmanager
def _rows_known_unpacked(settings: Settings) -> Iterator[None]:
    """Under FakeTensorMode, let transformers see what it sees on real tensors: rows without packing.

    Given `position_ids`, transformers looks for packed rows (a position that does not follow its
    predecessor) by reading the values — which a FakeTensor does not have, so `is_tracing` makes it
    assume packing. It then builds a (b, 1, s, s) mask for every layer, and with a mask SDPA gets
    repeated key/value heads instead of `enable_gqa`. On real tensors the trainer's unpacked rows
    (position_ids 0..s-1, no attention mask) have no boundary, so no mask and no repeat.

    Measured before this (CPU, torch 2.13, transformers 5.24, bf16, micro-batch 2, seq 256): the trace of
    a 4-layer GQA Llama read +7.0% (no checkpointing) / +6.7% (1 of 4 layers checkpointed) over the real
    step, a 4-layer GPT-2 +3.7% / +3.8%; with a mask the three agree to the byte. For the
    TinyLlama-1.1B shape at seq 2048, micro 2 × accumulation 4, 1 of 22 layers checkpointed, bf16,
    Adafactor the trace read 21.2 GiB against the estimate's 20.2 GiB (issue 13): 21 layers × (16 MiB
    of mask + 28 MiB of repeated k/v) plus the checkpointed layer's kept mask. With this patch the
    trace reads 20.2 GiB, the estimate's figure. Under `sdpa` the models load with fulltune's document
    attention, whose mask function builds no mask for these rows anyway (fulltune/attention.py); eager
    attention still needs the patch.
    """
    if settings.attention_mask:
        yield
        return
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # a transformers without packed-row detection has nothing to correct
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _static_nonzero() -> Iterator[None]:
    """Under FakeTensorMode, `Tensor.nonzero` returns its largest possible result (one index per element).

    A FakeTensor has no values, so an op whose output size depends on them cannot be traced; the chunked
    head's backward (fulltune/runtime/loss.py) finds each tile's target columns with `nonzero` on a (rows,) mask.
    The worst case (every row) is rows × 8 bytes: the same memory to within a few KiB.
    """
    import torch

    original = torch.Tensor.nonzero

    def static(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return original(self, *args, **kwargs)
        return torch.nonzero_static(self, size=self.numel())

    torch.Tensor.nonzero = static
    try:
        yield
    finally:
        torch.Tensor.nonzero = original


def simulate_memory(model_source: Any, settings: Settings, steps: int = 2, short: bool = True) -> MemoryEstimate:
    """Trace `steps` optimizer steps of the real model under FakeTensorMode and MemTracker.

    `model_source` is a transformers config. Nothing is allocated: the result is MemTracker's
    peak of tracked storages over the steps (the second step is the steady state: optimizer
    states exist from the first). CPU kernels are traced even when `settings.device` is cuda.
    `short` skips micro-batches that repeat an earlier one's memory (see `_micro_batches`).

    Raises:
        MemoryConfigError: a multi-process strategy (trace one process with strategy='none').
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from fulltune.runtime.step_memory import state_holders

    from fulltune.runtime import optim

    _check_single_process(settings)
    traced = settings if settings.device == "cpu" else _on_cpu(settings)
    with quiet(), FakeTensorMode(allow_non_fake_inputs=False):
        model = build_model(model_source, traced)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker, _rows_known_unpacked(traced), _static_nonzero():
            # Built under the tracker: the offloaded fp32 masters it makes are counted.
            optimizer = optim.optimizer_for(model, traced, fake=True)
            tracker.track_external(*state_holders(optimizer))
            train_steps(model, optimizer, traced, steps, "cpu", tracker, short)
        result = _tracker_result(tracker, "traced (FakeTensorMode)")
    return result


def _on_cpu(settings: Settings) -> Settings:
    from dataclasses import replace

    mp = settings.mixed_precision if settings.mixed_precision != "fp16" else "bf16"
    return replace(settings, device="cpu", mixed_precision=mp)


def measure_memory(config: Any, settings: Settings, steps: int = 2) -> int:
    """Run `steps` real optimizer steps and return the allocated peak in bytes.

    CUDA: `torch.cuda.max_memory_allocated` after a reset (the model and optimizer included).
    CPU: MemTracker's peak over tracked storages on real tensors.

    Raises:
        MemoryConfigError: a multi-process strategy, or `device='cuda'` without a GPU.
    """
    import torch

    _check_single_process(settings)
    if settings.device == "cuda":
        if not torch.cuda.is_available():
            raise MemoryConfigError("budget.device: measuring on cuda needs a GPU, and none is visible here")
        return measure_cuda(config, settings, steps)["allocated"]
    from torch.distributed._tools.mem_tracker import MemTracker

    from fulltune.runtime.step_memory import state_holders

    from fulltune.runtime import optim

    torch.manual_seed(0)
    with quiet():
        model = build_model(config, settings)
        optimizer = optim.optimizer_for(model, settings)
        tracker = MemTracker()
        tracker.track_external(model, *state_holders(optimizer))
        with tracker:
            train_steps(model, optimizer, settings, steps, "cpu", tracker)
        peak = max(tracker._peak_mem.values())
    del model, optimizer, tracker
    gc.collect()
    return int(peak)


def measure_cuda(config: Any, settings: Settings, steps: int = 2) -> dict[str, int]:
    """`steps` real optimizer steps on the GPU: {"allocated": the allocated peak above what was allocated before
    (`torch.cuda.max_memory_allocated`), "reserved": the allocator's reserved peak (`max_memory_reserved`)}."""
    import torch

    from fulltune.runtime import optim

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with quiet():
        model = build_model(config, settings).to("cuda")
        optimizer = optim.optimizer_for(model, settings)
        train_steps(model, optimizer, settings, steps, "cuda")
    torch.cuda.synchronize()
    peaks = {"allocated": int(torch.cuda.max_memory_allocated() - start),
             "reserved": int(torch.cuda.max_memory_reserved())}
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return peaks


# ---------------------------------------------------------------------------------------------------
# Traced peaks kept across processes

# The code a trace runs: the trainer's step and everything it builds (optimizers, loss, levers), the model loader.
TRACED_CODE = ("planning/trace.py", "runtime", "memory/types.py", "models.py", "attention.py", "levers.py",
               "lever_record.py", "optimizers.py")

def stored_peak(config_json: str, settings: Settings) -> tuple[Path, int | None]:
    """(where the traced peak of this step is kept, the peak when a trace of it was kept before).

    A trace is a pure function of the model's config, the settings, the code it runs (`TRACED_CODE`) and the
    installed torch and transformers: the same step traced again reads the same peak, so a later `plan` or
    `run` on this machine (another workdir included) reads it instead of tracing for seconds."""
    from dataclasses import asdict
    from importlib.metadata import version

    from fulltune.storage import cache_dir, code_version, hash_json

    # Where the config was read from is not the model: the same config in another workdir traces the same.
    config = {k: v for k, v in json.loads(config_json).items() if k not in ("_name_or_path", "_commit_hash")}
    key = hash_json({"config": config, "settings": asdict(settings), "code": code_version(*TRACED_CODE),
                     "torch": version("torch"), "transformers": version("transformers")})
    path = cache_dir() / "traces" / f"{key}.json"
    try:
        peak = json.loads(path.read_text())["peak_bytes"]
        return path, int(peak) if isinstance(peak, int) and peak >= 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return path, None


def keep_peak(path: Path, peak: int) -> None:
    """Keep a traced peak for `stored_peak`; a cache that cannot be written (read-only home) is skipped."""
    from fulltune.storage import atomic_write_text

    try:
        atomic_write_text(path, json.dumps({"peak_bytes": int(peak)}))
    except OSError:
        pass


# What the planner compares with: a replaced `simulate_memory` (a test's fake trace) is not read from the store.
TRACE_FUNCTION = simulate_memory
