"""Host memory of the final FSDP export against the plan's figure (memory/process.py `export_host_bytes`).

Run under torchrun (2 CPU processes, gloo): a 31M-parameter Llama (fp32, vocabulary 8000, 8 layers) is sharded
with FSDP2 (`fulltune.runtime.sharding.shard_model`; the measured rank is `measuring.rank_memory.export_rank`,
which tests/test_sharding.py runs too) and exported with `sharding.save_pretrained`, which streams one
safetensors file at a time (`--shard-mib`, as `EXPORT_SHARD_BYTES` does at 2 GiB). A sampler thread on rank 0
reads its resident set every 2 ms; what the export adds above the RSS before it is printed beside the plan's
figure for rank 0 (one file's tensors, or the largest tensor, and a CPU all-gather's buffers) and beside the
whole model, which rank 0
gathered before the export streamed (`get_model_state_dict(full_state_dict=True)`, measured the same way
with `--whole`).

Usage:
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/export_memory.py OUT
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/export_memory.py OUT --whole
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPE = dict(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    import torch

    from fulltune.memory import Settings
    from measuring.rank_memory import export_rank

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shard-mib", type=int, default=16, help="the export's file size (EXPORT_SHARD_BYTES)")
    parser.add_argument("--whole", action="store_true", help="gather the whole state dict on rank 0 instead")
    args = parser.parse_args(argv)
    from fulltune.runtime import allocator

    allocator.return_large_blocks()  # as `python -m fulltune.runtime.train` does on CPU
    settings = Settings(micro_batch_size=1, seq_len=1, strategy="fsdp", num_processes=2, device="cpu")
    result = export_rank(SHAPE, settings, args.out, args.shard_mib * 2**20, args.whole)
    if torch.distributed.get_rank() == 0:
        (args.out / ("whole.json" if args.whole else "export.json")).write_text(json.dumps(result))
        print(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
