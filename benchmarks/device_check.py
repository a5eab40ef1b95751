"""One prepared check for the first session with a GPU: is the memory model right on CUDA, and how fast is a step?

For a handful of configurations (the issue-13 step: TinyLlama-1.1B shape, seq 2048, micro 2 × accumulation 4,
1 of 22 layers checkpointed, bf16, Adafactor, unpacked rows; bf16 steps with and without a mask and
checkpointing; fp32) it runs two optimizer steps the way fulltune's trainer does (fulltune/planning/trace.py)
and prints, per configuration:

- the analytic estimate (`estimate_memory`: allocated peak and device total),
- the CPU FakeTensor trace of the same step (`simulate_memory`) where the case asks for it,
- `torch.cuda.max_memory_allocated` and `torch.cuda.max_memory_reserved` of the real step,

so the estimate's error and the allocator's slack (`runtime_overhead` assumes 0.6 GiB + 8%) are measured,
and which of estimate and trace is right on CUDA is settled. Then:

- MFU of a short bf16 training loop (model FLOPs per token of fulltune/memory/flops.py, via `flops_per_token`,
  against the device's dense bf16 peak from `fulltune.memory.flops.GPU_PEAK_FLOPS` or --peak-tflops),
- fp16 autocast with a `GradScaler`: a few steps with one injected overflow, checking the step is skipped,
  the scale drops and training continues; with its memory peak against the estimate;
- parameters in host RAM: FSDP2's CPU offload over one GPU (world size 1, `fsdp_offload_case`; the GPU-only
  path of `train.offload_optimizer` under fsdp), TinyLlama-1.1B at seq 2048 in two variants (AdamW on the bf16
  policy; the planner's host-parameter levers: Adafactor, pure bf16, chunked loss, every layer checkpointed),
  each in a child process of its own: device peak allocated / reserved, the child's host RSS and pinned bytes
  against the estimate, the step time against the plan's, forward+backward and the host optimizer step timed
  apart, and each assumed step-time term (PCIe bandwidth, overlap, host optimizer throughput) against a
  measurement, with probes of copy bandwidth and host optimizer throughput;
- the evaluate stage at the Llama-3.1-8B-on-24 GiB plan's settings, on the 8B shape cut to 4 layers
  (`eval_memory.device_case`): peak allocated against the memory model and the budget;
- packed rows, masked against varlen (`varlen_case`): the Llama-3.2-1B shape, rows of 8k and 32k tokens packed
  with documents of 1,024, bf16, every layer checkpointed, chunked loss; transformers' SDPA with its dense block
  mask from the restarting position_ids against fulltune's document attention (`varlen_attn`), each for its
  tokens/s and peak allocated against the estimate (mask: `attention_mask`; varlen: `document_length`);
- context parallel over NCCL (`context_parallel_case`, 2 GPUs): Ulysses and ring attention (PyTorch's
  `context_parallel`, CUDA only: 3 heads over 2 processes) against one process, loss and gradients of one
  micro-batch (tests/context_parallel_worker.py --cuda); on one GPU it says so and measures nothing;
- float8 training (`train.float8`, needs torchao and a GPU with float8 tensor cores): tokens/s of bf16 against
  float8 tensorwise and rowwise with the same plan, compiled and eager, each peak against the estimate
  (benchmarks/float8_check.py `float8_case`).

Usage (a few minutes on one H100/H200; each case is independent and a failing one is reported, not fatal):
    python -m benchmarks.device_check --out device_check.json
    python -m benchmarks.device_check --dry-run --out /tmp/dry.json   # CPU, tiny shapes: checks the script
    python -m benchmarks.host_params_check adamw --out adamw.json   # one host-parameter part alone
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import transformers

from fulltune.memory.flops import peak_flops
from fulltune.memory import Settings, estimate_memory, flops_per_token
from fulltune.planning import measure_memory, simulate_memory
from fulltune.runtime import optim
from fulltune.planning.trace import build_model, make_batch, measure_cuda, quiet, timed_train_steps
from fulltune.memory.units import format_bytes
from benchmarks.host_params_check import fsdp_offload_case, host_param_lines, pct, safely

# What --dry-run assumes for the CPU (only to exercise the arithmetic).
CPU_NOMINAL_FLOPS = 1e11


@dataclass(frozen=True)
class Case:
    name: str
    config: Any
    settings: Settings
    trace: bool = False  # also trace on CPU (a 1.1B step takes ~20–30 s)
    tags: tuple[str, ...] = field(default=())


def _llama(h: int, I: int, L: int, a: int, kv: int, V: int, tied: bool = False) -> Any:  # noqa: E741,N803
    return transformers.LlamaConfig(hidden_size=h, intermediate_size=I, num_hidden_layers=L, num_attention_heads=a,
                                    num_key_value_heads=kv, vocab_size=V, tie_word_embeddings=tied)


def cases(dry_run: bool) -> list[Case]:
    device = "cpu" if dry_run else "cuda"
    if dry_run:
        tiny = _llama(64, 176, 3, 8, 2, 300)
        S = dict(seq_len=64, device=device)  # noqa: N806
        return [
            Case("issue 13 (tiny)", tiny, Settings(micro_batch_size=2, gradient_accumulation_steps=4,
                 gradient_checkpointing=1, mixed_precision="bf16", optimizer="adafactor", attention_mask=False, **S),
                 trace=True, tags=("partial", "bf16")),
            Case("bf16 mask (tiny)", tiny, Settings(micro_batch_size=2, mixed_precision="bf16", **S), tags=("bf16",)),
            Case("fp32 all checkpointed (tiny)", tiny, Settings(micro_batch_size=2, gradient_accumulation_steps=2,
                 gradient_checkpointing=3, attention_mask=False, **S), tags=("all",)),
            Case("levers off (tiny)", tiny, Settings(micro_batch_size=4, gradient_checkpointing=3,
                 mixed_precision="bf16", optimizer="adafactor", **S), tags=("all", "bf16")),
            Case("frontier levers (tiny)", tiny, Settings(micro_batch_size=4, gradient_checkpointing=3,
                 mixed_precision="bf16", optimizer="adafactor", pure_bf16=True, optimizer_in_backward=True,
                 chunked_loss=True, **S), trace=True, tags=("all", "bf16", "levers")),
            Case("pure bf16 plain rounding (tiny)", tiny, Settings(micro_batch_size=2, mixed_precision="bf16",
                 pure_bf16=True, compensation="none", attention_mask=False, **S), tags=("bf16", "levers")),
            Case("muon (tiny)", tiny, Settings(micro_batch_size=2, mixed_precision="bf16", optimizer="muon",
                 attention_mask=False, **S), tags=("bf16", "muon")),
        ]
    tinyllama = _llama(2048, 5632, 22, 32, 4, 32000)
    qwen05 = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                      tie_word_embeddings=True)
    smollm = _llama(576, 1536, 30, 9, 3, 49152, tied=True)
    llama1b = _llama(2048, 8192, 16, 32, 8, 128256, tied=True)
    return [
        Case("issue 13: TinyLlama-1.1B", tinyllama, Settings(micro_batch_size=2, seq_len=2048, gradient_accumulation_steps=4,
             gradient_checkpointing=1, mixed_precision="bf16", optimizer="adafactor", device=device,
             attention_mask=False), trace=True, tags=("partial", "bf16")),
        Case("TinyLlama-1.1B bf16 mask", tinyllama, Settings(micro_batch_size=1, seq_len=2048, mixed_precision="bf16",
             device=device), trace=True, tags=("bf16", "mask")),
        Case("TinyLlama-1.1B bf16 no ckpt", tinyllama, Settings(micro_batch_size=2, seq_len=2048,
             gradient_accumulation_steps=2, mixed_precision="bf16", device=device, attention_mask=False),
             tags=("bf16",)),
        Case("Qwen2-0.5B bf16 half ckpt", qwen05, Settings(micro_batch_size=4, seq_len=1024, mixed_precision="bf16",
             gradient_checkpointing=12, device=device), tags=("partial", "bf16", "mask", "tied")),
        Case("SmolLM-135M fp32 all ckpt", smollm, Settings(micro_batch_size=8, seq_len=1024, gradient_checkpointing=30,
             gradient_accumulation_steps=2, device=device, attention_mask=False), tags=("all", "fp32")),
        # The frontier levers, each case measured with its own settings (the trainer's step builds them).
        Case("Llama-3.2-1B pure bf16 + in backward + chunked", llama1b, Settings(micro_batch_size=4, seq_len=2048,
             gradient_checkpointing=16, mixed_precision="bf16", optimizer="adafactor", pure_bf16=True,
             optimizer_in_backward=True, chunked_loss=True, device=device, attention_mask=False),
             tags=("all", "bf16", "levers")),
        Case("Llama-3.2-1B offload optimizer + activations", llama1b, Settings(micro_batch_size=2, seq_len=2048,
             gradient_accumulation_steps=2, gradient_checkpointing=16, mixed_precision="bf16", offload_optimizer=True,
             offload_activations=True, device=device, attention_mask=False), tags=("all", "bf16", "levers")),
        Case("Llama-3.2-1B 8-bit AdamW + chunked", llama1b, Settings(micro_batch_size=2, seq_len=2048,
             gradient_accumulation_steps=2, gradient_checkpointing=8, mixed_precision="bf16", optimizer="adamw_8bit",
             chunked_loss=True, device=device, attention_mask=False), tags=("partial", "bf16", "levers")),
        # train.compensation none (torchtune's pure-bf16 recipe: bf16 AdamW states, no Kahan buffer) and Muon (one
        # momentum buffer per decoder matrix, its Newton–Schulz temporaries in the step) on CUDA.
        Case("Llama-3.2-1B pure bf16 plain rounding", llama1b, Settings(micro_batch_size=2, seq_len=2048,
             gradient_checkpointing=16, mixed_precision="bf16", pure_bf16=True, compensation="none", device=device,
             attention_mask=False), tags=("all", "bf16", "levers")),
        Case("Llama-3.2-1B muon pure bf16", llama1b, Settings(micro_batch_size=2, seq_len=2048,
             gradient_checkpointing=16, mixed_precision="bf16", optimizer="muon", pure_bf16=True, device=device,
             attention_mask=False), tags=("all", "bf16", "muon")),
    ]


def memory_case(case: Case, on_gpu: bool) -> dict[str, Any]:
    est = estimate_memory(case.config, case.settings)
    row: dict[str, Any] = {"name": case.name, "tags": list(case.tags), "settings": case.settings.to_dict(),
                           "estimate_peak": est.peak_bytes, "estimate_device": est.device_bytes,
                           "estimate_phase": est.peak_phase}
    if case.trace:
        started = time.perf_counter()
        row["trace_peak"] = simulate_memory(case.config, case.settings).peak_bytes
        row["trace_seconds"] = round(time.perf_counter() - started, 1)
    if on_gpu:
        measured = measure_cuda(case.config, case.settings)  # the trainer's step with the case's levers
        row["measured_allocated"], row["measured_reserved"] = measured["allocated"], measured["reserved"]
    else:  # --dry-run: CPU tensors under MemTracker; no reserved figure
        row["measured_allocated"], row["measured_reserved"] = measure_memory(case.config, case.settings), None
    row["estimate_error"] = est.peak_bytes / row["measured_allocated"] - 1
    if "trace_peak" in row:
        row["trace_error"] = row["trace_peak"] / row["measured_allocated"] - 1
    if row["measured_reserved"]:
        row["device_error"] = est.device_bytes / row["measured_reserved"] - 1
    return row


def _peak_flops(device_name: str, override: float | None) -> float:
    if override:
        return override * 1e12
    return peak_flops(device_name) or CPU_NOMINAL_FLOPS


def timed_steps(config: Any, settings: Settings, steps: int, attn_implementation: str | None = None) -> float:
    """Seconds of `steps` optimizer steps of the trainer's step after one warm-up step; `attn_implementation` swaps
    the model's attention after it is built (transformers' own `sdpa` for the masked case)."""
    device = settings.device
    with quiet():
        model = build_model(config, settings).to(device)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        optimizer = optim.optimizer_for(model, settings)
        return timed_train_steps(model, optimizer, settings, steps, device)


def mfu_case(config: Any, settings: Settings, steps: int, peak: float) -> dict[str, Any]:
    """Tokens/s and MFU of `steps` optimizer steps after one warm-up step."""
    seconds = timed_steps(config, settings, steps)
    tokens = steps * settings.micro_batch_size * settings.gradient_accumulation_steps * settings.seq_len
    rate = tokens / seconds
    achieved = rate * flops_per_token(config, settings.seq_len)
    return {"settings": settings.to_dict(), "steps": steps, "seconds": round(seconds, 3), "tokens_per_second": rate,
            "model_flops_per_second": achieved, "peak_flops": peak, "mfu": achieved / peak}


def fp16_case(config: Any, settings: Settings, steps: int, overflow_at: int) -> dict[str, Any]:
    """The trainer's fp16 path — accelerate's Accelerator and GradScaler around the one training step
    (fulltune/runtime/step.py) — with the loss of step `overflow_at` (0-based) made inf: that step must be skipped, the
    scale must drop, and the weights must keep changing afterwards. On CPU (--dry-run) the case runs bf16,
    where the non-finite loss is skipped by the step's finite check (no scale)."""
    import torch
    from accelerate import Accelerator

    from fulltune.runtime.faults import TrainHooks
    from fulltune.runtime.loss import TargetHead
    from fulltune.runtime.step import StepParts, run_step

    class Overflow(TrainHooks):
        def on_loss(self, step: int, loss: Any) -> Any:
            return loss * float("inf") if step == overflow_at + 1 else loss

    device = settings.device
    if device == "cpu":
        settings = replace(settings, mixed_precision="bf16")
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with quiet():
        # Accelerate's state is process-wide: this is the script's only Accelerator, made last.
        accelerator = Accelerator(cpu=device == "cpu", mixed_precision=settings.mixed_precision,
                                  gradient_accumulation_steps=settings.gradient_accumulation_steps)
        model = build_model(config, settings)
        head = TargetHead(model, chunked=settings.chunked_loss)
        optimizer = optim.optimizer_for(model, settings)
        model, optimizer = accelerator.prepare(model, optimizer)
        parts = StepParts.assemble(accelerator, model, head, optimizer, settings, hooks=Overflow())
        first = next(model.parameters())
        targets = settings.micro_batch_size * settings.targets_per_row * settings.gradient_accumulation_steps
        log = []
        for step in range(1, steps + 1):
            before = first.detach().clone()
            scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
            batches = (make_batch(config.vocab_size, settings, device)
                       for _ in range(settings.gradient_accumulation_steps))
            outcome = run_step(parts, batches, step, targets)
            log.append({"step": step - 1, "loss_finite": bool(torch.isfinite(outcome.loss_sum).item()),
                        "stepped": outcome.stepped, "scale_before": scale,
                        "scale_after": accelerator.scaler.get_scale() if accelerator.scaler is not None else None,
                        "weights_changed": not torch.equal(before, first.detach())})
        head.remove()
    skipped = log[overflow_at]
    scale_dropped = skipped["scale_before"] is None or skipped["scale_after"] < skipped["scale_before"]
    ok = (not skipped["weights_changed"] and not skipped["stepped"] and scale_dropped
          and all(r["weights_changed"] for r in log[overflow_at + 1:]))
    row: dict[str, Any] = {"settings": settings.to_dict(), "steps": log, "overflow_step_skipped_and_recovered": ok}
    if device == "cuda":
        torch.cuda.synchronize()
        row["measured_allocated"] = int(torch.cuda.max_memory_allocated() - start)
        row["estimate_peak"] = estimate_memory(config, settings).peak_bytes
    return row


