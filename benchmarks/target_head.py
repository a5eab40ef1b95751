"""The output head at target positions only (fulltune/runtime/loss.py) against full logits: step time and peak memory.

    python -m benchmarks.target_head            # ~4 min on 2 CPU cores; prints a markdown section
    python -m benchmarks.target_head --write    # and replaces the section in BENCHMARKS.md

A full-logits loss (transformers' `ForCausalLMLoss`, used by `Trainer`) computes the (b, s, V) logits and
then ignores the positions without a target; fulltune gathers the target positions before the head.
How much that saves depends on the share of positions with a target (the completion's share of
prompt/completion rows, the assistant turns' share of chat rows):

1. Step time on CPU: forward + backward of one micro-batch, full logits + cross-entropy with
   ignore_index (the baseline) against `TargetHead.loss_sum`, same model, same batch, interleaved,
   median process CPU time over `--reps` repetitions. The model has the vocabulary-to-hidden ratio of
   current small LMs (V/h = 64, like Llama-3.2-1B's 128k/2048).
2. Peak memory of a training step of real model shapes (traced under FakeTensorMode with MemTracker,
   `fulltune.planning.simulate_memory`) and fulltune's analytic estimate, at target shares 100%, 50%, 25%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from fulltune.runtime.loss import TargetHead, Targets
from fulltune.memory import Settings, estimate_memory
from fulltune.planning import simulate_memory
from fulltune.memory.units import format_bytes
from benchmarks.sections import write_section

ROOT = Path(__file__).resolve().parents[1]

SECTION = "## Output head at target positions"
SHARES = (1.0, 0.5, 0.25)


def full_logits_step(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
    logits = model(input_ids=input_ids, use_cache=False).logits
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shifted.view(-1), ignore_index=-100,
                           reduction="sum")
    del logits
    loss.backward()


def time_steps(reps: int) -> list[dict]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    b, s = 4, 256
    input_ids = torch.randint(0, config.vocab_size, (b, s))
    rows = []
    for share in SHARES:
        labels = input_ids.clone()
        labels[:, : round((1 - share) * s)] = -100  # the prompt: no targets
        targets = Targets.from_labels(labels)
        head = TargetHead(model)  # outside loss_sum its hook does nothing: full_logits_step sees (b, s, V)

        def ours() -> None:
            head.loss_sum(model, {"input_ids": input_ids}, targets).backward()

        def full() -> None:
            full_logits_step(model, input_ids, labels)

        seconds: dict[str, list[float]] = {"full": [], "ours": []}
        for fn in (full, ours):
            fn()  # warm-up
        for _ in range(reps):
            for name, fn in (("full", full), ("ours", ours)):
                model.zero_grad(set_to_none=True)
                start = time.process_time()
                fn()
                seconds[name].append(time.process_time() - start)
        head.remove()
        full_s, ours_s = statistics.median(seconds["full"]), statistics.median(seconds["ours"])
        rows.append({"share": share, "targets": len(targets), "full_s": full_s, "ours_s": ours_s})
        print(f"time: {share:.0%} targets: full {full_s * 1e3:.1f} ms, target head {ours_s * 1e3:.1f} ms "
              f"({full_s / ours_s:.2f}×)", file=sys.stderr, flush=True)
    return rows


SHAPES = {
    "Llama-3.2-1B shape": transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=4096),
    "Qwen2-0.5B shape": transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096),
}


def memory_rows() -> list[dict]:
    rows = []
    for name, config in SHAPES.items():
        settings = Settings(micro_batch_size=2, seq_len=2048, mixed_precision="bf16",
                            gradient_checkpointing=config.num_hidden_layers, attention_mask=False)
        for share in SHARES:
            s = replace(settings, target_fraction=share)
            traced = simulate_memory(config, s).peak_bytes
            estimated = estimate_memory(config, s).peak_bytes
            rows.append({"model": name, "share": share, "traced": traced, "estimate": estimated})
            print(f"memory: {name} {share:.0%} targets: traced {format_bytes(traced)}, estimate "
                  f"{format_bytes(estimated)}", file=sys.stderr, flush=True)
    return rows


def section(times: list[dict], memory: list[dict], reps: int, seconds: float) -> str:
    lines = [
        SECTION,
        "",
        "fulltune runs the output head only at positions with a target (`fulltune/runtime/loss.py`); a full-logits loss",
        "(transformers' `ForCausalLMLoss`, what `Trainer` computes) makes (b, s, V) logits and ignores the positions",
        "without one. Same gradients; the saving is the share of positions without a target (prompts, user turns).",
        "",
        f"Reproduce: `python -m benchmarks.target_head` (took {seconds / 60:.1f} min; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, CPU, {torch.get_num_threads()} thread(s)).",
        "",
        "Step time, forward + backward of one micro-batch (4 × 256 tokens, 2-layer Llama, hidden 256, vocabulary",
        f"16,384: the V/h ratio of Llama-3.2-1B), median CPU time of {reps} interleaved repetitions:",
        "",
        "| positions with a target | full logits | target positions only | speed-up |",
        "|---|---|---|---|",
    ]
    for r in times:
        lines.append(f"| {r['share']:.0%} ({r['targets']}) | {r['full_s'] * 1e3:.1f} ms | {r['ours_s'] * 1e3:.1f} ms "
                     f"| {r['full_s'] / r['ours_s']:.2f}× |")
    lines += [
        "",
        "Peak memory of one training step (micro-batch 2 × 2,048 tokens, bf16 autocast, every layer checkpointed,",
        "AdamW), traced under FakeTensorMode with MemTracker, and fulltune's estimate of it:",
        "",
        "| model | positions with a target | traced peak | estimate | vs 100% |",
        "|---|---|---|---|---|",
    ]
    for r in memory:
        full = next(m["traced"] for m in memory if m["model"] == r["model"] and m["share"] == 1.0)
        lines.append(f"| {r['model']} | {r['share']:.0%} | {format_bytes(r['traced'])} | {format_bytes(r['estimate'])} "
                     f"| {r['traced'] / full - 1:+.0%} |")
    lines += [
        "",
        "At 100% the head runs on every position but each row's last, which is what a full-logits loss computes,",
        "so that row is the full-logits baseline. The planner budgets for the most positions with a target that one",
        "row of the data holds (recorded by the tokenize stage), so prompt-heavy data plans with smaller logits",
        "(tests/test_memory.py: micro-batch 2 → 8 under the same budget at 25%). Where weights, gradients and AdamW",
        "states (16 B/parameter) set the peak, as for the 1.2B-parameter Llama shape here once its logits shrink,",
        "the peak moves to the end of the backward pass and little is saved.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per variant (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--write", action="store_true", help="replace the section in BENCHMARKS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    times = time_steps(args.reps)
    memory = memory_rows()
    text = section(times, memory, args.reps, time.perf_counter() - started)
    print(text)
    if args.write:
        write_section(ROOT / "BENCHMARKS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
