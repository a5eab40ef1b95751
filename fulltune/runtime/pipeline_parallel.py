"""Pipeline-parallel training: a causal LM's decoder layers split into stages, one process each, run by
`torch.distributed.pipelining`'s GPipe or 1F1B schedule.

    stage 0:      embed_tokens → layers[0 : L/P]                 ─ activations ─►
    stage s:      layers[s·L/P : (s+1)·L/P]                       ◄─ gradients ─
    stage P − 1:  layers[...] → norm → lm_head at the target positions → loss

The split is manual (`StageModule`: each stage holds its own slice of the model's modules) rather than
traced by `torch.distributed.pipelining.pipeline()`: transformers' decoder layers take rotary tables, masks
and keyword arguments that an export-based tracer has to follow through, while a hand-made stage only runs
the same modules in the same order as `LlamaModel.forward`. Each stage builds its own rotary tables and
causal mask from the position ids and attention mask every stage receives (they are not sent between
stages: only the residual stream is).

The loss is the trainer's (`fulltune.runtime.loss`): the output head runs only at the positions with a target, the
token losses are summed and divided by the target tokens of the whole optimizer step, so the schedule must
not scale the gradients again (`scale_grads=False`). The gradient norm is clipped over every stage's
parameters together (one all-reduce of the squared norms), as one process clips the whole model.

This runs the step; `fulltune run` does not use it yet (checkpoints, export and resume are per process
there). The memory model of a stage is `fulltune.memory.pipeline`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fulltune.runtime.loss import Targets
from fulltune.memory.pipeline import SCHEDULES, UNSUPPORTED_LEVERS, stage_layers

__all__ = ["SCHEDULES", "PipelineRun", "StageModule", "build_stage", "clip_grad_norm_"]


class StageModule(torch.nn.Module):
    """Decoder layers `[start, end)` of a Llama-layout causal LM (Llama, Mistral, Qwen2/3: `model.model.layers`,
    `embed_tokens`, `norm`, `rotary_emb`, `lm_head`), with the input embedding on the first stage and the final
    norm and output head on the last.

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
        self.first, self.last = first, last
        self.embed_tokens = body.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(body.layers[start:end])
        self.rotary_emb = body.rotary_emb  # a buffer of inverse frequencies: every stage computes its own tables
        self.norm = body.norm if last else None
        self.lm_head = model.get_output_embeddings() if last else None
        self.mixed_precision = "no"  # "bf16": the forward runs under autocast (`PipelineRun.create` sets it)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        with self._autocast():
            hidden = self.embed_tokens(x) if self.first else x
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                      cache=None, position_ids=position_ids)
            rotary = self.rotary_emb(hidden, position_ids=position_ids)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
            return self.norm(hidden) if self.last else hidden

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast around the forward only, as Accelerate and `fulltune.runtime.step.LocalAccelerator` apply it (the
        schedule runs the backward outside it)."""
        if self.mixed_precision == "bf16":
            return torch.autocast(device_type=next(self.parameters()).device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Σ of the fp32 token losses of a micro-batch: the head at the target positions (`fulltune.runtime.loss.TargetHead`)."""
        targets = Targets.from_labels(labels.cpu()).to(hidden.device)
        with self._autocast():
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets.index)
            logits = self.lm_head(rows).float()  # fp32, as Accelerate returns them under mixed precision
        return F.cross_entropy(logits, targets.tokens, reduction="sum")


def build_stage(model: torch.nn.Module, stage: int, num_stages: int) -> StageModule:
    """Stage `stage` of `num_stages` of `model`, its layers split evenly (`fulltune.memory.pipeline.stage_layers`)."""
    start, end = stage_layers(int(model.config.num_hidden_layers), num_stages)[stage]
    return StageModule(model, start, end, first=stage == 0, last=stage == num_stages - 1)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    group: Any = None) -> torch.Tensor:
    """Clip the gradients of every stage's `parameters` to a global norm `max_norm`: each stage's squared norm,
    summed over the pipeline's processes, as `torch.nn.utils.clip_grad_norm_` computes it for one model."""
    import torch.distributed as dist

    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    squared = local.float().square()
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