def varlen_case(dry_run: bool, steps: int = 3) -> list[dict[str, Any]]:
    """Packed rows through the trainer's step, masked (transformers' SDPA: a dense block mask from the position_ids)
    and varlen (fulltune/attention.py): tokens/s of `steps` optimizer steps after one warm-up step, and the peak
    allocated against the estimate of each. A variant that runs out of memory is reported as such."""
    import torch

    device = "cpu" if dry_run else "cuda"
    config = _llama(64, 176, 3, 8, 2, 300) if dry_run else _llama(2048, 8192, 16, 32, 8, 128256, tied=True)
    lengths, document = ((256, 512), 64) if dry_run else ((8192, 32768), 1024)
    rows = []
    for seq in lengths:
        # Packed rows of `document`-token documents (trace.make_batch builds them and their `documents`).
        packed = Settings(micro_batch_size=1, seq_len=seq, gradient_checkpointing=config.num_hidden_layers,
                          mixed_precision="bf16", chunked_loss=True, device=device, attention_mask=False,
                          document_length=document)
        for kind in ("masked", "varlen"):
            planned = replace(packed, attention_mask=True) if kind == "masked" else packed
            row: dict[str, Any] = {"name": f"{kind} {seq}", "settings": planned.to_dict(),
                                   "estimate_peak": estimate_memory(config, planned).peak_bytes}
            row.update(safely(row["name"], _packed_steps, config, packed, kind, steps))
            rows.append(row)
            print(f"[varlen] {row['name']}: done", file=sys.stderr, flush=True)
    return rows


