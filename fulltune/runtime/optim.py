"""The optimizer, and the levers that change where its memory goes: one builder for trainer and memory trace.

    build_optimizer(model_or_params, name, lr=..., weight_decay=..., pure_bf16=..., optimizer_in_backward=...,
                    offload_optimizer=..., gradient_accumulation_steps=..., max_grad_norm=..., fake=...)
    optimizer_for(model, settings, lr=..., ...)   # the same, with a plan's optimizer and levers

Each optimizer (`name`) is a record of fulltune/optimizers.py (its states, what refuses it) and a builder here
(`BUILDERS`: its update, given parameter groups, a learning rate and a compensation).

Levers (each composes with every optimizer, except where its record or `check_levers` says otherwise; how they
combine with each other and with the strategy is fulltune/levers.py):

- `pure_bf16`: the weights and gradients are bf16 and there is no fp32 master copy (2 + 2 B/param
  instead of 4 + 4). A bf16 weight cannot hold an update smaller than 1/256 of itself, so plain
  updates are lost late in training; the update is compensated instead (`compensation`, offered per optimizer
  by its record):
    kahan                torch-optimi AdamW with `kahan_sum`: a bf16 buffer keeps what rounding dropped
                         and adds it back next step (+2 B/param; states bf16: 2 + 2 + 2 = 6 B/param).
                         Chosen for `adamw` because it is pure PyTorch (CPU and CUDA, no compiler), small,
                         maintained, and its Kahan update is the AnyPrecisionAdamW one torchdistx validated.
    stochastic           torchao's low-bit AdamW with `bf16_stochastic_round`: rounding up or down with
                         the probability of the remainder keeps updates unbiased (no extra state).
                         The only compensated path for 4-bit states; it needs torch.compile.
    none                 plain rounding (as torchtune's pure-bf16 recipes, and bitsandbytes 8-bit, which
                         has no compensated update).
- `optimizer_in_backward`: each parameter is updated, and its gradient freed, as soon as its gradient is
  complete in backward (`Tensor.register_post_accumulate_grad_hook`), so at most one parameter's gradient
  is alive instead of all of them. See `InBackwardOptimizer` for what accumulation and clipping mean then.
- `offload_optimizer`: fp32 master weights, gradients and optimizer states live in host RAM and the update runs on
  the host (ZeRO-Offload's split); the device keeps only its weights. See `HostOffloadOptimizer`.

Sharded parameters (FSDP2 DTensors, `distributed.strategy: fsdp`): adamw (torch fused, or torch-optimi
Kahan in its per-parameter loop) updates each shard where it is; an optimizer whose record says `gathered`
(adafactor: whole rows and columns) runs as `GatheredOptimizer` (one gathered parameter at a time, exact to one
process).

The two wrappers are torch Optimizers (LR schedulers, Accelerate and checkpoints take them as any other)
and add `clip_grad_norm_(max_norm)`, which the trainer must call instead of `clip_grad_norm_` over the
model's parameters: their gradients are not on the parameters when the step comes. Under DDP their hooks
would see a gradient before data parallelism averages it; `InBackwardOptimizer` runs on FSDP2 shards, whose
hooks FSDP calls after the reduce-scatter, `HostOffloadOptimizer` on one process only (FSDP's own CPU
offload is `optimizer_for`'s choice there). Give the offloading one to
Accelerate with `prepare_optimizer(optimizer, device_placement=False)`: device placement round-trips
the state dict through the device, which would copy the fp32 masters there.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from fulltune import levers
# The byte counts live with the records and the memory model (pure arithmetic); re-exported here beside the
# optimizers that allocate them.
from fulltune.memory.optimizer_bytes import (  # noqa: F401
    device_gradient_bytes, device_state_bytes, host_bytes, optimizer_state_bytes, weight_bytes)
from fulltune.optimizers import (BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE, COMPENSATIONS, OPTIMIZERS,  # noqa: F401
                                 TORCHAO_BLOCKSIZE, TORCHAO_MIN_LOWBIT_SIZE, TORCHAO_QMAP_ENTRIES, optimizer)


# ---------------------------------------------------------------------------------------------------
# Building


def to_bf16(model: torch.nn.Module, settings: Any) -> None:
    """`train.pure_bf16` on the model (fulltune/levers.py): bf16 weights, no fp32 master copy (the optimizer
    compensates its updates). A model built in bf16 (the memory trace builds its FakeTensor model so: `model.to`
    cannot swap FakeTensor parameters) is left as it is."""
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        model.to(torch.bfloat16)


def check_levers(name: str, pure_bf16: bool = False, compensation: str | None = None,
                 offload_optimizer: bool = False) -> str:
    """The compensation that applies to `name` with these levers ("none" without pure_bf16).

    Which levers combine with each other, the strategy and the accumulation is the lever table's
    (fulltune/levers.py); this checks what the optimizer's library can do.

    Raises:
        ValueError: an unknown optimizer or compensation, or one the optimizer's library cannot do, naming
            the setting (the trainer turns it into a ConfigError).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: unknown {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    record = optimizer(name)
    if compensation is None or compensation == "auto":
        compensation = record.default_compensation
    if compensation not in COMPENSATIONS:
        raise ValueError(f"compensation: unknown {compensation!r}; expected auto or one of {', '.join(COMPENSATIONS)}")
    if not pure_bf16 or offload_optimizer:
        # fp32 weights, or fp32 masters on the host: nothing to compensate.
        return "none"
    if compensation not in record.compensations:
        raise ValueError(f"compensation: {name} offers {' or '.join(record.compensations)} with pure bf16 weights, "
                         f"not {compensation}")
    return compensation


def optimizer_for(model: torch.nn.Module, plan: Any, *, lr: float = 1e-4, weight_decay: float = 0.0,
                  max_grad_norm: float | None = 1.0, fake: bool = False) -> torch.optim.Optimizer:
    """`build_optimizer` for planned settings (`plan`, a `fulltune.memory.Settings`): its optimizer and levers.
    The trainer, the memory trace, the device check and the benchmarks build their optimizers with this.

    `offload_optimizer` on an FSDP2-sharded model is FSDP's CPU offload (fulltune/runtime/sharding.py), which already
    keeps the shards and their gradients in host RAM: the plain optimizer, built on them, steps them there."""
    from fulltune.runtime import sharding

    offload = plan.offload_optimizer and not sharding.is_sharded(model)
    return build_optimizer(model, plan.optimizer, lr=lr, weight_decay=weight_decay, pure_bf16=plan.pure_bf16,
                           compensation=plan.compensation,
                           optimizer_in_backward=plan.optimizer_in_backward, offload_optimizer=offload,
                           gradient_accumulation_steps=plan.gradient_accumulation_steps,
                           max_grad_norm=max_grad_norm, fake=fake)


def parameter_groups(model_or_params: torch.nn.Module | Iterable[Any], weight_decay: float = 0.0,
                     matrices: bool = False) -> list[dict[str, Any]]:
    """Groups with weight decay on matrices only, not on biases and norm weights (as nanoGPT and HF
    Trainer); an iterable of parameters or of groups is taken as given. `matrices` (an optimizer whose record
    says so: Muon): the decoder layers' 2-D weights in a group of their own, marked `"matrices": True`."""
    if isinstance(model_or_params, torch.nn.Module):
        params = [p for p in model_or_params.parameters() if p.requires_grad]
        if matrices:
            from fulltune.runtime.checkpointing import decoder_layers

            hidden = {id(p) for layer in decoder_layers(model_or_params) for p in layer.parameters() if p.ndim == 2}
            groups = [{"params": [p for p in params if id(p) in hidden], "weight_decay": weight_decay,
                       "matrices": True},
                      {"params": [p for p in params if p.ndim >= 2 and id(p) not in hidden],
                       "weight_decay": weight_decay},
                      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
            return [g for g in groups if g["params"]]
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    items = list(model_or_params)
    if items and isinstance(items[0], dict):
        return [dict(g) for g in items]
    return [{"params": items, "weight_decay": weight_decay}]


def build_optimizer(model_or_params: torch.nn.Module | Iterable[Any], name: str = "adamw", *, lr: float = 1e-4,
                    weight_decay: float = 0.0, pure_bf16: bool = False, compensation: str | None = None,
                    optimizer_in_backward: bool = False, offload_optimizer: bool = False,
                    gradient_accumulation_steps: int = 1, max_grad_norm: float | None = None,
                    fake: bool = False) -> torch.optim.Optimizer:
    """The optimizer the trainer steps and the memory model counts, with the levers applied: the one builder
    (`optimizer_for` calls it with a plan's settings).

    `model_or_params`: a model (weight decay on matrices only) or parameters / parameter groups.
    `pure_bf16`: the parameters are already bf16 (cast the model first); picks the compensated update.
    `optimizer_in_backward` / `offload_optimizer`: see `InBackwardOptimizer` / `HostOffloadOptimizer`; they
    register gradient hooks on the parameters, so build them on the unwrapped model before accelerator.prepare.
    `max_grad_norm` is used by `optimizer_in_backward` only (per-parameter clipping in the hook).
    `fake=True` swaps kernels that cannot run on FakeTensors (bitsandbytes, torchao) for stand-ins that
    allocate the same states (for the memory trace).

    Raises:
        ValueError: an impossible combination (see `check_levers` and fulltune/levers.py).
    """
    compensation = check_levers(name, pure_bf16, compensation, offload_optimizer)
    # Which optimizer levers combine is the lever table's (fulltune/levers.py); the memory trace's stand-ins
    # (`fake`) need no optional package installed.
    found = levers.problems(levers.Combination({"pure_bf16": pure_bf16, "optimizer_in_backward": optimizer_in_backward,
                                                "offload_optimizer": offload_optimizer}, optimizer=name),
                            installed=not fake)
    if found:
        raise ValueError("; ".join(found))
    # The model's parameter order, which clipping over all gradients sums in (as the trainer's clip does).
    order = list(model_or_params.parameters()) if isinstance(model_or_params, torch.nn.Module) else None
    groups = parameter_groups(model_or_params, weight_decay, matrices=optimizer(name).matrices)
    if optimizer(name).matrices and not any(g.get("matrices") for g in groups):
        raise ValueError(f"optimizer: {name} steps the decoder layers' 2-D matrices apart: build it from the model "
                         "(or groups marked 'matrices'), not from a list of parameters")
    if offload_optimizer:
        return HostOffloadOptimizer(groups, lambda g: _base_optimizer(name, g, lr, "none", fake), order)
    if optimizer_in_backward:
        return InBackwardOptimizer(groups, lambda g: _base_optimizer(name, g, lr, compensation, fake),
                                   accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm,
                                   skip_nonfinite=not fake)
    return _base_optimizer(name, groups, lr, compensation, fake)


# Optimizers whose kernels cannot run on FakeTensors (bitsandbytes' C code, torchao's compiled update): the memory
# trace steps `FakeStatesOptimizer` for them, which allocates their states.
_FAKE_LAYOUTS = ("adamw_8bit", "adamw_4bit")


def _base_optimizer(name: str, groups: list[dict[str, Any]], lr: float, compensation: str,
                    fake: bool) -> torch.optim.Optimizer:
    if fake and (name in _FAKE_LAYOUTS or compensation in ("kahan", "stochastic")):
        return FakeStatesOptimizer(groups, lr=lr, layout=name, compensation=compensation)
    build = BUILDERS[name]
    if optimizer(name).gathered and _has_dtensor(groups):
        return GatheredOptimizer(groups, lambda inner: build(inner, lr, compensation))
    return build(groups, lr, compensation)


def _adamw(groups: list[dict[str, Any]], lr: float, compensation: str) -> torch.optim.Optimizer:
    if compensation == "kahan":
        import optimi

        # torch AdamW's betas and eps (optimi defaults to 0.99 / 1e-6); decoupled weight decay
        # scaled by lr, as torch AdamW.
        # Sharded (DTensor) parameters: optimi's foreach path calls `_foreach_copy_`, which has no
        # DTensor sharding strategy (torch 2.13), so they take its per-parameter loop (elementwise
        # ops on local shards) and never its Triton kernel.
        sharded = _has_dtensor(groups)
        return optimi.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, kahan_sum=True,
                            foreach=not sharded, **({"triton": False} if sharded else {}))
    if compensation == "stochastic":
        return _torchao_optim()._AdamW(groups, lr=lr, bf16_stochastic_round=True)
    return torch.optim.AdamW(groups, lr=lr, fused=True)


def _adamw_8bit(groups: list[dict[str, Any]], lr: float, compensation: str) -> torch.optim.Optimizer:
    if compensation == "stochastic":
        return _torchao_optim().AdamW8bit(groups, lr=lr, bf16_stochastic_round=True)
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=lr)


