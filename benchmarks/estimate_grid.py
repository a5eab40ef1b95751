"""Every number of every phase of the memory model's estimates over a large grid, dumped to JSON and compared.

The grid crosses the layouts (one process, DDP, FSDP over 1/2/4/8 processes, FSDP x TP, context parallel
over FSDP and DDP, and pipeline stages under both schedules) with every combination of the five levers that the
lever table allows,
the precisions, optimizers, devices, accumulation and checkpointing, over model shapes of the three modelled
layouts (tied and untied, grouped-query and one key/value head, one with the widths of Llama-3-8B); micro-batch,
sequence length, attention mask, attention kernel and target fraction rotate through their values across the
grid so each is seen with every layout. Settings the lever table or the model refuse are recorded with their
message, so a refusal that appears or disappears is a difference too.

For each estimate it dumps `estimate_memory`'s whole result and every phase of the step's walk (name, total,
parts); for each pipeline, `estimate_pipeline`'s every stage. Run it on two trees and compare:

    git archive <base> fulltune | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python benchmarks/estimate_grid.py --out /tmp/grid_base.json
    PYTHONPATH=. python benchmarks/estimate_grid.py --out /tmp/grid_new.json
    python benchmarks/estimate_grid.py --compare /tmp/grid_base.json /tmp/grid_new.json
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from collections import defaultdict
from typing import Any

LEVERS = ("chunked_loss", "pure_bf16", "optimizer_in_backward", "offload_activations", "offload_optimizer")
# (strategy, num_processes, tensor_parallel) of one process's step; pipelines are (stages, schedule).
LAYOUTS = (("none", 1, 1), ("ddp", 2, 1), ("ddp", 4, 1), ("fsdp", 1, 1), ("fsdp", 2, 1), ("fsdp", 4, 1), ("fsdp", 8, 1), ("fsdp", 2, 2), ("fsdp", 4, 2), ("fsdp", 8, 2),
           ("fsdp", 4, 4))
PIPELINES = ((2, "1f1b"), (2, "gpipe"), (4, "1f1b"), (3, "gpipe"))
# (strategy, num_processes, tensor_parallel, context_parallel): context parallel over FSDP (sharded over dp × cp)
# and DDP. Their keys name `context_parallel`; the other layouts' keys do not (dumps of trees before it compare).
CONTEXT_PARALLEL = (("fsdp", 2, 1, 2), ("fsdp", 4, 1, 2), ("fsdp", 8, 1, 4), ("ddp", 2, 1, 2))
PRECISIONS = ("no", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adafactor", "adamw_8bit")
DEVICES = ("cpu", "cuda")
ROTATING = {  # (micro_batch_size, seq_len, attention_mask, attn_implementation, target_fraction)
    "micro_batch_size": (1, 2, 3),
    "seq_len": (64, 129, 256),
    "attention_mask": (True, False),
    "attn_implementation": ("sdpa", "eager", "sdpa"),
    "target_fraction": (1.0, 0.5),
}


def shapes() -> dict[str, Any]:
    """The model shapes of the grid, by name."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    from fulltune.memory.shapes import model_shape

    configs = {
        "llama-untied-gqa": LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=688, vocab_size=8192,
                                        tie_word_embeddings=False),
        "qwen2-tied-mqa": Qwen2Config(num_hidden_layers=3, hidden_size=128, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=344, vocab_size=5003,
                                      tie_word_embeddings=True),
        "llama-kv1": LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                                 intermediate_size=256, vocab_size=32000, tie_word_embeddings=True),
        "gpt2": GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=3000, n_positions=512,
                           bos_token_id=0, eos_token_id=0),
        "neox": GPTNeoXConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                              vocab_size=4096, tie_word_embeddings=False),
        "llama3-8b-widths": LlamaConfig(num_hidden_layers=8, hidden_size=4096, num_attention_heads=32,
                                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                 tie_word_embeddings=False),
    }
    return {name: model_shape(config) for name, config in configs.items()}


def _rotating(i: int) -> dict[str, Any]:
    return {key: values[i % len(values)] for key, values in ROTATING.items()}


def _settings(fields: dict[str, Any]) -> tuple[Any, str | None]:
    from fulltune.memory.errors import MemoryConfigError
    from fulltune.memory.types import Settings

    try:
        return Settings(**fields), None
    except MemoryConfigError as e:
        return None, f"refused: {e}"


