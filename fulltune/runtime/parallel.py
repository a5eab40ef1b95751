"""The parallelism plan: data parallel (FSDP2) × tensor parallel (DTensor), composed as torchtitan does.

`distributed.tensor_parallel: T` with `num_processes: N` lays the N processes out on a 2-D device mesh
("dp", "tp") of shape (N/T, T): the T processes of a "tp" row split every decoder block's matmuls and
see the same rows of data; the N/T rows train on different data and shard what is left with FSDP2.

    dims = job.dims                                # dp × tp degrees (fulltune/degrees.py)
    model = ...built on meta, levers applied...    # gradient checkpointing, TargetHead, pure bf16
    apply(model, dims, device, mixed_precision)    # 1. TP plan per block  2. FSDP2 over "dp"

The order is torchtitan's (TP plan on each block → activation checkpointing → FSDP over the dp mesh):
transformers' checkpointing wraps a block's `__call__`, so the TP hooks below run inside the recomputed
region whatever the order they are installed in, and FSDP2 then shards the TP DTensors' local pieces over
the dp processes (2-D DTensors). PyTorch's own machinery (`torch.distributed.tensor.parallel`) is used
instead of transformers' `tp_plan`: transformers' plans are column / row splits without sequence
parallelism, and they take over model loading (`from_pretrained(tp_plan=...)`), which would bypass
fulltune's sharded loading and levers.

Each decoder block (Megatron-LM's layout, with sequence parallelism inside the block):

    block input  (b, s, h) replicated ──slice──► (b, s/T, h) local        PrepareModuleInput (no traffic)
    input norm   sequence parallel: its own s/T positions                 SequenceParallel
    attention    all-gather → q, k, v column-split (H/T heads each) → o row-split → reduce-scatter (s/T)
    residual add on (b, s/T, h)
    post norm    sequence parallel                                        SequenceParallel
    MLP          all-gather → gate, up column-split → down row-split → reduce-scatter (s/T)
    block output (b, s/T, h) ──all-gather──► (b, s, h) replicated          PrepareModuleOutput

Between blocks the hidden states stay whole: transformers builds the causal mask (packed rows: their
documents, fulltune/attention.py) and the rotary embeddings at the model level over the whole sequence, so a
block must receive all positions.
The embedding is split over the vocabulary (row-wise, its output all-reduced), the output head over the
vocabulary (column-wise, logits gathered), the final norm replicated; every parameter is then a DTensor on
the "tp" mesh, so clipping, checkpoints and the exported model treat them alike. A tied output head keeps
sharing the embedding's (vocabulary-split) weight.

Supported blocks: the Llama layout (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`), i.e. Llama, Mistral and Qwen2, with attention and
key/value heads divisible by T. Anything else is a ConfigError naming `distributed.tensor_parallel`.

Torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any

from fulltune.degrees import TENSOR_PARALLEL, ParallelDims
from fulltune.errors import ConfigError

# The modules of a block that the plan splits, by their transformers names (Llama layout).
ATTENTION_COLUMNS = ("q_proj", "k_proj", "v_proj")
MLP_COLUMNS = ("gate_proj", "up_proj")
BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")


def check_model(model: Any, dims: ParallelDims) -> None:
    """ConfigError naming distributed.tensor_parallel when `model` cannot be split `dims.tp` ways: its heads or
    MLP width (`ParallelDims.check_split`), or blocks outside the Llama layout."""
    dims.check_split(model.config)
    from fulltune.runtime.checkpointing import decoder_layers

    for layer in decoder_layers(model):
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [f"self_attn.{n}" for n in (*ATTENTION_COLUMNS, "o_proj") if not hasattr(attention, n)]
        names += [f"mlp.{n}" for n in (*MLP_COLUMNS, "down_proj") if not hasattr(mlp, n)]
        names += [n for n in BLOCK_NORMS if not hasattr(layer, n)]
        own = {name for name, _ in layer.named_parameters()}
        planned = {f"self_attn.{n}.{p}" for n in (*ATTENTION_COLUMNS, "o_proj") for p in ("weight", "bias")}
        planned |= {f"mlp.{n}.{p}" for n in (*MLP_COLUMNS, "down_proj") for p in ("weight", "bias")}
        planned |= {f"{n}.weight" for n in BLOCK_NORMS}
        extra = sorted(own - planned)
        if names or extra:
            raise ConfigError(f"{TENSOR_PARALLEL}: {type(model).__name__}'s blocks are not in the Llama layout that "
                              f"tensor parallel splits (missing {names or 'nothing'}, unplanned parameters "
                              f"{extra or 'none'}); use tensor_parallel 1")
        break


def apply(model: Any, dims: ParallelDims, device: str, mixed_precision: str = "no", mesh: Any = None) -> Any:
    """Split `model` in place over `dims`: the TP plan on every block, the embedding, final norm and head,
    then FSDP2 over the "dp" mesh (`dims.mesh(device)` unless `mesh` is given). Call it where
    `sharding.shard_model` would be called: after the levers, before the optimizer, on a model on the
    meta device or with the same weights in every process."""
    from fulltune.runtime import sharding

    check_model(model, dims)
    mesh = mesh if mesh is not None else dims.mesh(device)
    tensor_parallelize(model, mesh["tp"])
    # FSDP2 also over a "dp" mesh of one process (pure TP): it then shards nothing, but its mixed-precision
    # policy casts the gathered weights to bf16 as under FSDP, and checkpoints and the export take one path.
    sharding.shard_model(model, device=device, mixed_precision=mixed_precision, mesh=mesh["dp"])
    # The training step (fulltune/runtime/step.py) scales every process's loss by the number of processes, as data
    # parallel needs; the processes of a tp group train on the same rows, so the gradients are divided by
    # all processes, not by the dp ones only. Over several dp processes: a plain sum, then the division
    # (gloo has no pre-scaled sum); over one, FSDP2 divides its copy itself (a forced sum would divide twice).
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dims.world_size))
            module.set_force_sum_reduction_for_comms(dims.dp > 1)
    return model


def tensor_parallelize(model: Any, mesh: Any) -> None:
    """The TP plan of the module docstring, applied in place with torch.distributed.tensor.parallel."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    from fulltune.runtime.checkpointing import decoder_layers

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    for layer in decoder_layers(model):
        parallelize_module(layer, mesh, {
            # A block's positional input is the whole sequence; each process keeps its s/T positions.
            "": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                   use_local_output=True),
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
            **{f"self_attn.{name}": ColwiseParallel() for name in ATTENTION_COLUMNS},
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
            **{f"mlp.{name}": ColwiseParallel() for name in MLP_COLUMNS},
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        # The next block (and the model's final norm) reads the whole sequence again.
        parallelize_module(layer, mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                            desired_output_layouts=Replicate()))
    parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    norm = _final_norm(model)
    if norm is None:
        raise ConfigError(f"{TENSOR_PARALLEL}: {type(model).__name__} has no final norm where the padded positions end")
    # Sequence parallel splits the positions evenly: each micro-batch is padded at the end to a multiple of
    # T, which changes no real position's output (causal attention looks back only), and the padding is cut
    # off after the final norm, before the loss head selects its target positions.
    padding = _SequencePadding(mesh.size())
    model.register_forward_pre_hook(padding.pad, with_kwargs=True)
    # Replicated weight, whole-sequence input and output: the norm computes as in one process.
    distribute_module(norm, mesh, input_fn=_replicated_input, output_fn=padding.cut)
    if head is not None:
        if tied:
            # The head's weight is the embedding's, now split over the vocabulary (dim 0) as a column-parallel
            # head's is: the head takes the embedding's new DTensor parameter, and only the activations'
            # layouts are installed, so the weight stays one parameter.
            head.weight = embedding.weight
            parallelize_module(head, mesh, _TiedColumnHead())
        else:
            parallelize_module(head, mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))


