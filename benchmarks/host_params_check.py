"""Parameters in host RAM on one GPU, measured against the plan: FSDP2's CPU offload over a one-process group
(`train.offload_optimizer` with `distributed.strategy: fsdp`, the case `distributed.strategy: auto` plans for a
model whose weights do not fit the device; fulltune/runtime/sharding.py).

Part of `python -m benchmarks.device_check` (`fsdp_offload_case`). Each variant runs in a child process of its
own, so its host RSS is its own and not the device check's, which has run other cases before; so do the probes
of the constants the step-time model assumes (copy bandwidth, host optimizer throughput). A child that fails
or runs past its timeout is reported, not fatal.

One part alone (in this process; its JSON to --out):
    python -m benchmarks.host_params_check adamw --out adamw.json
    python -m benchmarks.host_params_check probes --out probes.json --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import transformers

from fulltune.memory import Settings, estimate_memory
from fulltune.memory.units import format_bytes
from fulltune.planning.trace import make_batch, quiet
from fulltune.runtime import optim


def llama(h: int, I: int, L: int, a: int, kv: int, V: int, tied: bool = False) -> Any:  # noqa: E741,N803
    """A Llama config of these dimensions (the device check's shapes)."""
    return transformers.LlamaConfig(hidden_size=h, intermediate_size=I, num_hidden_layers=L, num_attention_heads=a,
                                    num_key_value_heads=kv, vocab_size=V, tie_word_embeddings=tied)


def safely(name: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`fn(*args, **kwargs)`, or what went wrong in it: one failing case must not lose the others."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # one failing case (e.g. out of memory) must not lose the others
        return {"name": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=3)}


def pct(x: float | None) -> str:
    """A relative error as a signed percentage (`-` when there is none)."""
    return "-" if x is None else f"{x:+.2%}"


HOST_PARAM_PROBES = "probes"
HOST_PARAM_VARIANTS = {
    # The case as first written: AdamW on the bf16 policy, no checkpointing.
    "adamw": "AdamW, bf16 policy, no checkpointing, micro 2 x 1",
    # What the planner's host-parameter plans choose (benchmarks/frontier_plan.py `host_parameter_rows`: 70B on
    # one 80 GiB GPU, 120B on one 141 GiB): Adafactor, pure bf16, the chunked loss, every layer checkpointed,
    # several micro-batches per step (each copies the parameters in and the gradients out again).
    "planner_levers": "Adafactor, pure bf16, chunked loss, all 22 layers checkpointed, micro 4 x 2",
}
DRY_RUN_SKIPPED = ("CPUOffloadPolicy needs CUDA (\"Cannot access accelerator device when none is available\"): "
                   "planned only; the step loop ran on CPU at a tiny shape without offload")


def host_param_variant(name: str) -> tuple[Any, Settings]:
    """The TinyLlama-1.1B shape at seq 2048 on one GPU with its parameters in host RAM, and the settings the
    variant runs: exactly what `host_param_steps` runs, so the plan is the plan of the measured step."""
    config = llama(2048, 5632, 22, 32, 4, 32000)
    common = dict(seq_len=2048, mixed_precision="bf16", device="cuda", strategy="fsdp", num_processes=1,
                  attention_mask=False, offload_optimizer=True)
    if name == "adamw":
        return config, Settings(micro_batch_size=2, **common)
    if name == "planner_levers":
        return config, Settings(micro_batch_size=4, gradient_accumulation_steps=2,
                                gradient_checkpointing=config.num_hidden_layers, optimizer="adafactor",
                                pure_bf16=True, chunked_loss=True, **common)
    raise ValueError(f"unknown host-parameter variant {name!r}; expected one of {', '.join(HOST_PARAM_VARIANTS)}")


def _dry_run_steps_variant(config: Any, settings: Settings) -> tuple[Any, Settings]:
    """--dry-run: the variant's step loop on CPU, a tiny Llama, FSDP2 over one gloo process without offload."""
    tiny = llama(64, 176, 3, 8, 2, 300)
    layers = settings.gradient_checkpointing
    layers = tiny.num_hidden_layers if layers >= config.num_hidden_layers else min(layers, tiny.num_hidden_layers)
    return tiny, replace(settings, seq_len=64, device="cpu", offload_optimizer=False, gradient_checkpointing=layers)


def host_parameter_plan(config: Any, settings: Settings) -> dict[str, Any]:
    """What the planner predicts for parameters in host RAM (FSDP2 CPU offload over one GPU): step time and its
    assumed terms (step_time.fsdp_offload_terms), the assumed constants they rest on, device and host bytes; the
    measured case is set against it. Runs on CPU too (--dry-run checks the arithmetic)."""
    from fulltune.memory.lever_bytes import lever_bytes
    from fulltune.memory.shapes import model_shape
    from fulltune.planning import step_time

    shape = model_shape(config)
    estimate = estimate_memory(config, settings)
    levers_bytes = lever_bytes(shape, settings)
    precision = "bf16" if settings.pure_bf16 else settings.mixed_precision
    # Read by name: the constants are the step-time model's, which may grow new ones.
    constants = {name: getattr(step_time, name, None)
                 for name in ("PCIE_BYTES_PER_S", "HOST_OPTIMIZER_BYTES_PER_S", "OFFLOAD_OVERLAP")}
    constants["FLOPS"] = step_time.FLOPS.get((settings.device, precision))
    constants["HOST_OPTIMIZER_SLOWDOWN"] = getattr(step_time, "HOST_OPTIMIZER_SLOWDOWN", {}).get(settings.optimizer)
    return {"predicted_seconds_per_step": step_time.step_seconds(shape, settings),
            "predicted_terms": dict(step_time.fsdp_offload_terms(shape, settings)),
            "assumed": constants,
            # Bytes the host optimizer reads and writes per step, as the model counts them.
            "host_optimizer_bytes": step_time._lever_host_traffic(shape, settings),
            "num_params": shape.num_params,
            "planned_peak": estimate.peak_bytes, "planned_step_device": estimate.step_device_bytes,
            "planned_device": estimate.device_bytes, "planned_host": estimate.host_bytes,
            # FSDP pins the parameter shards and the gradient shards it copies out (both in the weight dtype).
            "planned_pinned": 2 * levers_bytes.pinned}


def _one_process_env(port: int | None = None) -> dict[str, str]:
    """torchrun's variables for a process group of one process on this machine."""
    if port is None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


class _PeakRss:
    """The process's resident set size sampled every `interval` seconds on a thread while the block runs: its
    peak (`peak`), which, unlike `ru_maxrss`, leaves out what the process held before the block."""

    def __init__(self, interval: float = 0.02) -> None:
        import threading

        import psutil

        self._process = psutil.Process()
        self.peak = self._process.memory_info().rss
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def _init_weights(model: Any, std: float) -> None:
    """Initialise the materialised (sharded) parameters in place: matrices N(0, std), vectors (norm weights) 1."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if p.dim() >= 2:
                local.normal_(0.0, std)
            else:
                local.fill_(1.0)


def host_param_steps(config: Any, settings: Settings, steps: int) -> dict[str, Any]:
    """`steps` timed optimizer steps after one warm-up step (it creates the optimizer's states and warms the
    kernels) of `settings` over FSDP2 in this process, a process group of one; with `settings.offload_optimizer`
    on CUDA that is FSDP2's CPUOffloadPolicy, the parameters in host RAM.

    Built as the trainer builds it (fulltune/runtime/train.py `load_model_with_levers` → sharding
    `load_sharded_model`): the model on the meta device, its levers (checkpointing, pure bf16 cast, the loss
    head), `shard_model(offload=...)`, the shards materialised (pinned host RAM under offload, the buffers on the
    device) and initialised in place (no checkpoint is read), the optimizer from `optim.optimizer_for`. Each step
    is the trainer's for a sharded model (fulltune/runtime/step.py): every micro-batch's Σ token losses over the
    step's targets, backward (no autocast: bf16 is FSDP's policy), the clip over the shards, the optimizer step and
    zero_grad. Timed apart, each between two `torch.cuda.synchronize()`: forward+backward of the micro-batches
    (with the parameter copies host→device and the gradient copies device→host), the clip (the gradient norm
    over host shards) and the optimizer step + zero_grad (the host optimizer step)."""
    import copy
    import resource

    import torch
    import torch.distributed as dist
    from accelerate import init_empty_weights

    from fulltune.runtime import sharding
    from fulltune.runtime.checkpointing import apply_gradient_checkpointing
    from fulltune.runtime.loss import TargetHead

    if steps < 1:
        raise ValueError(f"timed steps must be >= 1; got {steps}")
    device, offload = settings.device, settings.offload_optimizer
    cuda = device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for key, value in _one_process_env(int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None).items():
        os.environ[key] = value
    # CUDA: NCCL for device tensors and gloo for the host shards' gradient norm (sharding.init_process_group).
    sharding.init_process_group(device, cpu_offload=offload)
    try:
        import psutil

        rss_before_model = psutil.Process().memory_info().rss  # interpreter, torch, (CUDA) its context and NCCL
        torch.manual_seed(0)
        with quiet():
            with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary) real
                model = transformers.AutoModelForCausalLM.from_config(
                    copy.deepcopy(config), attn_implementation=settings.attn_implementation, dtype=torch.float32)
            model.train()
            checkpointed = apply_gradient_checkpointing(model, settings.gradient_checkpointing)
            if settings.pure_bf16:
                model.to(torch.bfloat16)
            model.config.use_cache = False
            head = TargetHead(model, chunked=settings.chunked_loss)
            sharding.shard_model(model, device=device, mixed_precision=settings.mixed_precision, offload=offload)
            # As load_sharded_model does: the shards in pinned host RAM under offload, the buffers on the device.
            sharding._materialize(model, device, offload)
            _init_weights(model, config.initializer_range)
            optimizer = optim.optimizer_for(model, settings, lr=1e-5)
        first = next(model.parameters())
        pinned = all(p.to_local().is_pinned() for p in model.parameters()) if offload else None
        ga = settings.gradient_accumulation_steps
        batches = [make_batch(config.vocab_size, settings, device) for _ in range(ga)]
        step_targets = settings.micro_batch_size * settings.targets_per_row * ga
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start_allocated = torch.cuda.memory_allocated() if cuda else 0
        records = []
        with quiet(), _PeakRss() as rss:
            for _ in range(steps + 1):
                sync()
                started = time.perf_counter()
                step_loss = torch.zeros((), device=device)
                for inputs, targets in batches:
                    loss_sum = head.loss_sum(model, inputs, targets)
                    (loss_sum / step_targets).backward()
                    step_loss += loss_sum.detach()
                    del loss_sum
                sync()
                backward_done = time.perf_counter()
                norm = sharding.clip_grad_norm_(model, 1.0)
                sync()
                clipped = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                stepped = time.perf_counter()
                records.append({"forward_backward_s": backward_done - started, "clip_s": clipped - backward_done,
                                "optimizer_s": stepped - clipped, "step_s": stepped - started,
                                "loss": float(step_loss) / step_targets, "grad_norm": float(norm)})
        head.remove()
        timed = records[1:]

        def mean(key: str) -> float:
            return sum(r[key] for r in timed) / len(timed)

        row: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "timed_steps": len(timed),
            "warmup_step": records[0], "timed": timed, "seconds_per_step": mean("step_s"),
            "forward_backward_s": mean("forward_backward_s"), "clip_s": mean("clip_s"),
            "optimizer_s": mean("optimizer_s"), "losses": [r["loss"] for r in records],
            "optimizer": type(optimizer).__name__, "checkpointed_layers": checkpointed, "shards_pinned": pinned,
            "params_on": str(first.to_local().device if hasattr(first, "to_local") else first.device),
            "param_dtype": str(first.dtype), "cpu_threads": torch.get_num_threads(),
            "host_rss_before_model": rss_before_model, "host_rss_steps_peak": rss.peak,
            "host_rss_increase": rss.peak - rss_before_model,
            # The child's whole life, model building included: ru_maxrss (KiB on Linux), or the sampled peak where
            # the kernel's high-water mark has not caught up with it yet.
            "host_rss_lifetime_peak": max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss.peak)}
        if cuda:
            row["allocated"] = int(torch.cuda.max_memory_allocated() - start_allocated)
            row["reserved"] = int(torch.cuda.max_memory_reserved())
            host_stats = getattr(torch.cuda, "host_memory_stats", None)
            if host_stats is not None:  # the pinned (caching host) allocator: blocks rounded up to powers of two
                stats = host_stats()
                row["pinned_allocated"] = stats.get("allocated_bytes.current")
                row["pinned_allocated_peak"] = stats.get("allocated_bytes.peak")
                row["pinned_active_peak"] = stats.get("active_bytes.peak")
        return row
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def copy_probe(dry_run: bool, size: int = 2**30, repeats: int = 5) -> dict[str, Any]:
    """Host↔device copy bandwidth of pinned memory (what FSDP2's offload copies through): `size` bytes copied
    `repeats` times host→device, device→host, and both at once on two streams (bytes/s). --dry-run: the same
    code on host tensors (a host→host copy), which exercises the probe, not PCIe."""
    import contextlib

    import torch

    cuda = not dry_run
    if dry_run:
        size = min(size, 64 * 2**20)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def host() -> Any:
        return torch.empty(size, dtype=torch.uint8, pin_memory=cuda)

    def device() -> Any:
        return torch.empty(size, dtype=torch.uint8, device="cuda" if cuda else "cpu")

    def rate(copy: Any, nbytes: int) -> float:
        copy()  # warm-up
        sync()
        started = time.perf_counter()
        for _ in range(repeats):
            copy()
        sync()
        return nbytes * repeats / (time.perf_counter() - started)

    host_a, device_a, host_b, device_b = host(), device(), host(), device()
    host_a.fill_(1)
    device_b.fill_(2)
    streams = (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else (None, None)

    def on(stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def both() -> None:
        if cuda:  # the side streams start after what the current stream queued (the fills, earlier copies)
            for stream in streams:
                stream.wait_stream(torch.cuda.current_stream())
        with on(streams[0]):
            device_a.copy_(host_a, non_blocking=cuda)
        with on(streams[1]):
            host_b.copy_(device_b, non_blocking=cuda)

    return {"kind": "pinned host↔device" if cuda else "host→host (dry run: the probe's code path, not PCIe)",
            "bytes": size, "repeats": repeats,
            "host_to_device_bytes_per_s": rate(lambda: device_a.copy_(host_a, non_blocking=cuda), size),
            "device_to_host_bytes_per_s": rate(lambda: host_b.copy_(device_b, non_blocking=cuda), size),
            "both_directions_bytes_per_s": rate(both, 2 * size)}


def host_optimizer_probe(name: str, dry_run: bool, steps: int = 3) -> dict[str, Any]:
    """Throughput of the host optimizer of variant `name`: its optimizer (`optim.build_optimizer`, as the
    runtime builds it for host tensors) stepping CPU tensors of TinyLlama's MLP matrix shape, in the variant's
    weight dtype, counted in the bytes per parameter `step_time._lever_host_traffic` counts for that variant
    (bytes/s, against HOST_OPTIMIZER_BYTES_PER_S). Runs on CPU for real in --dry-run too (smaller)."""
    import torch

    from fulltune.memory.shapes import model_shape
    from fulltune.planning import step_time

    config, settings = host_param_variant(name)
    shape = model_shape(config)
    per_parameter = step_time._lever_host_traffic(shape, settings) / shape.num_params
    rows, cols, count = (1024, 256, 2) if dry_run else (5632, 2048, 8)
    dtype = torch.bfloat16 if settings.pure_bf16 else torch.float32
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype).normal_(0.0, 0.02))
        p.grad = torch.empty_like(p).normal_(0.0, 1e-3)
        params.append(p)
    optimizer = optim.build_optimizer(params, settings.optimizer, lr=1e-5, pure_bf16=settings.pure_bf16)
    optimizer.step()  # warm-up: creates the states
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    seconds = (time.perf_counter() - started) / steps
    numel = rows * cols * count
    return {"variant": name, "optimizer": settings.optimizer, "pure_bf16": settings.pure_bf16,
            "implementation": type(optimizer).__name__, "dtype": str(dtype), "parameters": numel,
            "bytes_per_parameter": per_parameter, "seconds_per_step": seconds,
            "bytes_per_s": per_parameter * numel / seconds, "cpu_threads": torch.get_num_threads()}


def host_param_probes(dry_run: bool) -> dict[str, Any]:
    """The probes of the assumed constants: copy bandwidth and each variant's host optimizer (each reported
    apart when it fails)."""
    seen, optimizers = set(), []
    for name in HOST_PARAM_VARIANTS:
        _, settings = host_param_variant(name)
        if (settings.optimizer, settings.pure_bf16) not in seen:
            seen.add((settings.optimizer, settings.pure_bf16))
            optimizers.append(safely(f"host optimizer ({name})", host_optimizer_probe, name, dry_run))
    return {"name": HOST_PARAM_PROBES, "copy": safely("copy", copy_probe, dry_run), "host_optimizer": optimizers}


def host_params_child(name: str, dry_run: bool, steps: int) -> dict[str, Any]:
    """What a `host_params_check NAME` child reports: the probes, or one variant's plan and its measured steps (GPU),
    or its plan and the tiny CPU run of its step loop (--dry-run). A failing measurement keeps the plan."""
    if name == HOST_PARAM_PROBES:
        return host_param_probes(dry_run)
    from fulltune import levers

    config, settings = host_param_variant(name)
    row: dict[str, Any] = {"name": name, "description": HOST_PARAM_VARIANTS[name], "settings": settings.to_dict(),
                           "plan": host_parameter_plan(config, settings),
                           "lever_problems": levers.problems(levers.from_settings(settings, bf16_supported=True))}
    try:
        if not dry_run:
            row["measured"] = host_param_steps(config, settings, steps)
            return row
        row["skipped"] = DRY_RUN_SKIPPED
        tiny, cpu_settings = _dry_run_steps_variant(config, settings)
        row["dry_run"] = {"settings": cpu_settings.to_dict(), "plan": host_parameter_plan(tiny, cpu_settings),
                          "measured": host_param_steps(tiny, cpu_settings, steps)}
    except Exception as exc:  # the plan is still worth reporting
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc(limit=8)
    return row


def _child_timeout(name: str, dry_run: bool, steps: int) -> float:
    """Seconds a child may run: start, build and the steps at 3× their predicted time, bounded (the whole device
    session has ~15 minutes for every case)."""
    if dry_run:
        return 300.0
    if name == HOST_PARAM_PROBES:
        return 180.0
    from fulltune.memory.shapes import model_shape
    from fulltune.planning.step_time import step_seconds

    config, settings = host_param_variant(name)
    return min(420.0, 150.0 + 3.0 * (steps + 1) * step_seconds(model_shape(config), settings))


def _text(output: Any) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def run_host_params_child(names: tuple[str, ...], dry_run: bool, steps: int) -> dict[str, dict[str, Any]]:
    """`python -m benchmarks.host_params_check NAME...` in a fresh process (a process group of its own on a free
    port), the parts one after the other; {name: its JSON, or what went wrong (exit status, timeout, the end of
    its stderr)}."""
    import subprocess
    import tempfile

    timeout = sum(_child_timeout(name, dry_run, steps) for name in names)
    with tempfile.TemporaryDirectory(prefix="fulltune-host-params-") as tmp:
        out = Path(tmp) / (f"{names[0]}.json" if len(names) == 1 else "parts")
        command = [sys.executable, "-m", "benchmarks.host_params_check", *names, "--steps", str(steps), "--out",
                   str(out), *(["--dry-run"] if dry_run else [])]
        env = {**os.environ, **_one_process_env()}
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return {name: {"name": name, "error": f"timed out after {timeout:.0f} s (child killed)",
                           "stderr_tail": _text(exc.stderr)[-3000:]} for name in names}
        rows = {}
        for name in names:
            path = out if len(names) == 1 else out / f"{name}.json"
            try:
                rows[name] = json.loads(path.read_text()) if path.is_file() else {"name": name}
            except ValueError as exc:
                rows[name] = {"name": name, "error": f"unreadable report: {exc}"}
    for row in rows.values():
        row["child_seconds"] = round(time.perf_counter() - started, 1)
        if done.returncode != 0 and "error" not in row:
            row["error"] = f"child exited with status {done.returncode}"
        if "error" in row:
            row["stderr_tail"] = _text(done.stderr)[-3000:]
    return rows


def host_param_comparisons(plan: dict[str, Any], measured: dict[str, Any], settings: dict[str, Any],
                           probes: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each assumed term of the plan beside what the step and the probes measured: {term, assumed, measured,
    unit, ratio (measured / assumed), note}. Copy times at the measured bandwidth are the predicted bytes (the
    predicted seconds × the assumed rate) over the probes' rates; the exposed copy time is implied by the measured
    forward+backward less the predicted compute time, and the overlap by both."""
    terms, assumed = plan["predicted_terms"], plan["assumed"]
    rows: list[dict[str, Any]] = []

    def add(term: str, expected: float | None, value: float | None, unit: str, note: str = "") -> None:
        ratio = value / expected if value is not None and expected else None
        rows.append({"term": term, "assumed": expected, "measured": value, "unit": unit, "ratio": ratio,
                     "note": note})

    forward_backward, host_step = measured["forward_backward_s"], measured["optimizer_s"]
    add("step time", plan["predicted_seconds_per_step"], measured["seconds_per_step"], "s",
        "step_seconds against forward+backward + clip + optimizer step")
    compute, exposed = terms.get("compute_s"), terms.get("exposed_pcie_s")
    if compute is not None:
        add("forward+backward = compute_s + exposed_pcie_s", compute + (exposed or 0.0), forward_backward, "s",
            "measured with the parameter copies in and the gradient copies out")
    copies = (probes or {}).get("copy") or {}
    pcie = assumed.get("PCIE_BYTES_PER_S")
    to_device, to_host = copies.get("host_to_device_bytes_per_s"), copies.get("device_to_host_bytes_per_s")
    kind = copies.get("kind", "")
    add("PCIE_BYTES_PER_S, host→device", pcie, to_device, "B/s", kind)
    add("PCIE_BYTES_PER_S, device→host", pcie, to_host, "B/s", kind)
    add("PCIE_BYTES_PER_S, both directions at once", pcie, copies.get("both_directions_bytes_per_s"), "B/s",
        "sum of the two directions on two streams")
    copy_seconds = None
    if pcie and to_device and to_host:
        params_in, grads_out = terms.get("params_in_s"), terms.get("grads_out_s")
        if params_in is not None and grads_out is not None:
            add("params_in_s at the measured host→device rate", params_in, params_in * pcie / to_device, "s")
            add("grads_out_s at the measured device→host rate", grads_out, grads_out * pcie / to_host, "s")
            copy_seconds = params_in * pcie / to_device + grads_out * pcie / to_host
        elif terms.get("pcie_bytes") is not None:
            # Two of fsdp_offload_terms' three copies go in (forward and backward all-gather), one comes out.
            copy_seconds = terms["pcie_bytes"] * (2 / 3 / to_device + 1 / 3 / to_host)
        add("pcie_s at the measured rates", terms.get("pcie_s"), copy_seconds, "s",
            "the predicted bytes over the probes' rates, not timed inside the step")
    if compute is not None:
        implied = forward_backward - compute
        add("exposed_pcie_s, implied", exposed, implied, "s",
            "measured forward+backward − predicted compute_s; below 0: compute ran faster than FLOPS assumes")
        if copy_seconds is not None and compute > 0:
            overlap = (copy_seconds - max(implied, 0.0)) / compute
            add("OFFLOAD_OVERLAP, implied", assumed.get("OFFLOAD_OVERLAP"), overlap, "",
                "(pcie_s at the measured rates − implied exposed) / compute_s; outside 0–1: compute_s is off")
    predicted_host = terms.get("host_step_s")
    gathered = measured.get("optimizer") == "GatheredOptimizer"
    add("host_step_s = optimizer step + zero_grad", predicted_host, host_step, "s",
        "with GatheredOptimizer's copy of each updated parameter through the mesh's device" if gathered else "")
    rate = assumed.get("HOST_OPTIMIZER_BYTES_PER_S")
    if predicted_host and rate and host_step > 0:
        add("HOST_OPTIMIZER_BYTES_PER_S, implied by the step", rate, predicted_host * rate / host_step, "B/s",
            "host_step_s's bytes (with its slowdown factor) over the measured optimizer step")
    for probe in (probes or {}).get("host_optimizer") or []:
        same = (probe.get("optimizer"), probe.get("pure_bf16")) == (settings["optimizer"], settings["pure_bf16"])
        if "error" not in probe and same:
            add(f"HOST_OPTIMIZER_BYTES_PER_S, probe ({probe['implementation']})", rate, probe["bytes_per_s"], "B/s",
                f"{probe['parameters'] / 1e6:.3g}M {probe['dtype']} parameters on {probe['cpu_threads']} CPU threads")
    add("clip: gradient norm over the shards", None, measured["clip_s"], "s", "not in the step-time model")
    if "allocated" in measured:
        add("device peak allocated", plan["planned_peak"], measured["allocated"], "B")
        add("device reserved", plan["planned_step_device"], measured["reserved"], "B",
            "step_device_bytes: + CUDA context and allocator slack")
    add("host RSS increase while stepping", plan["planned_host"], measured["host_rss_increase"], "B",
        "peak RSS over the steps − RSS before the model was built")
    if measured.get("pinned_allocated") is not None:
        add("pinned host bytes (allocator)", plan["planned_pinned"], measured["pinned_allocated"], "B",
            "parameter + gradient shards; the allocator rounds each block up to a power of two")
    return rows


