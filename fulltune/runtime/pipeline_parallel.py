"""Pipeline-parallel training: a causal LM's decoder layers split into stages, run by
`torch.distributed.pipelining`'s GPipe or 1F1B schedule, with data parallel beside them.

    stage 0:      embed_tokens → layers[0 : L/P]                 ─ activations ─►
    stage s:      layers[s·L/P : (s+1)·L/P]                       ◄─ gradients ─
    stage P − 1:  layers[...] → norm → lm_head at the target positions → loss

The split is manual (`StageModule`: each stage holds its own slice of the model's modules) rather than
traced by `torch.distributed.pipelining.pipeline()`: transformers' decoder layers take rotary tables, masks
and keyword arguments that an export-based tracer has to follow through, while a hand-made stage only runs
the same modules in the same order as `LlamaModel.forward`. Each stage builds its own rotary tables and
causal mask from the position ids and attention mask every stage receives (they are not sent between
stages: only the residual stream is).

Processes: num_processes = P stages × dp replicas on the ("pp", "dp", "tp") device mesh of
`fulltune.degrees.ParallelDims` (torchtitan's layout; tp is 1 here). Global rank r is stage r // dp, data rank
r % dp; a stage's point-to-point sends run in its "pp" group (the same data rank on every stage), and every
replica of the pipeline trains on its data rank's rows of the step, as data-parallel processes read theirs
(`StepSchedule.micro_batch`). Over a stage's "dp" group (`data_parallel_stage`) the stage is sharded with FSDP2
(`distributed.strategy: fsdp`: the embedding, each layer and the head a unit) or replicated (`ddp`:
`replicate`, FSDP2's replicated layout); the schedule accumulates the micro-batches' gradients unsharded and
reduces them (a sum) after the step's last backward. With dp 1 (strategy none) a stage is a plain module.

The loss is the trainer's (`fulltune.runtime.loss`): the output head runs only at the positions with a target, the
token losses are summed and divided by the target tokens of the whole optimizer step (every replica's), so the
schedule must not scale the gradients again (`scale_grads=False`) and data parallel sums them. The gradient norm
is clipped over every stage's parameters and every dp shard together (one all-reduce of the squared norms), as
one process clips the whole model.

`fulltune run` trains with it when `distributed.pipeline_parallel` is above 1 (fulltune/runtime/train.py):
`fulltune.runtime.step.run_step` runs the schedule in place of its micro-batch loop, then the trainer's
`OptimizerStep` (this module's global clip, the skip of a non-finite step, the LR schedule). A stage keeps its
modules under the full model's names (`model.layers.<i>`, `lm_head`), so its checkpoint (`save_stage_state`:
DCP, a file per (stage, dp shard), FSDP2's shards as DTensors) and its export shard (`export_stage`: gathered
over dp, written by the stage's first dp process) name every tensor as the whole model does. The memory model of
a stage is `fulltune.memory.pipeline`; which levers stages run is the lever table's (fulltune/levers.py).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fulltune.data import IGNORE_INDEX
from fulltune.degrees import DegreesError
from fulltune.memory.pipeline import SCHEDULES, stage_layers
from fulltune.runtime.loss import (ROW_CHUNK, VOCAB_CHUNK, ChunkedLinearCrossEntropy, Targets,
                                   logit_postprocessing)

__all__ = ["SCHEDULES", "PipelineRun", "StageModule", "build_stage", "check_model_config", "clip_grad_norm_",
           "data_parallel_stage",
           "export_stage", "is_stage", "load_stage_state", "save_stage_state"]

FIELD = "distributed.pipeline_parallel"
STAGE_STATE_DIR = "stages"  # in a step checkpoint: every stage's parameters and optimizer state (DCP)
INDEX_FILE = "model.safetensors.index.json"


class StageModule(torch.nn.Module):
    """Decoder layers `[start, end)` of a Llama-layout causal LM (Llama, Mistral, Qwen2/3: `model.model.layers`,
    `embed_tokens`, `norm`, `rotary_emb`, `lm_head`), with the input embedding on the first stage and the final
    norm and output head on the last, each under its name in the whole model (`model.layers.<i>` keeps the
    model's layer index), so a stage's state dict is its part of the model's.

    forward(x, position_ids, attention_mask) takes token ids on the first stage and the residual stream
    (b, s, h) on the others, and returns the residual stream; the last stage returns it after the final
    norm (the head runs in the loss, at the target positions only).
    """

    def __init__(self, model: torch.nn.Module, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        body = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if body is None or not all(hasattr(body, name) for name in needed) or model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__}: pipeline stages are built for the Llama layout "
                             f"(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head)")
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.first, self.last = first, last
        self.model = torch.nn.Module()
        self.model.embed_tokens = body.embed_tokens if first else None
        self.model.layers = torch.nn.ModuleDict({str(i): body.layers[i] for i in range(start, end)})
        self.model.rotary_emb = body.rotary_emb  # a buffer of inverse frequencies: every stage computes its tables
        self.model.norm = body.norm if last else None
        self.lm_head = model.get_output_embeddings() if last else None
        self.mixed_precision = "no"  # "bf16": the forward runs under autocast (`PipelineRun.create` sets it)
        self.chunked = False  # the loss's head in tiles (train.chunked_loss; `PipelineRun.create` sets it)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        body = self.model
        with self._autocast():
            hidden = body.embed_tokens(x) if self.first else x
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                      cache=None, position_ids=position_ids)
            rotary = body.rotary_emb(hidden, position_ids=position_ids)
            for layer in body.layers.values():
                hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
            return body.norm(hidden) if self.last else hidden

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast around the forward only, as Accelerate and `fulltune.runtime.step.LocalAccelerator` apply it (the
        schedule runs the backward outside it)."""
        if self.mixed_precision == "bf16":
            return torch.autocast(device_type=next(self.parameters()).device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss_sum(self, hidden: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
        """Σ of the fp32 token losses of a micro-batch whose targets are `shifted` (a label per position, the
        next token's, IGNORE_INDEX where none): the head at the target positions only, whole or in tiles
        (`chunked`), as `fulltune.runtime.loss.TargetHead` runs it in one process."""
        flat = shifted.reshape(-1)
        index = (flat != IGNORE_INDEX).nonzero().squeeze(1)
        tokens = flat.index_select(0, index)
        with self._autocast():
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
            if self.chunked:
                head = self.lm_head
                return ChunkedLinearCrossEntropy.apply(rows, head.weight, getattr(head, "bias", None), tokens,
                                                       *logit_postprocessing(self.config), ROW_CHUNK, VOCAB_CHUNK)
            logits = self.lm_head(rows).float()  # fp32, as Accelerate returns them under mixed precision
        return F.cross_entropy(logits, tokens, reduction="sum")


def build_stage(model: torch.nn.Module, stage: int, num_stages: int) -> StageModule:
    """Stage `stage` of `num_stages` of `model`, its layers split evenly (`fulltune.memory.pipeline.stage_layers`)."""
    start, end = stage_layers(int(model.config.num_hidden_layers), num_stages)[stage]
    module = StageModule(model, start, end, first=stage == 0, last=stage == num_stages - 1)
    module.index, module.num_stages = stage, num_stages
    return module


def is_stage(model: Any) -> bool:
    return isinstance(model, StageModule)


def check_model_config(config: Any, num_stages: int, where: str = "") -> None:
    """DegreesError (a ConfigError) naming distributed.pipeline_parallel (after `where`) when `config` cannot be split into
    `num_stages` stages: fewer decoder layers than stages, or an output head tied to the input embedding
    (the first and the last stage would each train a copy; not built)."""
    if num_stages == 1:
        return
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < num_stages:
        raise DegreesError(f"{where}{FIELD}: {num_stages} stages need at least one decoder layer each; the model "
                          f"has {layers}")
    if getattr(config, "tie_word_embeddings", False):
        raise DegreesError(f"{where}{FIELD}: the model ties its output head to its input embedding "
                          "(tie_word_embeddings), which pipeline stages do not train yet; set pipeline_parallel to 1")


def data_parallel_stage(stage: StageModule, mesh: Any, dims: Any) -> StageModule:
    """Data parallel over `mesh` (a stage's "dp" processes) in place, as torchtitan composes it with pipeline
    stages, as `dims` (a `fulltune.degrees.ParallelDims`) holds them: FSDP shards the stage with FSDP2 (`fully_shard`: the input embedding, each decoder layer and the
    output head a unit, the stage the root: the final norm), DDP replicates it (`replicate`, FSDP2's
    replicated layout: the gradients all-reduced). The parameters become DTensors on `mesh`, which the
    optimizer is built on, the checkpoints save a shard of (DCP) and the export gathers.

    Every dp process trains on its own rows and divides its token losses by the target tokens of the whole
    step (all processes), so the gradients are summed over `mesh`, not averaged. The schedule accumulates
    the micro-batches' gradients unsharded and reduces them once, after the step's last backward
    (`torch.distributed.pipelining`'s FSDP support); between the backwards a unit keeps its gathered weights.
    The stage's forward autocasts itself under bf16 (`StageModule._autocast`): the units gather fp32 weights.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if dims.alone:
        raise ValueError("data parallel beside pipeline stages is fsdp or ddp; got strategy none")
    if dims.ddp_enabled:
        replicate(stage, mesh=mesh)
    else:
        body = stage.model
        units = [body.embed_tokens] if stage.first else []
        units += list(body.layers.values())
        for unit in units:
            fully_shard(unit, mesh=mesh)
        if stage.last:  # called by the loss after the stage's forward: gathered until its backward
            fully_shard(stage.lm_head, mesh=mesh, reshard_after_forward=False)
        fully_shard(stage, mesh=mesh)
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-scaled one)
    return stage


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    group: Any = None) -> torch.Tensor:
    """Clip the gradients of every stage's `parameters` to a global norm `max_norm`: each stage's squared norm,
    summed over the pipeline's processes, as `torch.nn.utils.clip_grad_norm_` computes it for one model.

    Under data parallel (`data_parallel_stage`) the gradients are DTensors on a stage's "dp" processes: each
    process's local squares are summed over all processes (one all-reduce), a replicated gradient's counted
    once (divided by the processes that hold it), and each process scales its local gradients."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not any(isinstance(g, DTensor) for g in grads):
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        squared = local.float().square()
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
        norm = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm
    squared = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    locals_ = []
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        copies = 1
        if isinstance(grad, DTensor):
            copies = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements)
                               if isinstance(p, Replicate))
        squared += torch.linalg.vector_norm(local.float()).square() / copies
        locals_.append(local)
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    norm = squared.sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(locals_, coefficient.to(locals_[0].dtype))
    return norm


def _padded(inputs: dict[str, torch.Tensor], targets: Targets, length: int, pad_token_id: int
            ) -> dict[str, torch.Tensor]:
    """A micro-batch (input_ids, position_ids and an attention mask if it has one, (b, s); its targets)
    right-padded to `length` columns, the schedule's fixed shape, with its targets as `shifted` labels (b, length):
    the next token at each position with a target, IGNORE_INDEX elsewhere. Padding comes after every real
    token, so a causal model's real positions do not see it."""
    input_ids, positions = inputs["input_ids"], inputs["position_ids"]
    b, s = input_ids.shape
    pad = length - s
    shifted = torch.full((b * length,), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    shifted[targets.index // s * length + targets.index % s] = targets.tokens
    padded = {"input_ids": F.pad(input_ids, (0, pad), value=pad_token_id),
              "position_ids": torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1,
                                                                                      device=positions.device)], 1),
              "shifted": shifted.view(b, length)}
    if inputs.get("attention_mask") is not None:
        padded["attention_mask"] = F.pad(inputs["attention_mask"], (0, pad), value=0)
    return padded


