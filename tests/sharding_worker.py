"""A tiny training run the way fulltune's trainer drives FSDP2, for tests/test_sharding.py.

    python tests/sharding_worker.py OUT [options]                               # one process, unsharded
    torchrun --standalone --nproc_per_node 2 tests/sharding_worker.py OUT --shard   # two processes, FSDP2

A 2-layer Llama (hidden 64, `from_config`, seed 0) trains on fixed rows: every optimizer step takes the
next `ROWS_PER_STEP` rows whatever the split into processes and micro-batches (the trainer's
StepSchedule.micro_batch slicing), with the trainer's loss (TargetHead, Σ token losses / the step's target
tokens) through Accelerate's `backward` / `accumulate` / `reduce` on a model Accelerate does not prepare.
With --checkpoint-every it writes atomic sharded checkpoints and resumes from the newest one on start.

OUT/result.json (rank 0): {"losses": [mean token loss per step], "grad_norms": [...], "resumed_from": step}
OUT/model/: the final weights as a normal Hugging Face checkpoint (`fulltune.sharding.save_pretrained`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ROWS_PER_STEP = 4
SEQ_LEN = 16
VOCAB = 128
CHECKPOINT = re.compile(r"^step-(\d+)$")


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


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
    parser.add_argument("--shard", action="store_true", help="FSDP2 via fulltune.sharding")
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16"))
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--kill-at-micro-step", type=int, default=0, help="SIGKILL rank 0 after this micro-step")
    return parser.parse_args(argv)


def latest_checkpoint(root: Path) -> Path | None:
    steps = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := CHECKPOINT.match(p.name))]
    return max(steps)[1] if steps else None


def main(argv: list[str] | None = None) -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from fulltune import sharding
    from fulltune.loss import TargetHead, Targets

    args = parse(argv)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = ROWS_PER_STEP // (args.micro * processes)
    assert accumulation * args.micro * processes == ROWS_PER_STEP, "micro × processes must divide ROWS_PER_STEP"
    # As the trainer: Accelerate for the process group, backward, accumulate and reduce. Under FSDP the
    # model and optimizer stay out of prepare (it would wrap them in DDP); bf16 then comes from FSDP's
    # MixedPrecisionPolicy instead of autocast.
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=accumulation, step_scheduler_with_optimizer=False)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config())
    model.config.use_cache = False
    head = TargetHead(model)
    if args.shard:
        sharding.shard_model(model, device="cpu", mixed_precision=args.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    if not args.shard:
        model, optimizer = accelerator.prepare(model, optimizer)
    model.train()

    checkpoints = args.out / "checkpoints"
    step, losses, norms, resumed_from = 0, [], [], None
    checkpoint = latest_checkpoint(checkpoints) if args.checkpoint_every else None
    if checkpoint is not None:
        extra = sharding.load_sharded_checkpoint(checkpoint, model, optimizer)
        step, losses, norms, resumed_from = extra["step"], extra["losses"], extra["grad_norms"], extra["step"]

    input_ids, labels = fixed_rows(args.steps)
    micro_steps = step * accumulation
    while step < args.steps:
        rows = torch.arange(step * ROWS_PER_STEP, (step + 1) * ROWS_PER_STEP)
        step_targets = int((labels[rows, 1:] != -100).sum())
        step_loss = torch.zeros(())
        for index in range(accumulation):
            start = (index * processes + rank) * args.micro
            mine = rows[start:start + args.micro]
            targets = Targets.from_labels(labels[mine])
            with accelerator.accumulate(model):
                loss_sum = head.loss_sum(model, {"input_ids": input_ids[mine]}, targets)
                accelerator.backward(loss_sum * (accumulation * processes / step_targets))
            step_loss += loss_sum.detach()
            micro_steps += 1
            if micro_steps == args.kill_at_micro_step and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        if args.shard:
            norm = sharding.clip_grad_norm_(model, 1.0)
        else:
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        if processes > 1:
            step_loss = accelerator.reduce(step_loss, reduction="sum")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(step_loss.item() / step_targets)
        norms.append(float(norm))
        if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.steps:
            sharding.save_sharded_checkpoint(checkpoints / f"step-{step}", model, optimizer,
                                             {"step": step, "losses": losses, "grad_norms": norms})

    head.remove()
    sharding.save_pretrained(accelerator.unwrap_model(model), args.out / "model")
    if rank == 0:
        result = {"losses": losses, "grad_norms": norms, "resumed_from": resumed_from}
        (args.out / "result.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
