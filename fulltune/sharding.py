"""Fully sharded data parallel training (FSDP2) of Hugging Face causal LMs, on CPU and on CUDA.

`distributed.strategy: fsdp` shards parameters, gradients and optimizer states over the processes with
PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`): every parameter becomes a DTensor holding
1/N of it (dim-0 shard), a decoder layer's full parameters are all-gathered just before its forward
and backward and freed after, and gradients are reduce-scattered (averaged over processes) as soon as
a layer's backward is done. One code path serves both devices: gloo on CPU, NCCL on CUDA; the device
mesh takes the default process group that torchrun + Accelerate (or `init_process_group`) started.

Why fulltune drives FSDP2 itself instead of `accelerator.prepare`: Accelerate's CPU multi-process mode
(MULTI_CPU) is DDP only, and on CUDA its FSDP plugin toggles `set_requires_gradient_sync(False)` on
every non-final micro-batch, which keeps a full, unsharded fp32 gradient of the whole model between
micro-batches. Here the model and optimizer are left out of `prepare` (Accelerate still provides the
process group, `backward`, `accumulate`, `reduce` and the RNG / scheduler state of checkpoints), so the
same loop runs under `torchrun` on CPU and CUDA and gradients stay sharded while accumulating.

    model = load_model(...)                       # full model on every process, fp32, on the CPU
    shard_model(model, device="cpu", mixed_precision="bf16")   # embedding, layers, head, root
    optimizer = AdamW(model.parameters(), fused=True)          # built after sharding: DTensor states
    ...  forward / backward as usual  ...
    norm = clip_grad_norm_(model, 1.0)            # global norm over all shards, a plain tensor
    save_sharded_state(ckpt / SHARDED_STATE_DIR, model, optimizer)    # collective, each rank its shard
    load_sharded_state(ckpt / SHARDED_STATE_DIR, model, optimizer)    # collective
    save_pretrained(model, out_dir, tokenizer)    # collective; rank 0 writes a normal HF checkpoint

Precision: with `mixed_precision="bf16"` the sharded (master) parameters, gradients and optimizer
states stay fp32; FSDP all-gathers the parameters in bf16 and runs the forward and backward in bf16
(MixedPrecisionPolicy), reduce-scatters gradients in fp32. No autocast is involved. fp16 is refused:
it needs a sharded gradient scaler, which fulltune does not drive.

Gradient accumulation keeps the gradient sync on (one reduce-scatter per micro-batch): the gradients
then stay sharded (4·P/N bytes), which is what the memory planner counts. `gradient_sync(model, False)`
trades that memory (a full fp32 gradient, 4·P bytes) for communication where bandwidth is scarce.

Torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from fulltune.storage import fsync_dir, fsync_tree

# Where a trainer checkpoint keeps the model and optimizer shards (torch.distributed.checkpoint files).
SHARDED_STATE_DIR = "sharded"
EXTRA_STATE_FILE = "extra_state.json"
MIXED_PRECISIONS = ("no", "bf16")


def init_process_group(device: str) -> None:
    """Start the default process group from torchrun's environment if nobody has (gloo / NCCL).

    Accelerate starts it already inside the trainer; this is for scripts that run without it.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")