def fsdp_offload_case(dry_run: bool, steps: int = 2) -> dict[str, Any]:
    """Parameters in host RAM: FSDP2's CPU offload (`train.offload_optimizer` with strategy fsdp;
    fulltune/runtime/sharding.py) over a one-process group on one GPU, the TinyLlama-1.1B shape at seq 2048, in
    two variants (`HOST_PARAM_VARIANTS`): AdamW on the bf16 policy without checkpointing, and the levers the
    planner's host-parameter plans choose. Each runs in a child process of its own (`host_param_steps`: one
    warm-up step, then `steps` timed ones) and is set against its plan (`host_parameter_plan`): the device's peak
    allocated / reserved, the child's host RSS and pinned bytes, the step time and each assumed term
    (`host_param_comparisons`), with the probes of the assumed constants (copy bandwidth, host optimizer
    throughput) from a child of their own. GPU-only: CPUOffloadPolicy refuses to run without an accelerator,
    so --dry-run plans both variants, runs their step loop on CPU at a tiny shape without offload, and runs the
    probes on CPU (the copy probe host→host)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()  # the earlier cases' cached blocks: the children have the GPU to themselves (no-op on CPU)
    parts = (HOST_PARAM_PROBES, *HOST_PARAM_VARIANTS)
    # --dry-run: one child runs the parts in turn (at its tiny shapes, starting three children would cost more than
    # the parts: torch and transformers imported three times); on a GPU each part has a fresh process of its own.
    together = run_host_params_child(parts, dry_run, steps) if dry_run else {}

    def part_row(name: str) -> dict[str, Any]:
        return together[name] if together else run_host_params_child((name,), dry_run, steps)[name]

    probes = part_row(HOST_PARAM_PROBES)
    print(f"[fsdp offload] probes: {'FAILED' if 'error' in probes else 'done'}", file=sys.stderr, flush=True)
    usable = None if "error" in probes else probes
    variants = []
    for name in HOST_PARAM_VARIANTS:
        row = part_row(name)
        for part in (row, row.get("dry_run")):
            if part and "measured" in part:
                part["comparisons"] = host_param_comparisons(part["plan"], part["measured"], part["settings"], usable)
        variants.append(row)
        print(f"[fsdp offload] {name}: {'FAILED' if 'error' in row else 'done'}", file=sys.stderr, flush=True)
    return {"probes": probes, "variants": variants}


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B":
        return format_bytes(value)
    if unit == "B/s":
        return f"{value / 1e9:.3g} GB/s"
    return f"{value:.3g}{' ' + unit if unit else ''}"


def _comparison_table(rows: list[dict[str, Any]], indent: str) -> list[str]:
    head = f"{indent}{'term':52s} {'assumed':>13s} {'measured':>13s} {'meas/assumed':>13s}"
    lines = [head]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3g}x"
        lines.append(f"{indent}{r['term']:52s} {_value(r['assumed'], r['unit']):>13s} "
                     f"{_value(r['measured'], r['unit']):>13s} {ratio:>13s}")
    return lines


def _error(plan: float | None, measured: float | None) -> str:
    """The plan's error against the measurement, as the memory table's `est err` (plan / measured - 1)."""
    return "plan err " + pct(plan / measured - 1 if plan is not None and measured else None)


def _losses(measured: dict[str, Any]) -> str:
    return ", ".join(f"{x:.3f}" for x in measured["losses"])


def _measured_lines(plan: dict[str, Any], m: dict[str, Any]) -> list[str]:
    """A measured variant: device peak, host peak and step time against the plan."""
    peak, step_device, host = plan["planned_peak"], plan["planned_step_device"], plan["planned_host"]
    predicted = plan["predicted_seconds_per_step"]
    pinned = ""
    if m.get("pinned_allocated") is not None:
        pinned = (f"; pinned {format_bytes(m['pinned_allocated'])} vs {format_bytes(plan['planned_pinned'])} "
                  f"planned ({_error(plan['planned_pinned'], m['pinned_allocated'])})")
    return [
        f"    device peak {format_bytes(m['allocated'])} vs estimate {format_bytes(peak)} "
        f"({_error(peak, m['allocated'])}); reserved {format_bytes(m['reserved'])} vs {format_bytes(step_device)} "
        f"({_error(step_device, m['reserved'])})",
        f"    host RSS +{format_bytes(m['host_rss_increase'])} while stepping vs estimate {format_bytes(host)} "
        f"({_error(host, m['host_rss_increase'])}){pinned}; the child's peak RSS "
        f"{format_bytes(m['host_rss_lifetime_peak'])}",
        f"    step {m['seconds_per_step']:.3g} s vs predicted {predicted:.3g} s "
        f"({_error(predicted, m['seconds_per_step'])}): forward+backward {m['forward_backward_s']:.3g} s, clip "
        f"{m['clip_s']:.3g} s, optimizer {m['optimizer_s']:.3g} s; shards pinned: {m['shards_pinned']}; "
        f"losses {_losses(m)}"]


def _planned_lines(v: dict[str, Any]) -> list[str]:
    """A variant the dry run planned: the plan, and its step loop's CPU run at a tiny shape."""
    plan, t = v["plan"], v["plan"]["predicted_terms"]
    lines = [f"    plan: device peak {format_bytes(plan['planned_peak'])}, host {format_bytes(plan['planned_host'])}, "
             f"{plan['predicted_seconds_per_step']:.3g} s/step (compute {t.get('compute_s', 0):.3g} s, copies "
             f"{t.get('pcie_s', 0):.3g} s, exposed {t.get('exposed_pcie_s', 0):.3g} s, host step "
             f"{t.get('host_step_s', 0):.3g} s); lever problems: {v['lever_problems'] or 'none'}"]
    dry = v["dry_run"]
    if "measured" in dry:
        m = dry["measured"]
        lines.append(f"    dry-run loop ({m['optimizer']}, {m['checkpointed_layers']} layers checkpointed, CPU): "
                     f"{m['seconds_per_step']:.3g} s/step, forward+backward {m['forward_backward_s']:.3g} s, clip "
                     f"{m['clip_s']:.3g} s, optimizer {m['optimizer_s']:.3g} s; host RSS "
                     f"+{format_bytes(m['host_rss_increase'])}; losses {_losses(m)}")
        lines.append("    the dry-run loop against its own CPU plan (checks the arithmetic; measures nothing):")
        lines.extend(_comparison_table(dry.get("comparisons", []), "    "))
    return lines


