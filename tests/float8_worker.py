"""float8 training on the trainer's own step, for tests/test_float8.py: run where torchao is importable (the test
puts .lowbit/ on PYTHONPATH: tests/lowbit.py), it prints one JSON object.

    python tests/float8_worker.py DIR

A 2-layer Llama (hidden 128, intermediate 384, 4 heads, 2 key/value heads, vocabulary 256; every linear's
dimensions multiples of 16) and learnable rows (counting sequences, 4 rows of 128 tokens per step) are written
under DIR. Each variant is the trainer's `setup` (which converts the linears when the plan says float8) and
`STEPS` of its `train_step`, every step under torch's MemTracker (the model and the optimizer's states registered,
as fulltune/runtime/step_memory.py measures a CPU run); then the memory model's estimate for the same settings
(`estimate_memory`, packed rows of one document: no attention mask). And one converted linear alone, forward
and backward under MemTracker, for shapes that put each of its peaks first, against `memory.float8`'s counts.

{"variants": {name: {"peaks": [per step], "estimate": bytes, "losses": [mean token loss per step],
                     "float8_linears": [layer 0's converted linears]}},
 "linears": [{"shape": [T, K, N], "dtype", "recipe", "forward", "backward", "plain_forward", "plain_backward",
              "counted_forward", "counted_backward"}]}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

STEPS = 6
ROWS, SEQ_LEN, VOCAB = 32, 128, 256
VARIANTS = {
    "pure_bf16": dict(pure_bf16=True, mixed_precision="bf16"),
    "pure_bf16_float8_tensorwise": dict(pure_bf16=True, mixed_precision="bf16", float8=True),
    "pure_bf16_float8_rowwise": dict(pure_bf16=True, mixed_precision="bf16", float8=True, float8_recipe="rowwise"),
    "fp32": dict(mixed_precision="no"),
    "fp32_float8_tensorwise": dict(mixed_precision="no", float8=True),
}
# (tokens, in, out): the input's cast first; the weight's; the output's gradient's (tests/test_float8.py).
LINEAR_SHAPES = ((512, 384, 128), (256, 512, 1024), (512, 128, 384))


def write_assets(root: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tiny import word_level_tokenizer

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    word_level_tokenizer(root / "model", VOCAB)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(ROWS):
        start = int(rng.integers(2, VOCAB))
        doc = [2 + (start - 2 + k) % (VOCAB - 2) for k in range(SEQ_LEN)]  # the next token is this one + 1
        rows.append((doc, [-100] + doc[1:], list(range(SEQ_LEN))))
    columns = {"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows], "position_ids": [r[2] for r in rows]}
    pq.write_table(pa.table({k: pa.array(v, type=pa.list_(pa.int32())) for k, v in columns.items()}),
                   root / "train.parquet")


def variant(root: Path, fields: dict) -> dict:
    from accelerate.state import AcceleratorState
    from dataclasses import replace

    from fulltune.memory import estimate_memory
    from fulltune.runtime.launch import job_with
    from fulltune.runtime.step_memory import peak_tracker, state_holders, tracked_peak_bytes
    from fulltune.runtime.train import setup, train_step

    job = job_with(str(root / "model"), str(root / "train.parquet"), str(root / "run"), micro_batch_size=4,
                   gradient_accumulation_steps=1, max_steps=STEPS, checkpoint_every_steps=0, seq_len=SEQ_LEN,
                   learning_rate=3e-3, warmup_ratio=0.0, max_grad_norm=1e6, seed=0, **fields)
    run = setup(job)
    try:
        converted = [name for name, module in run.accelerator.unwrap_model(run.model).model.layers[0].named_modules()
                     if type(module).__name__ == "Float8Linear"]
        peaks, losses = [], []
        for step in range(STEPS):
            rows = run.schedule.step_rows(step)
            tracker = peak_tracker()
            tracker.track_external(run.model, *state_holders(run.optimizer))
            with tracker:
                outcome = train_step(run, rows, step + 1)
            peaks.append(tracked_peak_bytes(tracker))
            losses.append(float(outcome.loss_sum) / int(run.data.targets[rows].sum()))
        settings = replace(job.plan, attention_mask=False)  # one document a row: no mask is built
        return {"peaks": peaks, "estimate": estimate_memory(run.model_config, settings).peak_bytes, "losses": losses,
                "float8_linears": converted}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def linear(tokens: int, in_features: int, out_features: int, dtype_name: str, recipe: str | None) -> tuple[int, int]:
    """(forward peak, backward peak) of one linear, MemTracker, with its input, weight (and output and its
    gradient in backward) registered."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fulltune.runtime.step_memory import peak_tracker, tracked_peak_bytes

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False)).to(dtype)
    if recipe:
        convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(tokens, in_features, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, out_features, dtype=dtype)
    tracker = peak_tracker()
    tracker.track_external(module, x)
    with tracker:
        y = module(x)
    forward = tracked_peak_bytes(tracker)
    tracker = peak_tracker()
    tracker.track_external(module, x, y, grad)
    with tracker:
        y.backward(grad)
    return forward, tracked_peak_bytes(tracker)


def linears() -> list[dict]:
    from fulltune.memory.float8 import Linear, backward_peak, forward_extra

    out = []
    for tokens, k, n in LINEAR_SHAPES:
        for dtype, size in (("bfloat16", 2), ("float32", 4)):
            plain_forward, plain_backward = linear(tokens, k, n, dtype, None)
            for recipe in ("tensorwise", "rowwise"):
                forward, backward = linear(tokens, k, n, dtype, recipe)
                layer = Linear("x", k, n, False)
                # Beyond the plain linear's: its forward holds input, weight and output; its backward those, the
                # output's gradient, the input's and the weight's gradients.
                base_backward = plain_backward - (tokens * k + n * k) * size
                out.append({"shape": [tokens, k, n], "dtype": dtype, "recipe": recipe, "forward": forward,
                            "backward": backward, "plain_forward": plain_forward, "plain_backward": plain_backward,
                            "counted_forward": plain_forward + forward_extra(layer, tokens, size, recipe),
                            "counted_backward": base_backward + max(backward_peak(layer, tokens, size, recipe),
                                                                    (tokens * k + n * k) * size)})
    return out


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(sys.argv[1])
    write_assets(root)
    result = {"variants": {name: variant(root, fields) for name, fields in VARIANTS.items()}, "linears": linears()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