def device_mesh(device: str) -> Any:
    """A 1-D mesh over all processes of the default process group, on `device` ("cpu" or "cuda")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("FSDP needs a process group: run under torchrun (or call init_process_group)")
    return init_device_mesh(device, (dist.get_world_size(),))


def mixed_precision_policy(mixed_precision: str) -> Any:
    """FSDP2's policy for fulltune's `train.mixed_precision`: bf16 compute, fp32 master weights and
    fp32 gradient reduction; `no` computes in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"FSDP supports mixed_precision {' or '.join(MIXED_PRECISIONS)}, got {mixed_precision!r} "
                         "(fp16 would need a sharded gradient scaler; use bf16)")
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: Any, device: str = "cpu", mixed_precision: str = "no", mesh: Any = None,
                reshard_after_forward: bool = True) -> Any:
    """Shard `model` in place with FSDP2 and return it (its class becomes FSDP<cls>).

    Units, as torchtitan cuts them: the input embedding, each decoder layer, the output head (the two
    only when untied: a tied matrix belongs to one unit, the root's), then the root (final norm and
    whatever is left). A unit's full parameters exist only while it computes, so a large vocabulary's
    embedding is not held through the layers. The head keeps its gathered weights from its forward to
    its backward, which follows immediately (one all-gather instead of two).

    Call it after gradient checkpointing and the TargetHead hook are installed and before the optimizer
    is built: the parameters are replaced by DTensor shards (moved to the mesh's device). Every process
    must hold the same initial weights (load the same checkpoint, or seed before `from_config`).

    `reshard_after_forward=True` frees each layer's gathered parameters after its forward and gathers
    them again in backward (ZeRO-3); False keeps them until backward (ZeRO-2-like, more memory).
    """
    from torch.distributed.fsdp import fully_shard

    from fulltune.memory.checkpointing import decoder_layers

    mesh = mesh if mesh is not None else device_mesh(device)
    options = {"mesh": mesh, "mp_policy": mixed_precision_policy(mixed_precision)}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    if not tied:
        fully_shard(embedding, reshard_after_forward=reshard_after_forward, **options)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    if head is not None and not tied:
        fully_shard(head, reshard_after_forward=False, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    return model


def _unwrap(model: Any) -> Any:
    """The module under torch.compile's wrapper (its state dict keys would carry `_orig_mod.`)."""
    return getattr(model, "_orig_mod", model)


def is_sharded(model: Any) -> bool:
    """Whether `model` (or the module torch.compile wrapped) was sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(_unwrap(model), FSDPModule)


def gradient_sync(model: Any, enabled: bool) -> None:
    """Reduce-scatter gradients after this backward (True, the default) or accumulate them unsharded
    on every process until a backward with sync on (False: saves communication, costs 4·P bytes)."""
    _unwrap(model).set_requires_gradient_sync(enabled)


def clip_grad_norm_(model: Any, max_norm: float) -> Any:
    """Clip the gradients of all shards to a global L2 norm of `max_norm`; returns that norm before
    clipping as a plain (replicated) 0-d tensor, the same value on every process.

    `torch.nn.utils.clip_grad_norm_` handles DTensor gradients (the norm's reduction over shards is a
    DTensor collective; torch 2.13); its result is a replicated DTensor, which the trainer cannot mix
    with plain tensors, hence `full_tensor()`.
    """
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(_unwrap(model), optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded_state(directory: str | Path, model: Any, optimizer: Any) -> None:
    """Write the model and optimizer shards of every process into `directory` (collective).

    torch.distributed.checkpoint: one file per process plus `.metadata`, loadable by another number of
    processes. Not atomic by itself: write into a temporary directory that is renamed afterwards (the
    trainer's step checkpoints are), or use `save_sharded_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=str(directory))


def load_sharded_state(directory: str | Path, model: Any, optimizer: Any) -> None:
    """Load what `save_sharded_state` wrote into the sharded `model` and its `optimizer` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # get_state_dict creates the optimizer's states (a zero-lr step) when it has none yet, so the
    # loader knows every tensor to fill.
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(_unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def save_sharded_checkpoint(directory: str | Path, model: Any, optimizer: Any,
                            extra_state: dict[str, Any] | None = None) -> None:
    """`save_sharded_state` into `.tmp-<name>` beside `directory`, then rank 0 renames it into place
    after every process has written (collective). `extra_state` (JSON) is saved by rank 0 beside it.

    A process killed at any point leaves either the previous `directory` or the new one whole, never a
    mix; leftover `.tmp-*` directories are garbage. The directory must be on storage every process sees.
    """
    directory = Path(directory)
    tmp = directory.parent / f".tmp-{directory.name}"
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        directory.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    save_sharded_state(tmp, model, optimizer)
    _barrier()
    if _is_main():
        (tmp / EXTRA_STATE_FILE).write_text(json.dumps(extra_state or {}))
        fsync_tree(tmp)
        shutil.rmtree(directory, ignore_errors=True)
        os.rename(tmp, directory)
        fsync_dir(directory.parent)
    _barrier()


def load_sharded_checkpoint(directory: str | Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """Load a `save_sharded_checkpoint` directory (collective); returns its `extra_state`."""
    directory = Path(directory)
    load_sharded_state(directory, model, optimizer)
    extra = directory / EXTRA_STATE_FILE
    return json.loads(extra.read_text()) if extra.is_file() else {}


def full_state_dict(model: Any) -> dict[str, Any]:
    """The whole model's state dict gathered on rank 0 as plain CPU tensors; `{}` on the other ranks.

    Collective: every process must call it. On an unsharded model it is the CPU state dict.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = _unwrap(model)
    if not is_sharded(model):
        return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_pretrained(model: Any, directory: str | Path, tokenizer: Any = None) -> None:
    """Write a normal Hugging Face checkpoint of a sharded (or plain) `model` to `directory` (collective).

    The full weights are gathered on rank 0 (CPU, fp32 as trained), which writes safetensors, config
    (`architectures` without the FSDP prefix: transformers strips it) and the tokenizer into a temporary
    directory renamed into place: `AutoModelForCausalLM.from_pretrained(directory)` loads it in one
    process like any single-process result. Rank 0 needs CPU memory for the whole model.
    """
    from fulltune.storage import atomic_dir

    state_dict = full_state_dict(model)
    # A tied output embedding is the input embedding's parameter under another name; the gathered copy is
    # a separate tensor, so transformers would write it twice. Keep the name a single process writes.
    unwrapped = _unwrap(model)
    kept = {name for name, _ in unwrapped.named_parameters()}
    for name, _ in unwrapped.named_parameters(remove_duplicate=False):
        if name not in kept:
            state_dict.pop(name, None)
    if _is_main():
        with atomic_dir(directory) as tmp:
            _unwrap(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    _barrier()