def host_param_lines(offload: dict[str, Any]) -> list[str]:
    """The host-parameter case in the summary: per variant the device peak, host peak and step time against the
    plan, then each assumed term against its measurement; the probes first."""
    if "error" in offload:
        return [f"FSDP CPU offload: FAILED: {offload['error']}"]
    if not offload:
        return []
    lines = ["Parameters in host RAM (FSDP2 CPU offload over one GPU; each part in a child process of its own):"]
    probes = offload.get("probes") or {}
    if "error" in probes:
        lines.append(f"  probes: FAILED: {probes['error']}")
    elif probes:
        c = probes["copy"]
        if "error" in c:
            lines.append(f"  copy probe: FAILED: {c['error']}")
        else:
            lines.append(f"  copy probe, {c['kind']}: host→device {_value(c['host_to_device_bytes_per_s'], 'B/s')}, "
                         f"device→host {_value(c['device_to_host_bytes_per_s'], 'B/s')}, both at once "
                         f"{_value(c['both_directions_bytes_per_s'], 'B/s')} ({format_bytes(c['bytes'])} x "
                         f"{c['repeats']})")
        for o in probes["host_optimizer"]:
            if "error" in o:
                lines.append(f"  {o['name']} probe: FAILED: {o['error']}")
                continue
            lines.append(f"  host optimizer probe, {o['implementation']} on {o['parameters'] / 1e6:.3g}M {o['dtype']} "
                         f"parameters, {o['cpu_threads']} threads: {_value(o['bytes_per_s'], 'B/s')} "
                         f"({o['bytes_per_parameter']:.3g} B/parameter, {o['seconds_per_step']:.3g} s/step)")
    for v in offload.get("variants", []):
        title = f"  {v['name']} ({v.get('description', '')})"
        if "error" in v:
            lines.append(f"{title}: FAILED: {v['error']}")
        if "measured" in v:
            m = v["measured"]
            lines.append(f"{title} on {m['device']}, {m['optimizer']}, {m['timed_steps']} timed steps after a warm-up:")
            lines.extend(_measured_lines(v["plan"], m))
            lines.extend(_comparison_table(v.get("comparisons", []), "    "))
        elif "dry_run" in v:
            lines.append(f"{title}: {v['skipped']}")
            lines.extend(_planned_lines(v))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="+", choices=(HOST_PARAM_PROBES, *HOST_PARAM_VARIANTS),
                        help="the parts, run one after the other")
    parser.add_argument("--out", required=True,
                        help="where to write the part's JSON; with several parts, a directory of NAME.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU: checks the script, measures nothing")
    parser.add_argument("--steps", type=int, default=2, help="timed steps, after one warm-up step")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    failed = False
    for part in args.part:
        try:
            report = host_params_child(part, args.dry_run, args.steps)
        except Exception as exc:  # reported to the parent in the JSON it reads
            report = {"name": part, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
        out = Path(args.out) if len(args.part) == 1 else Path(args.out) / f"{part}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(out)
        failed |= "error" in report
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
