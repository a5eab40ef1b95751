"""Per-process peak host memory of loading a model under FSDP: load whole then shard, against sharded loading.

`distributed.strategy: fsdp` used to load the whole fp32 model in every process (`load_model`) and only
then shard it (`shard_model`): N processes on one host held N full copies at once. `load_sharded_model`
builds the model on the meta device, shards it and reads each process's shards from the safetensors
files, so a process holds its 1/N of the weights (plus one tensor's slice being read).

A ~100M-parameter Llama (hidden 768, 8 layers, vocabulary 32000, untied head: 99M parameters) is built
from a config, saved in bf16 as hub checkpoints are (safetensors, 190 MiB) into a temporary directory and
loaded by 2 processes under torchrun (gloo, CPU) both ways, into fp32 masters (380 MiB in all). Each
process reports its resident set size before loading (interpreter, torch, transformers, accelerate and
the Llama modeling code imported, process group up) and its peak (`getrusage(RUSAGE_SELF).ru_maxrss`) once the sharded model is ready; the
difference is what loading cost it. Each way runs in fresh processes, so one cannot lower the other's peak.

Usage:
    python -m benchmarks.sharded_load [--json sharded_load.json] [--layers 8]   # each process on one thread
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from pathlib import Path

from benchmarks.ranks import add_worker_arguments, send_to_driver, torchrun_ranks

WAYS = ("whole-then-shard", "sharded")
MIB = 2**20


def _rss_mib() -> float:
    """Current resident set size (Linux /proc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def save_checkpoint(directory: Path, layers: int) -> int:
    """The benchmark's Llama, seeded, saved in bf16; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def worker(checkpoint: Path, way: str, out: Path) -> None:
    """One torchrun process: load `checkpoint` into FSDP2 shards `way` ("whole-then-shard" or "sharded")."""
    import torch.distributed as dist

    from fulltune.runtime import sharding
    from fulltune.models import load_model

    # What both ways import, imported before the baseline: loading is what is measured, not imports.
    import accelerate  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    sharding.init_process_group("cpu")
    dist.barrier()
    before = _rss_mib()
    if way == "sharded":
        model = sharding.load_sharded_model(checkpoint, device="cpu", mixed_precision="bf16")
    else:
        model = load_model(str(checkpoint))
        sharding.shard_model(model, device="cpu", mixed_precision="bf16")
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    peak, after = _peak_mib(), _rss_mib()
    dist.barrier()
    send_to_driver({"rank": dist.get_rank(), "before_mib": before, "peak_mib": peak, "after_mib": after,
                    "local_shards_mib": local / MIB, "dtype": str(next(model.parameters()).dtype)}, out)


def measure(checkpoint: Path, way: str, processes: int) -> list[dict]:
    """Every process's record of loading `checkpoint` `way`, in fresh torchrun processes."""
    return torchrun_ranks("benchmarks.sharded_load", way, processes, "--checkpoint", str(checkpoint))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", type=Path)
    add_worker_arguments(parser, WAYS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.checkpoint, args.worker, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="sharded-load-") as tmp:
        checkpoint = Path(tmp) / "model"
        parameters = save_checkpoint(checkpoint, args.layers)
        size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / MIB
        results = {way: measure(checkpoint, way, args.processes) for way in WAYS}
    print(f"{parameters / 1e6:.0f}M parameters, bf16 checkpoint {size:.0f} MiB, fp32 model {4 * parameters / MIB:.0f} MiB, "
          f"{args.processes} processes")
    print(f"{'way':<18}{'rank':>5}{'RSS before':>12}{'peak RSS':>10}{'loading cost':>14}{'own shards':>12}")
    for way, records in results.items():
        for r in records:
            print(f"{way:<18}{r['rank']:>5}{r['before_mib']:>10.0f} M{r['peak_mib']:>8.0f} M"
                  f"{r['peak_mib'] - r['before_mib']:>12.0f} M{r['local_shards_mib']:>10.0f} M")
    if args.json:
        args.json.write_text(json.dumps({"parameters": parameters, "checkpoint_mib": size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