@dataclass
class PipelineRun:
    """One process's stage of a pipelined run and its schedule: `forward_backward` is what
    `fulltune.runtime.step.run_step` runs in place of its micro-batch loop.

    Every process is given its data rank's micro-batches of the step: the first stage feeds their token ids,
    the last computes the loss; all of them build their masks and rotary tables from the position ids.
    """

    stage: StageModule
    schedule: Any
    micro_batches: int
    length: int  # the columns every micro-batch is padded to: the schedule's buffers are made for them
    pad_token_id: int = 0
    hooks: Any = None  # fulltune.runtime.faults.TrainHooks: on_loss per micro-batch on the last stage
    step: int = field(default=0, init=False)  # the optimizer step being run (1-based)
    step_targets: int = field(default=0, init=False)  # target tokens of the step being run (the loss's divisor)
    step_loss: Any = field(default=None, init=False)  # Σ token losses of the step so far (the last stage's)

    @classmethod
    def create(cls, model: torch.nn.Module, settings: Any, *, schedule: str = "1f1b", length: int,
               device: Any = "cpu", pad_token_id: int = 0, hooks: Any = None, dims: Any = None) -> PipelineRun:
        """This process's stage of `model`, moved to `device`, and the schedule over
        `settings.gradient_accumulation_steps` micro-batches of `settings.micro_batch_size` × `length` tokens.
        The other stages' modules are dropped with `model`.

        `dims` (a `fulltune.degrees.ParallelDims`; default: every process a stage) lays the processes out on
        the ("pp", "dp", "tp") mesh: this process is stage `dims.stage(rank)`, its point-to-point sends run
        in its "pp" group, and with `dims.dp` above 1 its stage is sharded over its "dp" group with FSDP2
        (`dims.fsdp_enabled`) or replicated with its gradients all-reduced (DDP): `data_parallel_stage`.

        Raises:
            ValueError: an unknown schedule, or a model that is not of the Llama layout.
        """
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from fulltune.degrees import ParallelDims

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
        world = dist.get_world_size()
        dims = dims if dims is not None else ParallelDims(world, 1, world)
        mesh = dims.mesh(torch.device(device).type)
        index, stages = dims.stage(dist.get_rank()), dims.pp
        stage = build_stage(model, index, stages).to(device)
        stage.mixed_precision, stage.chunked = settings.mixed_precision, settings.chunked_loss
        # The shapes crossing each boundary are known from the plan: given up front, the schedule needs no
        # metadata pass (an extra forward and backward of micro-batch 0 before the first step).
        b, h = settings.micro_batch_size, int(model.config.hidden_size)
        dtype = next(stage.parameters()).dtype  # the residual stream's: fp32 under autocast, bf16 with bf16 weights
        if dims.dp > 1 and not dims.alone:
            data_parallel_stage(stage, mesh["dp"], dims)
        stream = torch.empty((b, length, h), dtype=dtype, device="meta", requires_grad=True)
        tokens = torch.empty((b, length), dtype=torch.long, device="meta")
        pipeline_stage = PipelineStage(stage, index, stages, torch.device(device),
                                       input_args=tokens if stage.first else stream, output_args=stream,
                                       group=mesh["pp"].get_group())
        M = settings.gradient_accumulation_steps
        run = cls(stage, None, M, length, pad_token_id, hooks)
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        # Every stage gets the loss function: without one a schedule runs forward only. It is called on the last.
        # The loss is already normalised by the step's target tokens: no second division by the micro-batches.
        run.schedule = kind(pipeline_stage, n_microbatches=M, loss_fn=run._loss, scale_grads=False)
        return run

    def _loss(self, hidden: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
        loss_sum = self.stage.loss_sum(hidden, shifted)
        if self.hooks is not None:
            loss_sum = self.hooks.on_loss(self.step, loss_sum)
        self.step_loss += loss_sum.detach()
        return loss_sum / self.step_targets

    def forward_backward(self, micro_batches: Iterable[tuple[dict[str, torch.Tensor], Targets]], step: int,
                         step_targets: int) -> torch.Tensor:
        """The schedule's forwards and backwards of the step's micro-batches (each `(inputs, targets)` as the
        trainer reads them), accumulating this stage's gradients of Σ token losses / `step_targets`. Returns
        the step's Σ token losses on every stage (the last stages', summed over every process: one all-reduce),
        so that every stage and replica takes the same decision on a non-finite step.

        Raises:
            ValueError: not `micro_batches` micro-batches.
        """
        import torch.distributed as dist

        padded = [_padded(inputs, targets, self.length, self.pad_token_id) for inputs, targets in micro_batches]
        if len(padded) != self.micro_batches:
            raise ValueError(f"a step takes {self.micro_batches} micro-batches; got {len(padded)}")
        batch = {name: torch.cat([micro[name] for micro in padded]) for name in padded[0]}
        input_ids, shifted = batch.pop("input_ids"), batch.pop("shifted")
        self.step, self.step_targets = step, step_targets
        self.step_loss = torch.zeros((), device=input_ids.device)
        args = (input_ids,) if self.stage.first else ()
        target = {"target": shifted} if self.stage.last else {}
        self.schedule.step(*args, **target, return_outputs=False, **batch)  # position ids (and a mask): every stage
        step_loss = self.step_loss
        dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
        if self.hooks is not None:
            for index in range(self.micro_batches):
                self.hooks.after_micro_batch((step - 1) * self.micro_batches + index + 1)
        return step_loss


# ---------------------------------------------------------------------------------------------------
# Checkpoints and export: each stage its own tensors, under the whole model's names


def _stage_state(stage: StageModule, optimizer: Any) -> dict[str, Any]:
    """The stage's parameters and optimizer state keyed by the whole model's names: the optimizer's flattened
    (`state.<name>.exp_avg`, `param_groups.<name>.lr`), so that no two stages write the same key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(stage, optimizer,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": model_state, "optimizer": optimizer_state}


def save_stage_state(directory: str | Path, stage: StageModule, optimizer: Any) -> None:
    """Write every stage's parameters and optimizer state into `directory` (collective; torch.distributed.checkpoint:
    a file per process and `.metadata`). Not atomic by itself: the trainer writes it into its temporary
    step checkpoint."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_stage_state(stage, optimizer), checkpoint_id=str(directory))