def _adamw_4bit(groups: list[dict[str, Any]], lr: float, compensation: str) -> torch.optim.Optimizer:
    # torchao's 4-bit AdamW: the only maintained 4-bit optimizer that runs on CPU and CUDA; its
    # per-parameter update is torch.compile'd (one compile per parameter shape, seconds each on CPU).
    return _torchao_optim().AdamW4bit(groups, lr=lr, bf16_stochastic_round=compensation == "stochastic")


def _adafactor(groups: list[dict[str, Any]], lr: float, compensation: str = "none") -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


def _muon(groups: list[dict[str, Any]], lr: float, compensation: str) -> torch.optim.Optimizer:
    """torch Muon on the groups marked `matrices` (the decoder layers' 2-D weights), AdamW (fused) on the others,
    as one optimizer (`SplitOptimizer`). Muon's update is scaled as Moonshot's (`adjust_lr_fn="match_rms_adamw"`:
    0.2 · √max(A, B)), so its RMS matches AdamW's and the one `train.learning_rate` and `weight_decay` serve both
    (arXiv 2502.16982). On FSDP2 shards the matrices step gathered, one at a time (`GatheredOptimizer`: the
    orthogonalisation needs the whole matrix; the momentum stays sharded), AdamW on its shards in place."""
    def muon(inner: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return torch.optim.Muon(inner, lr=lr, adjust_lr_fn="match_rms_adamw")

    matrices = [g for g in groups if g.get("matrices")]
    rest = [g for g in groups if not g.get("matrices")]
    parts = []
    if matrices:
        parts.append(GatheredOptimizer(matrices, muon) if _has_dtensor(matrices) else muon(matrices))
    if rest:
        parts.append(_adamw(rest, lr, compensation))
    return parts[0] if len(parts) == 1 else SplitOptimizer(parts)


# One builder per record of fulltune/optimizers.py: the optimizer over parameter groups at a learning rate, with
# the update pure bf16 weights get (`check_levers` has checked the record offers it).
BUILDERS: dict[str, Callable[[list[dict[str, Any]], float, str], torch.optim.Optimizer]] = {
    "adamw": _adamw, "adamw_8bit": _adamw_8bit, "adamw_4bit": _adamw_4bit, "adafactor": _adafactor, "muon": _muon}
assert set(BUILDERS) == set(OPTIMIZERS), "every optimizer of fulltune/optimizers.py has a builder here"


def _has_dtensor(groups: list[dict[str, Any]]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in groups for p in group["params"])


def torchao_available() -> bool:
    """Whether torchao (4-bit states, stochastic rounding) is installed: the planner offers those only then."""
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def _torchao_optim() -> Any:
    # torchao is an optional extra (fulltune[lowbit]): once installed, transformers imports it with every
    # model it builds (its quantizer registry), which costs ~9 s per process on this CPU and logs two
    # warnings about its CUDA extensions, so the base install leaves it out.
    if not torchao_available():
        raise ValueError("optimizer: adamw_4bit and stochastic rounding need torchao; install fulltune[lowbit]")
    import torchao.optim

    return torchao.optim


class FakeStatesOptimizer(torch.optim.Optimizer):
    """Allocates the states a native-kernel optimizer allocates, without its kernels (memory trace).

    bitsandbytes runs its update through C code, torchao through torch.compile and torch-optimi reads its
    step count with `.item()`, none of which a FakeTensor allows; both update in place, block by block, so the states are all the memory they need.
    """

    def __init__(self, params: Any, lr: float = 1e-4, layout: str = "adamw_8bit", compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr})
        self.layout = layout
        self.compensation = compensation
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    def _states(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        n = p.numel()
        if self.layout == "adamw_8bit" and self.compensation != "stochastic":
            if n < BNB_MIN_8BIT_SIZE:
                return {"state1": torch.zeros_like(p, dtype=torch.float32), "state2": torch.zeros_like(p, dtype=torch.float32)}
            blocks = -(-n // BNB_BLOCKSIZE)
            if self._qmaps is None:  # bitsandbytes' two maps, shared by every parameter's state
                self._qmaps = tuple(p.new_zeros((BNB_BLOCKSIZE,), dtype=torch.float32) for _ in range(2))
            return {"state1": torch.zeros_like(p, dtype=torch.uint8), "state2": torch.zeros_like(p, dtype=torch.uint8),
                    "qmap1": self._qmaps[0], "qmap2": self._qmaps[1],
                    "absmax1": p.new_zeros((blocks,), dtype=torch.float32),
                    "absmax2": p.new_zeros((blocks,), dtype=torch.float32)}
        bits = {"adamw_8bit": 8, "adamw_4bit": 4}.get(self.layout)
        states: dict[str, torch.Tensor] = {"step": p.new_zeros((), dtype=torch.float32)}
        if self.compensation == "kahan":  # torch-optimi: its step reads a host int, which a FakeTensor has not
            states["kahan_comp"] = torch.zeros_like(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if bits and n >= TORCHAO_MIN_LOWBIT_SIZE and n % TORCHAO_BLOCKSIZE[bits] == 0:
                states[key] = p.new_zeros((n * bits // 8,), dtype=torch.uint8)
                states[key + "_scale"] = p.new_zeros((n // TORCHAO_BLOCKSIZE[bits],), dtype=torch.float32)
                states[key + "_qmap"] = p.new_zeros((TORCHAO_QMAP_ENTRIES[bits],), dtype=torch.float32)
            else:
                states[key] = torch.zeros_like(p)
        return states

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p].update(self._states(p))
                p.add_(p.grad, alpha=-float(group["lr"]))


class GatheredOptimizer(torch.optim.Optimizer):
    """An optimizer that needs whole parameters (Adafactor's rows and columns, Muon's whole matrices), over
    sharded parameters (FSDP2 DTensors), with the update one process makes.

    Adafactor's factored second moment takes row and column means of the whole gradient and clips by the
    RMS of the whole update; Muon orthogonalises the whole matrix; their states are plain tensors, which DTensor
    ops refuse to mix with shards. So `step` takes one parameter at a time: it gathers the weight, the gradient
    and the states kept sharded (`full_tensor()`), runs the unchanged inner optimizer (built by `make(groups)`)
    on a plain proxy tensor holding the whole weight, copies this process's rows back into its shard, and empties
    the proxy. Every process computes the same update from the same whole tensors, so the weights are what one
    unsharded process gets.

    Memory: a state shaped like its parameter (Muon's momentum, a vector's second moment) is kept as this
    process's shard, as the parameter is; the others whole on every process (Adafactor's row and column means of
    matrices are small). During `step`, ONE parameter's whole weight, gradient and parameter-shaped states at a
    time, beside the inner optimizer's own temporaries (its record's `sharded_step_bytes`). `step` is
    collective: every process must call it.

    `param_groups` are this optimizer's own (an LR scheduler's writes reach the inner one at each step)
    and `state` holds the states keyed by the sharded parameters, so torch.distributed.checkpoint's
    get_state_dict / set_state_dict (`fulltune.runtime.sharding.save_sharded_state`) save and restore them (the
    sharded ones as shards, the others as replicated plain tensors).
    """

    def __init__(self, groups: list[dict[str, Any]],
                 make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> None:
        self._proxies: dict[torch.Tensor, torch.Tensor] = {}
        inner_groups = []
        for group in groups:
            proxies = []
            for p in group["params"]:
                # A plain leaf on the shard's device and dtype, empty except while its parameter updates (as many
                # dimensions as the parameter: Muon takes matrices only).
                self._proxies[p] = torch.empty((0,) * p.ndim, dtype=p.dtype, device=p.device)
                proxies.append(self._proxies[p])
            inner_groups.append({**group, "params": proxies})
        self.inner = make(inner_groups)
        super().__init__(groups, self.inner.defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Update every parameter with a gradient, one gathered parameter at a time (collective)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
            for p in group["params"]:
                if p.grad is None:  # None on every process alike (FSDP reduces every gradient)
                    continue
                proxy = self._proxies[p]
                proxy.set_(p.full_tensor())
                proxy.grad = p.grad.full_tensor()
                if self.state[p]:
                    self.inner.state[proxy] = {k: v.full_tensor() if isinstance(v, DTensor) else v
                                               for k, v in self.state[p].items()}
                self.inner.step()  # only this proxy has a gradient: the others are skipped
                # Every process holds the same updated weight and states: take this one's rows, no communication.
                p.to_local().copy_(distribute_tensor(proxy, p.device_mesh, p.placements, src_data_rank=None).to_local())
                self.state[p] = {k: distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
                                 if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                                 for k, v in self.inner.state.pop(proxy).items()}
                proxy.grad = None
                proxy.set_()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, but keep the states' saved dtype (torch casts them to the parameter's,
        which would round Adafactor's fp32 means to bf16 under pure bf16)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            if i not in state_dict["state"]:
                continue
            self.state[p] = {k: v.detach().to(p.device, copy=True) if isinstance(v, torch.Tensor) else v
                             for k, v in state_dict["state"][i].items()}


class SplitOptimizer(torch.optim.Optimizer):
    """Several optimizers as one, each stepping its own parameter groups (Muon's matrices, AdamW's rest): the
    trainer, the LR schedule, Accelerate and checkpoints see one torch Optimizer. Its `param_groups` are the
    parts' own group dicts (an LR scheduler's writes reach them) and its `state` is the parts' one state, keyed by
    parameter, so `state_dict` and torch.distributed.checkpoint's get_state_dict / set_state_dict save and restore
    every part's states at once."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        super().__init__([group for part in parts for group in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """The parts' groups are this optimizer's (in order) and their states its one state."""
        groups = iter(self.param_groups)
        for part in self.parts:
            part.param_groups = [next(groups) for _ in part.param_groups]
            part.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for part in self.parts:
            part.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does (which makes new group dicts and a new state), then hand both to the parts."""
        super().load_state_dict(state_dict)
        self._share()


# ---------------------------------------------------------------------------------------------------
# Wrappers


class _GroupedWrapper(torch.optim.Optimizer):
    """A torch Optimizer over inner optimizers, whose param_groups are the inner groups themselves (so an
    LR scheduler's writes reach them) and whose state_dict holds each inner one's."""

    def __init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        super().__init__(groups, defaults)

    def _inner(self) -> list[torch.optim.Optimizer]:
        raise NotImplementedError

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers holding the states (what a memory tracker should label as optimizer states)."""
        return self._inner()

    def adopt_inner_groups(self) -> None:
        """Take the inner optimizers' parameter groups as this one's (again, after they were loaded)."""
        self.param_groups = [g for opt in self._inner() for g in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [opt.state_dict() for opt in self._inner()], **self._extra_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, inner in zip(self._inner(), state_dict["inner"], strict=True):
            opt.load_state_dict(inner)
        self.adopt_inner_groups()
        self._load_extra_state(state_dict)

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state_dict: dict[str, Any]) -> None:
        pass


class InBackwardOptimizer(_GroupedWrapper):
    """Each parameter's update runs inside backward, as soon as its gradient is complete; then the
    gradient is freed, so the device never holds more than one parameter's gradient (torchtune's
    `optimizer_in_bwd`, torchtitan's `optimizer.early_step_in_backward`).

    One inner optimizer per parameter (built by `make(groups)`), stepped from a
    `register_post_accumulate_grad_hook`. `step()` and `zero_grad()` have nothing left to do.

    Effective batch with accumulation > 1: the gradient of micro-batches 1..k-1 is added to a host buffer
    in the weight dtype (the same additions autograd's accumulation does, so the result is bit-identical),
    and the update runs in the backward of micro-batch k. It costs one weight-sized host buffer and two
    host copies per parameter per micro-batch; the planner should prefer accumulation 1 with a larger
    checkpointed micro-batch when that fits. The trainer tells which micro-batch is last with
    `set_micro_batch(index)`.

    Clipping: the global norm needs every gradient, and the first ones are already applied when the last
    arrives. Each parameter's gradient is clipped on its own to `max_grad_norm` (None: no clipping): a
    spike guard, looser than global clipping (the global norm may reach √P · max_norm for P tensors).
    `clip_grad_norm_` reports the global norm of the step's gradients, from the per-parameter norms, and
    clips nothing.

    Non-finite gradients: a parameter whose gradient has a NaN/inf is not updated (one host sync per
    parameter); the trainer should still check the loss is finite before backward.

    Sharded parameters (FSDP2, `distributed.strategy: fsdp`): FSDP2 calls each sharded parameter's
    post-accumulate-grad hooks right after assigning it its reduce-scattered (averaged) gradient shard
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`, on CUDA inside its post-reduce
    stream, so the update is ordered after the reduce), so the hook steps the shard with the gradient every
    process agrees on and frees it. Trained on CPU (gloo) only so far.
    The clipping norm is the whole parameter's (reduced over the shards), so the update is one process's.
    Under DDP the hooks see each process's own gradient before the all-reduce: not supported there.
    """

    steps_in_backward = True  # its states are the inner optimizers' (fulltune/runtime/sharding.py saves those)

    def __init__(self, groups: list[dict[str, Any]], make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 accumulation_steps: int = 1, max_grad_norm: float | None = None, skip_nonfinite: bool = True) -> None:
        super().__init__(groups, {})
        self.accumulation_steps = accumulation_steps
        self.skip_nonfinite = skip_nonfinite  # off under FakeTensorMode, where no value can be read
        self.max_grad_norm = max_grad_norm
        self.last_micro_batch = True
        self.skipped = 0  # parameter updates skipped for a non-finite gradient
        self._optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._norm_sq: torch.Tensor | None = None
        self._handles = []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self._optimizers[p] = make([{"params": [p], **options}])
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
        self.adopt_inner_groups()

    def _inner(self) -> list[torch.optim.Optimizer]:
        return list(self._optimizers.values())

    def set_micro_batch(self, index: int) -> None:
        """Before the backward of micro-batch `index` (0-based) of the optimizer step."""
        self.last_micro_batch = index == self.accumulation_steps - 1

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        buffer = self._buffers.pop(p, None)
        if not self.last_micro_batch:
            # Park the partial sum on the host; the device gradient is freed.
            host = p.grad.to("cpu", copy=True) if buffer is None else buffer.add_(p.grad.to("cpu"))
            self._buffers[p] = host
            p.grad = None
            return
        if buffer is not None:
            p.grad = buffer.to(p.device, non_blocking=True).add_(p.grad)
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        if hasattr(norm, "full_tensor"):
            # FSDP2: the gradient is this process's shard of the reduce-scattered gradient; its norm is reduced
            # over the shards (one small all-reduce per parameter, in the same order on every process), so the
            # clip factor and the skip decision are the whole parameter's, the same on every process.
            norm = norm.full_tensor()
        self._norm_sq = norm.square() if self._norm_sq is None else self._norm_sq + norm.square()
        if self.skip_nonfinite and not bool(torch.isfinite(norm)):  # Sync point (per parameter)
            self.skipped += 1
        else:
            if self.max_grad_norm is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grad.mul_(torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0).to(grad.dtype))
            self._optimizers[p].step()
        p.grad = None

    def clip_grad_norm_(self, max_norm: float | None = None) -> torch.Tensor:
        """The global gradient norm of the last optimizer step (already applied: nothing is clipped here)."""
        norm_sq = self._norm_sq if self._norm_sq is not None else torch.zeros(())
        return norm_sq.sqrt()

    def step(self, closure: Any = None) -> None:
        """Nothing: every parameter was updated in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing on the device (gradients are freed in backward); drops a partly accumulated host sum
        and the step's gradient norm."""
        self._buffers.clear()
        self._norm_sq = None

    def remove(self) -> None:
        """Unhook the parameters (the optimizer steps no more)."""
        for handle in self._handles:
            handle.remove()


class HostOffloadOptimizer(_GroupedWrapper):
    """Optimizer states, fp32 master weights and gradients in host RAM; the update runs on the host.

    Each device parameter has a fp32 host copy (pinned when CUDA is present) that the inner optimizer
    (built by `make(host groups)`) updates. In backward, a post-accumulate-grad hook adds each gradient
    into the host copy's fp32 `.grad` and frees the device gradient, so accumulation over micro-batches,
    global-norm clipping (`clip_grad_norm_`, on the host gradients) and skipping a non-finite step mean
    what they mean without offload. `step()` updates the masters and copies them into the device weights
    (rounded to bf16 when the device weights are bf16: the fp32 master keeps the small updates, so pure
    bf16 weights need no compensation with offload).

    torchao's CPUOffloadOptimizer does the same on CUDA only and keeps the host copy in the device dtype
    (no fp32 master under bf16 weights); this one runs on any device, which the CPU tests exercise
    (there every copy is a host-to-host copy). The cost is the host update (CPU AdamW speed) and
    2 × 4 B/param of host traffic per step plus the gradient copies per micro-batch.
    """

    def __init__(self, groups: list[dict[str, Any]], make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 order: list[torch.Tensor] | None = None) -> None:
        super().__init__(groups, {})
        pin = torch.cuda.is_available()
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._host: dict[torch.Tensor, torch.Tensor] = {}
        host_groups, self._handles = [], []
        for group in groups:
            host_params = []
            for p in group["params"]:
                host = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                host.copy_(p.detach())
                self._pairs.append((p, host))
                self._host[p] = host
                host_params.append(host)
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
            host_groups.append({**group, "params": host_params})
        self.host_optimizer = make(host_groups)
        self.adopt_inner_groups()
        if order is not None:  # norms sum in the model's order, so clipping matches clip_grad_norm_ bit for bit
            position = {id(p): i for i, p in enumerate(order)}
            self._pairs.sort(key=lambda pair: position[id(pair[0])])

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [self.host_optimizer]

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        host = self._host[p]
        if host.grad is None:
            host.grad = p.grad.to("cpu", torch.float32, copy=True)
        else:
            host.grad.add_(p.grad.to("cpu", torch.float32))
        p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the host gradients to a global norm of `max_norm`; returns the norm before clipping."""
        grads = [host for _, host in self._pairs if host.grad is not None]
        if not grads:
            return torch.zeros(())
        return torch.nn.utils.clip_grad_norm_(grads, max_norm)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Update the host masters and copy them into the device weights."""
        self.host_optimizer.step()
        for p, host in self._pairs:
            p.copy_(host, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.host_optimizer.zero_grad(set_to_none=True)

    def _extra_state(self) -> dict[str, Any]:
        # The masters are the weights' full-precision truth: without them a resumed bf16 run would differ.
        return {"masters": [host.clone() for _, host in self._pairs]}

    @torch.no_grad()
    def _load_extra_state(self, state_dict: dict[str, Any]) -> None:
        for (p, host), saved in zip(self._pairs, state_dict["masters"], strict=True):
            host.copy_(saved)
            p.copy_(host)

    def remove(self) -> None:
        """Unhook the parameters."""
        for handle in self._handles:
            handle.remove()