def _estimate_record(shape: Any, settings: Any) -> dict[str, Any]:
    from fulltune.memory.errors import MemoryConfigError
    from fulltune.memory.estimate import _estimate

    timeline: list = []
    try:
        e = _estimate(shape, settings, timeline)
    except MemoryConfigError as error:
        return {"error": str(error)}
    return {"peak_bytes": e.peak_bytes, "device_bytes": e.device_bytes, "breakdown": e.breakdown,
            "peak_phase": e.peak_phase, "notes": list(e.notes), "host_bytes": e.host_bytes,
            "step_device_bytes": e.step_device_bytes, "phases": e.phases, "process_peak_phase": e.process_peak_phase,
            "timeline": [[name, int(total), {k: int(v) for k, v in parts.items()}] for name, total, parts in timeline]}


def _pipeline_record(shape: Any, settings: Any, stages: int, schedule: str) -> dict[str, Any]:
    from fulltune.memory.errors import MemoryConfigError
    from fulltune.planning.pipeline import estimate_pipeline

    try:
        return estimate_pipeline(shape, settings, stages, schedule).to_dict()
    except MemoryConfigError as error:
        return {"error": str(error)}


def grid() -> dict[str, dict[str, Any]]:
    """Every estimate of the grid, by a key naming its shape and settings."""
    out: dict[str, dict[str, Any]] = {}
    i = j = 0
    for name, shape in shapes().items():
        L = shape.num_layers
        for layout, on, precision, optimizer, device, accumulation, checkpointing in itertools.product(
                LAYOUTS + PIPELINES + CONTEXT_PARALLEL, itertools.product((False, True), repeat=len(LEVERS)),
                PRECISIONS, OPTIMIZERS, DEVICES, (1, 2, 4), (0, L // 2, L)):
            added = len(layout) == 4  # counted apart: the other layouts' rotating values stay as they were
            j, i = (j + 1, i) if added else (j, i + 1)
            pipeline = len(layout) == 2
            strategy, n, T = ("none", 1, 1) if pipeline else layout[:3]
            fields = {"mixed_precision": precision, "optimizer": optimizer, "device": device,
                      "gradient_accumulation_steps": accumulation, "gradient_checkpointing": checkpointing,
                      "strategy": strategy, "num_processes": n, "tensor_parallel": T,
                      **({"context_parallel": layout[3]} if added else {}),
                      **dict(zip(LEVERS, on)), **_rotating(j if added else i)}
            settings, refused = _settings(fields)
            key = json.dumps({"shape": name, "layout": list(layout), **fields}, sort_keys=True)
            if refused:
                out[key] = {"error": refused}
            elif pipeline:
                out[key] = _pipeline_record(shape, settings, *layout)
            else:
                out[key] = _estimate_record(shape, settings)
    return out


def compare(base_path: str, new_path: str) -> int:
    """Print how many estimates are byte-identical and, for the others, per layout and device: how many differ,
    the levers on in every one of them, and the range of the relative change of the step's (or the worst
    stage's) peak; 0 when all are identical."""
    base, new = _load(base_path), _load(new_path)
    if base.keys() - new.keys():
        print(f"the grids differ: {len(base.keys() - new.keys())} keys only in the base")
        return 1
    if new.keys() - base.keys():  # layouts the base's tree did not have (compared: the ones it had)
        print(f"{len(new.keys() - base.keys())} settings only in the new grid (layouts added since the base)")
        new = {key: new[key] for key in base}
    valid = sum(1 for v in base.values() if "error" not in v)
    differing = [k for k in base if base[k] != new[k]]
    print(f"{len(base) - len(differing)} of {len(base)} identical ({valid} estimates, {len(base) - valid} refusals)")
    groups: dict[str, list[tuple[set[str], float]]] = defaultdict(list)
    for k in differing:
        fields, before, after = json.loads(k), base[k], new[k]
        peak = "peak_bytes" if "peak_bytes" in before else "device_bytes"
        if peak not in before or peak not in after:
            print(f"  {k}: {before.get('error')} -> {after.get('error')}")
            continue
        on = {lever for lever in LEVERS if fields[lever]}
        groups[f"layout {fields['layout']} on {fields['device']}"].append(
            (on, after[peak] / before[peak] - 1))
    for group, rows in sorted(groups.items()):
        always = set.intersection(*(on for on, _ in rows))
        changes = [change for _, change in rows]
        print(f"  {group}: {len(rows)} differ (levers on in all: {', '.join(sorted(always)) or 'none'}), peak "
              f"{min(changes):+.4%} .. {max(changes):+.4%}, moved in {sum(1 for c in changes if c)}")
    return 0 if not differing else 1


def _load(path: str) -> dict[str, Any]:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the grid's estimates to this JSON file (.gz: compressed)")
    parser.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="compare two dumps")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    out = grid()
    valid = sum(1 for v in out.values() if "error" not in v)
    with gzip.open(args.out, "wt") if args.out.endswith(".gz") else open(args.out, "w") as f:
        json.dump(out, f, sort_keys=True)
    print(f"{len(out)} settings, {valid} estimates, {len(out) - valid} refused -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
