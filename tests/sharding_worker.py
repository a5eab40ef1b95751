"""A tiny training run the way fulltune's trainer drives FSDP2, for tests/test_sharding.py and
tests/test_sharded_load.py.

    python tests/sharding_worker.py OUT [options]                               # one process, unsharded
    torchrun --standalone --nproc_per_node 2 tests/sharding_worker.py OUT --shard   # two processes, FSDP2

A 2-layer Llama (hidden 64, `from_config`, seed 0) trains on fixed rows: every optimizer step takes the
next `ROWS_PER_STEP` rows whatever the split into processes and micro-batches (the trainer's
StepSchedule.micro_batch slicing), through the engine's one training step (`fulltune.runtime.step.run_step`: TargetHead,
Σ token losses / the step's target tokens, Accelerate's `backward` / `accumulate` / `reduce`, clipping and the
optimizer step) on a model Accelerate does not prepare.
With --load DIR it starts from a saved checkpoint instead: under --shard loaded whole and then sharded
(`load_model` + `shard_model`), or with --sharded-load straight into shards (`load_sharded_model`).
--pure-bf16 and --optimizer train with fulltune's optimizer builder (fulltune/runtime/optim.py) as the trainer does.
With --shard --rewind-at K the run saves model and optimizer (`sharding.save_sharded_state`) before step K,
takes step K, loads the saved state back (`load_sharded_state`) and takes step K again: a checkpoint
round trip that restores everything gives the losses of a run without it.

OUT/result.json (rank 0): {"losses": [mean token loss per step], "grad_norms": [...],
                           "weights": {"parameter": dtype, "sharded": DTensor?, "optimizer": its module}}
OUT/model/: the final weights as a normal Hugging Face checkpoint (`fulltune.runtime.sharding.save_pretrained`).
OUT/loaded/: with --export-loaded, the weights as loaded, before any step.

`OUT [options] --then OUT2 [options2] ...` runs one after another in the same processes (one torchrun start
instead of several: a start costs each process its imports, ~5 CPU-s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ROWS_PER_STEP = 4
SEQ_LEN = 16
VOCAB = 128


def tiny_config(tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def fixed_rows(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels of every row: 8 random sequences in a fixed shuffled order, so the loss falls;
    each row's first few positions have no target (a prompt)."""
    generator = torch.Generator().manual_seed(1234)
    rows = steps * ROWS_PER_STEP
    pool = torch.randint(0, VOCAB, (8, SEQ_LEN), generator=generator)
    input_ids = pool[torch.randint(0, len(pool), (rows,), generator=generator)]
    labels = input_ids.clone()
    prompt = torch.randint(1, SEQ_LEN // 2, (rows,), generator=generator)
    labels[torch.arange(SEQ_LEN).expand(rows, SEQ_LEN) < prompt[:, None]] = -100
    return input_ids, labels


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro", type=int, default=1, help="rows per micro-batch per process")
    parser.add_argument("--shard", action="store_true", help="FSDP2 via fulltune.runtime.sharding")
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16"))
    parser.add_argument("--load", type=Path, help="start from this Hugging Face checkpoint instead of from_config")
    parser.add_argument("--sharded-load", action="store_true",
                        help="with --shard --load: sharding.load_sharded_model (else load_model, then shard_model)")
    parser.add_argument("--export-loaded", action="store_true", help="also write the weights as loaded to OUT/loaded/")
    parser.add_argument("--pure-bf16", action="store_true", help="bf16 weights and gradients, no fp32 master")
    parser.add_argument("--optimizer", choices=("adamw", "adafactor", "muon"),
                        help="fulltune.runtime.optim.build_optimizer (pure bf16 adamw: Kahan); default torch AdamW")
    parser.add_argument("--rewind-at", type=int, help="with --shard: save before this step, take it, load, take it again")
    parser.add_argument("--tied", action="store_true", help="tie the output head to the input embedding")
    parser.add_argument("--chunked-loss", action="store_true", help="the chunked head (train.chunked_loss)")
    parser.add_argument("--vocab-chunk", type=int, default=48,
                        help="vocabulary tile of the chunked head (smaller than the vocabulary: several tiles)")
    parser.add_argument("--in-backward", action="store_true",
                        help="step each parameter in backward (train.optimizer_in_backward; needs one micro-batch)")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, object]:
    """The model (sharded under --shard) and its TargetHead, as the trainer builds them: levers first
    (here: no cache, pure bf16 cast, the head's hook), then shards."""
    from transformers import AutoModelForCausalLM

    from fulltune.runtime import sharding
    from fulltune.runtime.loss import TargetHead
    from fulltune.models import load_model

    heads = []

    def levers(model: torch.nn.Module) -> None:
        model.config.use_cache = False
        if args.pure_bf16:
            model.to(torch.bfloat16)
        heads.append(TargetHead(model, chunked=args.chunked_loss, vocab_chunk=args.vocab_chunk))

    if args.shard and args.sharded_load:
        model = sharding.load_sharded_model(args.load, device="cpu", mixed_precision=args.mixed_precision,
                                            before_shard=levers, allow_pickle_weights=True)
        return model, heads[0]
    torch.manual_seed(0)
    model = load_model(str(args.load), allow_pickle_weights=True) if args.load else AutoModelForCausalLM.from_config(tiny_config(args.tied))
    levers(model)
    if args.shard:
        sharding.shard_model(model, device="cpu", mixed_precision=args.mixed_precision)
    return model, heads[0]


