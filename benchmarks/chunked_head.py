"""The chunked head's tiles: `estimate_memory` against the real step under MemTracker (`measure_memory`) where
the head is the step's peak: one decoder layer of hidden 64–256, vocabularies that make one tile, one and a bit,
three vocabulary slices and two row tiles, fp32, bf16 autocast and pure bf16.

    python -m benchmarks.chunked_head        # ~2 min on 2 cores; prints a Markdown table
"""

from __future__ import annotations

import argparse
import statistics

from fulltune.memory import Settings, estimate_memory
from fulltune.memory.head import ROW_CHUNK, VOCAB_CHUNK
from fulltune.planning import measure_memory

# (vocabulary, sequence, micro-batch, hidden, accumulation): the head's targets are micro-batch × (sequence − 1).
SHAPES = [
    (4096, 128, 2, 64, 2),  # one tile
    (8193, 128, 2, 64, 2),  # a whole vocabulary slice and one of a single entry
    (20000, 128, 2, 64, 2),  # three vocabulary slices
    (50000, 300, 1, 64, 2),  # seven vocabulary slices
    (4096, 2100, 2, 64, 2),  # a whole row tile and a short one
    (10000, 4200, 2, 64, 1),  # two whole row tiles and a short one, two vocabulary slices
    (12000, 512, 2, 256, 2),
]
PRECISIONS = {"fp32": {"mixed_precision": "no"}, "bf16": {"mixed_precision": "bf16"},
              "pure bf16": {"mixed_precision": "bf16", "pure_bf16": True}}


def case(vocab: int, seq: int, micro: int, hidden: int, accumulation: int, precision: str) -> dict:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    settings = Settings(micro_batch_size=micro, seq_len=seq, gradient_accumulation_steps=accumulation,
                        chunked_loss=True, **PRECISIONS[precision])
    estimate = estimate_memory(config, settings)
    measured = measure_memory(config, settings, steps=1 if accumulation == 1 else 2)
    targets = micro * (seq - 1)
    return {"vocab": vocab, "targets": targets, "hidden": hidden, "precision": precision,
            "tiles": f"{-(-targets // ROW_CHUNK)} × {-(-vocab // VOCAB_CHUNK)}",
            "estimate": estimate.peak_bytes, "measured": measured, "phase": estimate.peak_phase,
            "error": estimate.peak_bytes / measured - 1}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    rows = [case(*shape, precision) for shape in SHAPES for precision in PRECISIONS]
    print("| vocabulary | targets | hidden | row × vocabulary tiles | precision | estimate MiB | measured MiB | error | "
          "peak during (estimate) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab']} | {r['targets']} | {r['hidden']} | {r['tiles']} | {r['precision']} | "
              f"{r['estimate'] / 2**20:.2f} | {r['measured'] / 2**20:.2f} | {r['error']:+.2%} | {r['phase']} |")
    errors = [r["error"] for r in rows]
    print(f"\nmedian |error| {statistics.median(abs(e) for e in errors):.2%}, from {min(errors):+.2%} to "
          f"{max(errors):+.2%} over {len(rows)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
