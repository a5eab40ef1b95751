"""float8 training (`train.float8`): the decoder layers' linears swapped for torchao's `Float8Linear`
(`torchao.float8.convert_to_float8_training`), which casts each matmul's operands to float8 with dynamic scales
(`tensorwise`: one per tensor; `rowwise`: one per row, `train.float8_recipe`) and runs them on the float8 tensor
cores. The weights stay what they are (fp32 masters, bf16 under pure bf16); the optimizer and the checkpoints
see the same parameters.

What is converted is what the memory model counts (fulltune/memory/float8.py `converted`): each linear of the
decoder layers whose two dimensions the kernels take (multiples of 16), by its name in the layer. The output head
and the embeddings stay in their precision, and so does a linear whose dimensions the kernels cannot take; the plan
names them.

Under FSDP2 on GPUs the `tensorwise` recipe also all-gathers the converted weights in float8
(`enable_fsdp_float8_all_gather`: half the bytes of a bf16 gather; `memory.float8.float8_all_gather` decides it
for the estimate and the trainer alike). gloo cannot move float8 tensors, so a CPU run gathers bf16 and casts
after the gather.

torchao is imported here only, when a run converts: it is the optional extra `fulltune[lowbit]`, and the lever
table refuses `float8: true` where it is not installed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fulltune.memory.float8 import converted, float8_all_gather
from fulltune.memory.shapes import model_shape


def convert_linears(model: Any, settings: Any) -> None:
    """Swap the decoder layers' linears that the memory model counts as converted for torchao's `Float8Linear`, in
    `settings.float8_recipe`, gathering them in float8 under FSDP2 where `float8_all_gather(settings)`; before the
    model is sharded and its optimizer built (the `float8` lever's `apply`, fulltune/levers.py)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fulltune.runtime.checkpointing import decoder_layers

    config = Float8LinearConfig.from_recipe_name(settings.float8_recipe)
    if float8_all_gather(settings):
        config = replace(config, enable_fsdp_float8_all_gather=True)
    names = {linear.name for linear in converted(model_shape(model.config))}
    for layer in decoder_layers(model):
        convert_to_float8_training(layer, module_filter_fn=lambda module, name: name in names, config=config)
