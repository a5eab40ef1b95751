"""The largest Llama shape `fulltune plan` fits on one 24 / 48 / 80 GiB GPU, Llama-3-70B on 8×80 GiB, and the
largest on one machine of 8 × 24 / 40 / 48 / 80 GiB GPUs with FSDP (CPU offload allowed, 1 TiB host RAM): the
whole pipeline, training, the final export and the evaluate stage, each within its budget or the plan refuses.

Configs are built in code (no downloads): Llama-3 shapes with the 128k vocabulary, untied head, packed rows
without padding (no attention mask), seq 2048, effective batch 8, optimizer auto, every memory lever auto,
host RAM 256 GiB per machine. For each GPU size the table shows what the planner chose, the device bytes it
expects, the host RAM the levers need and its predicted step time (ranking model: fulltune/planning/step_time.py;
its lever constants, PCIe ~25 GB/s and host AdamW ~1.5 GB/s, are assumptions until measured on a GPU), the
host RAM of the final export (FSDP: rank 0's streamed files, memory/process.py) and the evaluate stage with
evaluate.*'s defaults (batch 8, 32 new tokens, rows of the training length; memory/evaluation.py): its dtype,
fitted loss / generation batches and device bytes, layer-offloaded where one GPU cannot hold the weights.

Long context (`--long-context`: that section alone): the Llama-3-8B shape with its positions extended (as
long-context variants such as Gradient's Llama-3-8B-1048k do), packed rows without padding, effective batch 8,
strategy, optimizer and `distributed.context_parallel` auto, on 8 × 80 GiB with 1 TiB of host RAM, at 131,072 and
524,288 tokens per example, evaluation included (held-out loss of rows of the training length; text rows: no
generation); then the longest row (doubling from 131,072) that fits 8 × 80 GiB, one 80 GiB GPU with 1 TiB of host
RAM, and the Llama-3-70B shape on 8 × 80 GiB.

Usage:
    python -m benchmarks.frontier_plan
    python -m benchmarks.frontier_plan --long-context
"""

from __future__ import annotations

import argparse

import transformers

from fulltune.memory import PlanRequest, format_bytes
from fulltune.memory.evaluation import EvalRequest
from fulltune.memory.process import node_host_bytes
from fulltune.memory.shapes import model_shape
from fulltune.memory.units import format_seconds
from fulltune.planning import plan_memory

GiB = 2**30
# name: (hidden, intermediate, layers, heads, kv heads) — Llama-3.2 1B/3B, Llama-3.1 8B, a 13B-class and
# a 34B-class Llama-3 shape (Llama 2's dimensions with the 128k vocabulary), Llama-3 70B.
SHAPES = {
    "1B": (2048, 8192, 16, 32, 8),
    "3B": (3072, 8192, 28, 24, 8),
    "8B": (4096, 14336, 32, 32, 8),
    "13B": (5120, 13824, 40, 40, 8),
    "34B": (8192, 22016, 48, 64, 8),
    "70B": (8192, 28672, 80, 64, 8),
}
HOST = 256 * GiB
EVALUATION = EvalRequest()  # evaluate.* defaults: batch 8, 32 new tokens, rows of the training length


def config(name: str) -> transformers.LlamaConfig:
    h, i, layers, heads, kv = SHAPES[name]
    return transformers.LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=kv, vocab_size=128256,
                                    tie_word_embeddings=name in ("1B", "3B"))


def describe(plan) -> str:
    s = plan.settings
    levers = [name for name, on in s.levers().items() if on]
    cp = f"cp {s.context_parallel}, " if s.context_parallel > 1 else ""
    return (f"{cp}micro {s.micro_batch_size}×{s.gradient_accumulation_steps}, ckpt {s.gradient_checkpointing}, "
            f"{s.optimizer}, {'+'.join(levers) or 'no levers'}")


def evaluation(plan) -> str:
    e = plan.evaluation
    where = "" if e["offload"] is None else f", {format_bytes(e['offload']['host_bytes'])} offloaded to host"
    if e.get("processes", 1) > 1:
        where += f", sharded over {e['processes']} (per GPU)"
    return (f"{e['dtype']}, batch {e['loss_batch']}/{e['generation_batch']}: {format_bytes(e['device_bytes'])}"
            f"{where}{'' if e['fits'] else ' (does not fit)'}")