def _packed_steps(config: Any, settings: Settings, kind: str, steps: int) -> dict[str, Any]:
    import torch

    cuda = settings.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    # masked: transformers' own SDPA, which ignores `documents` and masks by the restarting position_ids.
    seconds = timed_steps(config, settings, steps, "sdpa" if kind == "masked" else None)
    row = {"tokens_per_second": steps * settings.micro_batch_size * settings.seq_len / seconds}
    if cuda:
        row["measured_allocated"] = int(torch.cuda.max_memory_allocated() - start)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'case':32s} {'estimate':>10s} {'trace':>10s} {'allocated':>10s} {'est err':>8s} {'trace err':>9s} "
            f"{'device est':>10s} {'reserved':>10s} {'dev err':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:32s} FAILED: {r['error']}")
            continue
        lines.append(
            f"{r['name']:32s} {format_bytes(r['estimate_peak']):>10s} {format_bytes(r.get('trace_peak')):>10s} "
            f"{format_bytes(r['measured_allocated']):>10s} {pct(r['estimate_error']):>8s} "
            f"{pct(r.get('trace_error')):>9s} {format_bytes(r['estimate_device']):>10s} "
            f"{format_bytes(r['measured_reserved']):>10s} {pct(r.get('device_error')):>8s}")
    return "\n".join(lines)