def _final_norm(model: Any) -> Any:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return getattr(base, "norm", None)


def _replicated_input(_module: Any, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False) if not isinstance(x, DTensor) else x
                 for x in inputs)


class _SequencePadding:
    """Pads a micro-batch's positions to a multiple of `multiple` before the model, cuts them after its norm."""

    def __init__(self, multiple: int) -> None:
        self.multiple = multiple
        self.length: int | None = None  # the micro-batch's own length while the model runs

    def pad(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        import torch
        import torch.nn.functional as F

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ConfigError(f"{TENSOR_PARALLEL}: tensor parallel runs take input_ids")
        self.length = length = ids.shape[1]
        extra = -length % self.multiple
        if not extra:
            return args, kwargs
        kwargs = dict(kwargs)
        if args:
            kwargs["input_ids"], args = args[0], args[1:]
        kwargs["input_ids"] = F.pad(kwargs["input_ids"], (0, extra), value=0)
        if kwargs.get("position_ids") is not None:
            positions = kwargs["position_ids"]
            tail = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)
            kwargs["position_ids"] = torch.cat([positions, tail], dim=1)
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = F.pad(kwargs["attention_mask"], (0, extra), value=0)
        if kwargs.get("documents") is not None:  # packed rows: the padding continues each row's last document
            kwargs["documents"] = kwargs["documents"].padded(extra)
        return args, kwargs

    def cut(self, _module: Any, output: Any, _mesh: Any) -> Any:
        output = output.to_local() if hasattr(output, "to_local") else output
        return output if self.length is None else output[:, : self.length]


class _TiedColumnHead:
    """ColwiseParallel for a head whose weight is the (vocabulary-split) input embedding's DTensor: the
    input is made a replicated DTensor, the logits are gathered to every process; the weight is not
    distributed again (that would make it a second parameter and break the tie)."""

    def __new__(cls) -> Any:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        class TiedColumnHead(ColwiseParallel):
            def _partition_linear_fn(self, name: str, module: Any, device_mesh: Any) -> None:
                return None  # the weight is the embedding's DTensor already

        return TiedColumnHead(input_layouts=Replicate(), output_layouts=Replicate())