def row(name: str, plan, config) -> str:  # noqa: ANN001 - a transformers config
    ranks = plan.settings.num_processes
    export = node_host_bytes(model_shape(config), plan.settings, 0, ranks)["export"]
    return (f"| {name} | {'fits' if plan.fits else 'no'} | {describe(plan)} | {format_bytes(plan.expected_bytes)} | "
            f"{format_bytes(plan.plan_estimate.host_bytes)} | {format_bytes(export)} | {evaluation(plan)} | "
            f"{format_seconds(plan.estimated_step_seconds)} |")


def single_gpu(budget_gib: int) -> list[str]:
    lines = []
    for name in SHAPES:
        request = PlanRequest(effective_batch_size=8, seq_len=2048, device="cuda", bf16_supported=True,
                              budget_bytes=budget_gib * GiB, attention_mask=False, host_memory_bytes=HOST,
                              evaluation=EVALUATION)
        plan = plan_memory(config(name), request)
        lines.append(row(f"{name} on 1×{budget_gib} GiB", plan, config(name)))
    return lines


CLUSTER_HOST = 1024 * GiB  # one 8-GPU machine with 1 TiB of RAM


def eight_gpus(budget_gib: int) -> tuple[str | None, list[str]]:
    """Every shape on one machine of 8 GPUs with FSDP (seq 4096 packed, effective batch 64, 1 TiB host RAM):
    the largest that fits and the table's rows."""
    largest, lines = None, []
    for name in SHAPES:
        request = PlanRequest(effective_batch_size=64, seq_len=4096, device="cuda", bf16_supported=True,
                              budget_bytes=budget_gib * GiB, attention_mask=False, strategy="fsdp",
                              num_processes=8, host_memory_bytes=CLUSTER_HOST, evaluation=EVALUATION)
        plan = plan_memory(config(name), request)
        largest = name if plan.fits else largest
        lines.append(row(f"{name} on 8×{budget_gib} GiB FSDP", plan, config(name)))
    return largest, lines


# Parameters in host RAM on one GPU (`distributed.strategy: auto`, seq 4096 packed, effective batch 64): Llama-3-70B
# on 80 GiB with 1 TiB of host RAM, and a 120B Llama shape (~116B parameters) on one 141 GiB H200 with 1.5 TiB
# (MegaTrain's record, arXiv 2604.05091).
HOST_PARAMETER_CASES = {
    "70B on 1×80 GiB, 1 TiB host": ((8192, 28672, 80, 64, 8), 80 * GiB, 1024 * GiB),
    "120B on 1×141 GiB, 1.5 TiB host": ((12288, 33792, 72, 96, 8), 141 * GiB, 1536 * GiB),
}


def host_parameter_rows() -> list[str]:
    """One GPU, strategy auto: what the planner chose, device and host bytes, predicted step time and tokens/s."""
    lines = []
    for name, ((h, i, layers, heads, kv), budget, host) in HOST_PARAMETER_CASES.items():
        shape = transformers.LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=128256)
        request = PlanRequest(effective_batch_size=64, seq_len=4096, device="cuda", bf16_supported=True,
                              budget_bytes=budget, attention_mask=False, strategy="auto", host_memory_bytes=host,
                              evaluation=EVALUATION)
        plan = plan_memory(shape, request)
        step = plan.host_step  # the plan's step terms: the wall time and tokens/s, without the ranking penalty
        lines.append(f"{row(name, plan, shape)} {plan.settings.strategy} | {format_seconds(step['wall_s'])} | "
                     f"{step['tokens_per_s']:.0f} |")
    return lines


def long_config(name: str) -> transformers.LlamaConfig:
    """A Llama-3 shape with its positions extended to 2M (the rotary base is not what the memory plan reads)."""
    h, i, layers, heads, kv = SHAPES[name]
    return transformers.LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=kv, vocab_size=128256,
                                    tie_word_embeddings=False, max_position_embeddings=1 << 21)


def long_plan(name: str, seq_len: int, processes: int) -> object:
    """The plan of `name` at rows of `seq_len` on `processes` × 80 GiB with 1 TiB of host RAM: effective batch 8,
    strategy, optimizer, levers and (several GPUs) context parallel auto, evaluation included."""
    request = PlanRequest(effective_batch_size=8, seq_len=seq_len, device="cuda", bf16_supported=True,
                          budget_bytes=80 * GiB, attention_mask=False, strategy="auto", num_processes=processes,
                          context_parallel=None if processes > 1 else 1, host_memory_bytes=CLUSTER_HOST,
                          evaluation=EvalRequest(generate=False))
    return plan_memory(long_config(name), request)