def run(dry_run: bool, peak_tflops: float | None, mfu_steps: int, offload_steps: int = 2) -> dict[str, Any]:
    import torch

    on_gpu = torch.cuda.is_available() and not dry_run
    if not on_gpu and not dry_run:
        raise SystemExit("no CUDA GPU visible: run with --dry-run to check the script on CPU")
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    report: dict[str, Any] = {"device": name, "dry_run": dry_run, "torch": torch.__version__,
                              "transformers": transformers.__version__, "memory": []}
    for case in cases(dry_run):
        report["memory"].append({"name": case.name, **safely(case.name, memory_case, case, on_gpu)})
        print(f"[memory] {case.name}: done", file=sys.stderr, flush=True)
    device = "cuda" if on_gpu else "cpu"
    if dry_run:
        config, seq, micro = _llama(64, 176, 3, 8, 2, 300), 64, 2
    else:
        config, seq, micro = _llama(2048, 5632, 22, 32, 4, 32000), 2048, 4
    mfu_settings = Settings(micro_batch_size=micro, seq_len=seq, mixed_precision="bf16", device=device,
                            attention_mask=False)
    report["mfu"] = safely("mfu", mfu_case, config, mfu_settings, mfu_steps, _peak_flops(name, peak_tflops))
    print("[mfu] done", file=sys.stderr, flush=True)
    fp16_settings = Settings(micro_batch_size=micro, seq_len=seq, mixed_precision="fp16", device=device,
                             attention_mask=False)
    report["fp16_loss_scaling"] = safely("fp16", fp16_case, config, fp16_settings, 4, 1)
    print("[fp16] done", file=sys.stderr, flush=True)
    report["fsdp_offload"] = safely("fsdp_offload", fsdp_offload_case, dry_run, offload_steps)
    print("[fsdp offload] done", file=sys.stderr, flush=True)
    from benchmarks.eval_memory import device_case  # the 8B plan's evaluate stage, 4 layers

    report["evaluation"] = safely("evaluation", device_case, dry_run)
    print("[evaluation] done", file=sys.stderr, flush=True)
    report["varlen"] = varlen_case(dry_run)
    report["context_parallel"] = safely("context_parallel", context_parallel_case, on_gpu)
    print("[context parallel] done", file=sys.stderr, flush=True)
    from benchmarks.autotune import gpu_check  # the plan's top candidates measured in training children

    # The dry run measures two candidates (each a training child): enough to check the comparison's wiring.
    report["autotune"] = safely("autotune", gpu_check, dry_run, candidates=2 if dry_run else 3)
    print("[autotune] done", file=sys.stderr, flush=True)
    from benchmarks.float8_check import float8_case  # bf16 against float8 with the same plan: speed and peak

    report["float8"] = float8_case(dry_run)
    print("[float8] done", file=sys.stderr, flush=True)
    return report