@dataclass
class PipelineRun:
    """One process's stage of a pipelined run: its module, optimizer and schedule.

    Every process calls `step` with the whole step's batch (B rows): the first stage feeds the token ids,
    the last computes the loss; all of them split the batch into `micro_batches` and build their masks from it.
    """

    stage: StageModule
    optimizer: torch.optim.Optimizer
    schedule: Any
    stage_index: int
    num_stages: int
    micro_batches: int
    max_grad_norm: float = 1.0
    micro_batch_shape: tuple[int, int] = (0, 0)  # (b, s) the schedule's buffers are made for
    step_targets: int = field(default=0, init=False)  # target tokens of the step being run (the loss's divisor)

    @classmethod
    def create(cls, model: torch.nn.Module, settings: Any, *, schedule: str = "1f1b", num_micro_batches: int,
               device: str = "cpu", lr: float = 1e-4, max_grad_norm: float = 1.0) -> PipelineRun:
        """This process's stage of `model` (rank r of the default process group is stage r), its optimizer
        as the trainer builds it for the planned `settings` (`fulltune.runtime.optim.optimizer_for`), and the schedule.

        Raises:
            ValueError: an unknown schedule, 1F1B with fewer micro-batches than stages, or a lever the stages do
                not run (the step in backward, the offloads, the chunked loss).
        """
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from fulltune.runtime.optim import optimizer_for

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
        refused = [name for name in (*UNSUPPORTED_LEVERS, "chunked_loss") if getattr(settings, name)]
        if refused:
            raise ValueError(f"pipeline stages do not run {', '.join(refused)}")
        rank, world = dist.get_rank(), dist.get_world_size()
        stage = build_stage(model, rank, world)
        stage.mixed_precision = settings.mixed_precision
        optimizer = optimizer_for(stage, settings, lr=lr, max_grad_norm=max_grad_norm)
        # The shapes crossing each boundary are known from the plan: given up front, the schedule needs no
        # metadata pass (an extra forward and backward of micro-batch 0 before the first step).
        b, s, h = settings.micro_batch_size, settings.seq_len, int(model.config.hidden_size)
        dtype = next(stage.parameters()).dtype  # the residual stream's: fp32 under autocast, bf16 with bf16 weights
        stream = torch.empty((b, s, h), dtype=dtype, device="meta", requires_grad=True)
        tokens = torch.empty((b, s), dtype=torch.long, device="meta")
        pipeline_stage = PipelineStage(stage, rank, world, torch.device(device),
                                       input_args=tokens if stage.first else stream, output_args=stream)
        run = cls(stage, optimizer, None, rank, world, num_micro_batches, max_grad_norm, (b, s))
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        # Every stage gets the loss function: without one a schedule runs forward only. It is called on the last.
        # The loss is already normalised by the step's target tokens: no second division by the micro-batches.
        run.schedule = kind(pipeline_stage, n_microbatches=num_micro_batches, loss_fn=run._loss, scale_grads=False)
        return run

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.stage.loss_sum(hidden, labels) / self.step_targets

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> float | None:
        """One optimizer step over the (B, s) batch: the schedule's forwards and backwards of every
        micro-batch, the global-norm clip, the optimizer step (skipped, as the trainer skips it, when the norm is
        not finite: every stage sees the same norm). Returns the step's loss per target token on the last stage
        (None on the others).

        Raises:
            ValueError: the batch is not `micro_batches` micro-batches of the shape the stage was built for.
        """
        rows, s = input_ids.shape
        b, expected = self.micro_batch_shape
        if (rows, s) != (b * self.micro_batches, expected):
            raise ValueError(f"a step takes {self.micro_batches} micro-batches of {b} × {expected} tokens: "
                             f"({b * self.micro_batches}, {expected}) rows; got {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(rows, s).contiguous()
        # Every stage knows the step's target tokens from the labels: no communication.
        self.step_targets = len(Targets.from_labels(labels.cpu()))
        kwargs: dict[str, Any] = {"position_ids": position_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.stage.first else ()
        if self.stage.last:
            self.schedule.step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
        else:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        norm = clip_grad_norm_(self.stage.parameters(), self.max_grad_norm)
        if bool(torch.isfinite(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not self.stage.last:
            return None
        return float(sum(loss.detach() for loss in losses))