def make_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    if args.optimizer is None and not args.in_backward:
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    from fulltune.runtime.optim import build_optimizer

    return build_optimizer(model, args.optimizer or "adamw", lr=3e-3, weight_decay=0.01, pure_bf16=args.pure_bf16,
                           optimizer_in_backward=args.in_backward, max_grad_norm=1.0 if args.in_backward else None)


def main(argv: list[str] | None = None) -> None:
    from accelerate.state import AcceleratorState

    argv = sys.argv[1:] if argv is None else argv
    runs: list[list[str]] = [[]]
    for argument in argv:
        if argument == "--then":
            runs.append([])
        else:
            runs[-1].append(argument)
    for index, run_argv in enumerate(runs):
        if index:
            AcceleratorState._reset_state(reset_partial_state=False)  # the next run's Accelerator, same processes
        accelerator = run(parse(run_argv))
    accelerator.end_training()


def run(args: argparse.Namespace):
    """One run of `args`; its Accelerator."""
    from accelerate import Accelerator

    from fulltune.runtime import sharding

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = ROWS_PER_STEP // (args.micro * processes)
    assert accumulation * args.micro * processes == ROWS_PER_STEP, "micro × processes must divide ROWS_PER_STEP"
    # As the trainer: Accelerate for the process group, backward, accumulate and reduce. Under FSDP the
    # model and optimizer stay out of prepare (it would wrap them in DDP); bf16 then comes from FSDP's
    # MixedPrecisionPolicy instead of autocast.
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=accumulation, step_scheduler_with_optimizer=False)
    model, head = build_model(args)
    if args.export_loaded:
        sharding.save_pretrained(model, args.out / "loaded")
    optimizer = make_optimizer(args, model)
    if not args.shard:
        model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    losses, norms = train(args, accelerator, model, head, optimizer, accumulation)
    parameter = next(p for p in model.parameters() if p.ndim == 2)
    dtypes = {"parameter": str(parameter.dtype), "sharded": type(parameter).__name__ == "DTensor",
              "optimizer": type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__module__}
    head.remove()
    sharding.save_pretrained(accelerator.unwrap_model(model), args.out / "model")
    if accelerator.is_main_process:
        result = {"losses": losses, "grad_norms": norms, "weights": dtypes}
        (args.out / "result.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    return accelerator


def train(args: argparse.Namespace, accelerator, model, head, optimizer, accumulation: int) -> tuple[list, list]:
    """`args.steps` optimizer steps; returns (mean token loss, gradient norm) of each."""
    from fulltune.runtime import sharding
    from fulltune.runtime.loss import Targets
    from fulltune.memory import Settings
    from fulltune.runtime.step import StepParts, run_step

    processes, rank = accelerator.num_processes, accelerator.process_index
    plan = Settings(micro_batch_size=args.micro, seq_len=SEQ_LEN, gradient_accumulation_steps=accumulation,
                    optimizer_in_backward=args.in_backward)
    parts = StepParts.assemble(accelerator, model, head, optimizer, plan)
    input_ids, labels = fixed_rows(args.steps)
    losses, norms = [], []
    # Step `rewind_at` runs twice; the first run is undone by loading what was saved before it.
    schedule = list(range(args.steps))
    rewind = args.shard and args.rewind_at is not None
    if rewind:
        schedule.insert(args.rewind_at, args.rewind_at)
    for index_in_schedule, step in enumerate(schedule):
        first_of_rewound = rewind and index_in_schedule == args.rewind_at
        if first_of_rewound:
            sharding.save_sharded_state(args.out / "rewind", model, optimizer)
        rows = torch.arange(step * ROWS_PER_STEP, (step + 1) * ROWS_PER_STEP)
        step_targets = int((labels[rows, 1:] != -100).sum())

        def micro_batches(rows: torch.Tensor = rows):
            for index in range(accumulation):
                start = (index * processes + rank) * args.micro
                mine = rows[start:start + args.micro]
                yield {"input_ids": input_ids[mine]}, Targets.from_labels(labels[mine])

        # The engine's one training step (fulltune/runtime/step.py), as the trainer runs it.
        outcome = run_step(parts, micro_batches(), step + 1, step_targets)
        step_loss, norm = outcome.loss_sum, outcome.grad_norm
        if first_of_rewound:
            sharding.load_sharded_state(args.out / "rewind", model, optimizer)
            continue
        losses.append(step_loss.float().item() / step_targets)
        norms.append(float(norm))
    return losses, norms


if __name__ == "__main__":
    main()