def longest(name: str, processes: int, start: int) -> tuple[int | None, object]:
    """The longest row (`start` doubled while it fits) of `name` on `processes` × 80 GiB, and its plan."""
    best, seq_len = (None, None), start
    while seq_len <= 1 << 21:
        plan = long_plan(name, seq_len, processes)
        if not plan.fits:
            break
        best, seq_len = (seq_len, plan), 2 * seq_len
    return best


def long_context() -> None:
    print("| model / GPUs, tokens per example | plan fits | chosen | device (expected) | host RAM | export host | "
          "evaluation | step (predicted) | context parallel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq_len in (131072, 524288):
        plan = long_plan("8B", seq_len, 8)
        reason = next((r for r in plan.reasons if r.startswith("context parallel ")), "")
        print(f"{row(f'8B (extended) on 8×80 GiB, {seq_len:,} tokens', plan, long_config('8B'))} {reason} |",
              flush=True)
    print()
    for name, processes, start in (("8B", 8, 131072), ("8B", 1, 16384), ("70B", 8, 8192)):
        seq_len, plan = longest(name, processes, start)
        where = f"{processes}×80 GiB" + (", 1 TiB host" if processes == 1 else "")
        print(f"longest row of the Llama-3-{name} shape on {where}: {seq_len:,} tokens" if seq_len else
              f"Llama-3-{name} on {where}: nothing fits from {start:,} tokens", flush=True)
        if plan is not None:
            print(f"  {row(f'{name} on {where}, {seq_len:,} tokens', plan, long_config(name))}", flush=True)
    print()
    print("Step-time terms that are assumptions (fulltune/planning/step_time.py): sustained bf16 matmul throughput "
          "(400 TFLOP/s per GPU), the context-parallel all-to-alls at 150 GB/s per GPU, not overlapped with "
          "compute (CP_BYTES_PER_S), FSDP's all-gathers and reduce-scatters not counted, PCIe at 25 GB/s and the "
          "host optimizer at 1.5 GB/s where a lever moves tensors to the host, the recompute overhead (1.4×) of "
          "checkpointed layers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-context", action="store_true", help="the long-context section alone")
    if parser.parse_args().long_context:
        long_context()
        return
    print("| model / GPU | plan fits | chosen | device (expected) | host RAM | export host | evaluation | "
          "step (predicted) |")
    print("|---|---|---|---|---|---|---|---|")
    for gib in (24, 48, 80):
        for line in single_gpu(gib):
            print(line, flush=True)
    request = PlanRequest(effective_batch_size=64, seq_len=4096, device="cuda", bf16_supported=True,
                          budget_bytes=80 * GiB, attention_mask=False, strategy="fsdp", num_processes=8,
                          host_memory_bytes=HOST, evaluation=EVALUATION)
    print(row("70B on 8×80 GiB FSDP (seq 4096, batch 64)", plan_memory(config("70B"), request), config("70B")))
    print()
    print("8 GPUs, FSDP, seq 4096 packed, effective batch 64, host RAM 1 TiB per machine "
          "(host RAM column: one machine's)")
    print()
    print("| model / cluster | plan fits | chosen | device per GPU (expected) | host RAM per machine | export host | "
          "evaluation | step (predicted) |")
    print("|---|---|---|---|---|---|---|---|")
    largest = {}
    for gib in (24, 40, 48, 80):
        largest[gib], lines = eight_gpus(gib)
        for line in lines:
            print(line, flush=True)
    print()
    for gib, name in largest.items():
        print(f"largest Llama-3 shape that fits 8×{gib} GiB: {name}")
    print()
    print("One GPU, distributed.strategy auto, seq 4096 packed, effective batch 64 (predictions)")
    print()
    print("| model / GPU | plan fits | chosen | device (expected) | host RAM | export host | evaluation | "
          "step (ranked) | strategy | step (wall, predicted) | tokens/s (predicted) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for line in host_parameter_rows():
        print(line, flush=True)


if __name__ == "__main__":
    main()
