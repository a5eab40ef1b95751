"""The parallelism plan: data parallel (FSDP2) × tensor parallel (DTensor), composed as torchtitan does.

`distributed.tensor_parallel: T` with `num_processes: N` lays the N processes out on a 2-D device mesh
("dp", "tp") of shape (N/T, T): the T processes of a "tp" row split every decoder block's matmuls and
see the same rows of data; the N/T rows train on different data and shard what is left with FSDP2.

    plan = ParallelPlan.from_job(job)            # dp × tp degrees, validated against the model
    model = ...built on meta, levers applied...  # gradient checkpointing, TargetHead, pure bf16
    plan.apply(model, device, mixed_precision)   # 1. TP plan per block  2. FSDP2 over "dp"

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

Between blocks the hidden states stay whole: transformers builds the causal / packed-row mask and the
rotary embeddings at the model level over the whole sequence, so a block must receive all positions.
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

from dataclasses import dataclass
from typing import Any

from fulltune.errors import ConfigError

# The modules of a block that the plan splits, by their transformers names (Llama layout).
ATTENTION_COLUMNS = ("q_proj", "k_proj", "v_proj")
MLP_COLUMNS = ("gate_proj", "up_proj")
BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")
FIELD = "distributed.tensor_parallel"


@dataclass(frozen=True)
class ParallelPlan:
    """How `num_processes` processes split the work: `data_parallel` × `tensor_parallel` = processes.

    `data_parallel` processes train on different rows (FSDP2 shards over them); the
    `tensor_parallel` processes of a group split each block's matmuls and train on the same rows.
    """

    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1  # the stages of one data-parallel replica train on the same rows

    @classmethod
    def from_job(cls, job: Any) -> ParallelPlan:
        """The plan of a TrainJob's `distributed` section (FSDP alone is tensor_parallel 1)."""
        distributed = job.distributed
        return cls(distributed.data_parallel, distributed.tensor_parallel, distributed.pipeline_parallel)

    @property
    def processes(self) -> int:
        return self.data_parallel * self.tensor_parallel

    @property
    def enabled(self) -> bool:
        """Tensor parallel is on (otherwise sharding.shard_model alone is the FSDP plan)."""
        return self.tensor_parallel > 1

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank`: which rows of a step it trains on."""
        return rank // (self.tensor_parallel * self.pipeline_parallel)

    def mesh(self, device: str) -> Any:
        """The 2-D ("dp", "tp") mesh over the default process group; "tp" groups are consecutive ranks
        (on one machine first, where the per-block collectives are cheapest)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("tensor parallel needs a process group: run under torchrun")
        if dist.get_world_size() != self.processes:
            raise ConfigError(f"{FIELD}: {self.processes} processes planned, {dist.get_world_size()} started")
        return init_device_mesh(device, (self.data_parallel, self.tensor_parallel), mesh_dim_names=("dp", "tp"))

    def check_model(self, model: Any) -> None:
        """ConfigError naming distributed.tensor_parallel when `model` cannot be split T ways."""
        check_model_config(model.config, self.tensor_parallel)
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
                raise ConfigError(f"{FIELD}: {type(model).__name__}'s blocks are not in the Llama layout that "
                                  f"tensor parallel splits (missing {names or 'nothing'}, unplanned parameters "
                                  f"{extra or 'none'}); use tensor_parallel 1")
            break

    def apply(self, model: Any, device: str, mixed_precision: str = "no", mesh: Any = None) -> Any:
        """Split `model` in place: the TP plan on every block, the embedding, final norm and head, then
        FSDP2 over the "dp" mesh. Call it where
        `sharding.shard_model` would be called: after the levers, before the optimizer, on a model on the
        meta device or with the same weights in every process."""
        from fulltune.runtime import sharding

        self.check_model(model)
        mesh = mesh if mesh is not None else self.mesh(device)
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
                module.set_gradient_divide_factor(float(self.processes))
                module.set_force_sum_reduction_for_comms(self.data_parallel > 1)
        return model


def check_model_config(config: Any, tensor_parallel: int, where: str = "") -> None:
    """ConfigError naming distributed.tensor_parallel (after `where`, e.g. `pipelines.demo.`) when the
    attention heads, key/value heads or MLP width of `config` do not split `tensor_parallel` ways."""
    if tensor_parallel == 1:
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    problems = [f"{what} ({value})" for what, value in (("num_attention_heads", heads),
                                                        ("num_key_value_heads", kv_heads),
                                                        ("intermediate_size", getattr(config, "intermediate_size", None)))
                if not isinstance(value, int) or value % tensor_parallel]
    if problems:
        raise ConfigError(f"{where}{FIELD}: {tensor_parallel} does not divide the model's {', '.join(problems)}")


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
        raise ConfigError(f"{FIELD}: {type(model).__name__} has no final norm where the padded positions end")
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
            raise ConfigError(f"{FIELD}: tensor parallel runs take input_ids")
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


def is_tensor_parallel(model: Any) -> bool:
    """Whether `model`'s parameters are DTensors on a mesh with a "tp" dimension of more than one process."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            return "tp" in names and param.device_mesh.size(names.index("tp")) > 1
        return False
    return False