def context_parallel_case(on_gpu: bool) -> dict[str, Any]:
    """Context parallel 2 against one process (tests/context_parallel_worker.py): on 2 GPUs over NCCL, Ulysses and
    ring attention; without a GPU (--dry-run) Ulysses over gloo. {case: {"loss", "grads"}: relative differences}."""
    import subprocess
    import tempfile

    import torch

    if on_gpu and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, {torch.cuda.device_count()} visible"}
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "context_parallel.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   str(root / "tests" / "context_parallel_worker.py"), str(out), *(["--cuda"] if on_gpu else [])]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(root)})
        if done.returncode != 0:
            return {"error": done.stderr[-3000:]}
        return json.loads(out.read_text())


def summary(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device']} (torch {report['torch']}, transformers {report['transformers']})",
             table(report["memory"])]
    mfu = report["mfu"]
    if "error" in mfu:
        lines.append(f"MFU: FAILED: {mfu['error']}")
    else:
        lines.append(f"MFU: {mfu['mfu']:.1%} ({mfu['tokens_per_second']:.0f} tokens/s, "
                     f"{mfu['model_flops_per_second'] / 1e12:.3g} of {mfu['peak_flops'] / 1e12:.3g} TFLOP/s)")
    fp16 = report["fp16_loss_scaling"]
    if "error" in fp16:
        lines.append(f"fp16 + GradScaler: FAILED: {fp16['error']}")
    else:
        scales = " → ".join(f"{r['scale_after']:g}" if r["scale_after"] is not None else "-" for r in fp16["steps"])
        memory = ""
        if "measured_allocated" in fp16:
            memory = (f"; peak {format_bytes(fp16['measured_allocated'])} vs estimate "
                      f"{format_bytes(fp16['estimate_peak'])}")
        lines.append(f"fp16 + GradScaler: overflow skipped and recovered: {fp16['overflow_step_skipped_and_recovered']}"
                     f" (scale {scales}){memory}")
    lines.extend(host_param_lines(report.get("fsdp_offload") or {}))
    for row in report.get("varlen", []):
        if "error" in row:
            lines.append(f"packed rows, {row['name']}: FAILED: {row['error']}")
            continue
        measured = row.get("measured_allocated")
        memory = (f"; peak {format_bytes(measured)} vs estimate {format_bytes(row['estimate_peak'])} "
                  f"({pct(row['estimate_peak'] / measured - 1)})" if measured else "")
        lines.append(f"packed rows, {row['name']}: {row['tokens_per_second']:.0f} tokens/s{memory}")
    lines.append(f"context parallel 2 against one process (relative differences): {report.get('context_parallel')}")
    from benchmarks.float8_check import float8_lines

    lines.extend(float8_lines(report.get("float8") or {}))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON report")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--mfu-steps", type=int, default=5)
    parser.add_argument("--offload-steps", type=int, default=2,
                        help="timed steps of each host-parameter variant, after one warm-up step")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run(args.dry_run, args.peak_tflops, args.mfu_steps, args.offload_steps)
    print(summary(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