def load_stage_state(directory: str | Path, stage: StageModule, optimizer: Any) -> None:
    """Load this stage's part of what `save_stage_state` wrote (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _stage_state(stage, optimizer)  # creates the optimizer's states when it has none yet
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(stage, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))


def _data_rank(stage: StageModule) -> int:
    """This process's index among the data-parallel processes of its stage (0 without data parallel)."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in stage.parameters() if isinstance(p, DTensor)), None)
    return 0 if mesh is None else mesh.get_local_rank()


def export_stage(stage: StageModule, directory: Path, tokenizer: Any = None) -> None:
    """Write this stage's tensors as its shard of one Hugging Face checkpoint in `directory`, which every
    process sees (collective). Under data parallel each tensor is gathered over the stage's "dp" processes
    (`DTensor.full_tensor`, one at a time) and the first of them writes the shard. The main process then
    writes `model.safetensors.index.json` (every tensor → its shard), the config and the tokenizer; no
    process holds more than its own stage."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = f"model-{stage.index + 1:05d}-of-{stage.num_stages:05d}.safetensors"
    writer = _data_rank(stage) == 0
    tensors = {}
    for name, tensor in stage.state_dict().items():  # the same order on every process of the stage
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if writer:
            tensors[name] = whole.detach().contiguous().cpu()
    if writer:
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    names: list[Any] = [None] * world
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    dist.all_gather_object(names, (shard, sizes) if writer else None)
    if rank == 0:
        written = [entry for entry in names if entry is not None]
        weight_map = {name: file for file, sizes in written for name in sizes}
        total = sum(size for _, sizes in written for size in sizes.values())
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                        "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        stage.config.save_pretrained(directory)
        if stage.generation_config is not None:
            stage.generation_config.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    dist.barrier()


def save_pretrained(stage: StageModule, directory: Path, tokenizer: Any = None) -> None:
    """`export_stage` into a temporary directory that becomes `directory` whole or not at all (collective):
    the main process names it, every stage writes its shard, the main process publishes it."""
    import torch.distributed as dist

    from fulltune.storage import atomic_dir

    where: list[Any] = [None]
    if dist.get_rank() == 0:
        with atomic_dir(directory) as tmp:
            where[0] = str(tmp)
            dist.broadcast_object_list(where, src=0)
            export_stage(stage, tmp, tokenizer)
    else:
        dist.broadcast_object_list(where, src=0)
        export_stage(stage, Path(where[0]), tokenizer)
    dist.barrier()  # published before any process reports the model
