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

    model = load_sharded_model(path, device="cpu", mixed_precision="bf16", before_shard=levers)
                                                  # meta model, levers, shards, each process reads its own
    # or, for a model already in memory (built from a config): shard_model(model, device=..., ...)
    optimizer = AdamW(model.parameters(), fused=True)          # built after sharding: DTensor states
    ...  forward / backward as usual  ...
    norm = clip_grad_norm_(model, 1.0)            # global norm over all shards, a plain tensor
    save_sharded_state(ckpt / SHARDED_STATE_DIR, model, optimizer)    # collective, each rank its shard
    load_sharded_state(ckpt / SHARDED_STATE_DIR, model, optimizer)    # collective
    save_pretrained(model, out_dir, tokenizer)    # collective; rank 0 writes a normal HF checkpoint, file by file

Exporting: `save_pretrained` streams too: one safetensors file's tensors at a time are gathered and written,
so rank 0 holds at most `EXPORT_SHARD_BYTES` of gathered weights (or the largest tensor), never the model.

Loading: `load_sharded_model` never materialises the whole model in a process (a 70B model is 280 GB
of fp32 weights: loading it whole in each of 8 processes on one host needs 2.2 TB of host RAM). Every
process builds it on the meta device, the levers that must precede sharding are applied, it is sharded,
and each process reads its shards' slices from the safetensors files; see its docstring for the fallback.

Precision: with `mixed_precision="bf16"` the sharded (master) parameters, gradients and optimizer
states stay fp32; FSDP all-gathers the parameters in bf16 and runs the forward and backward in bf16
(MixedPrecisionPolicy), reduce-scatters gradients in fp32. No autocast is involved. fp16 is refused:
it needs a sharded gradient scaler, which fulltune does not drive.

CPU offload (`train.offload_optimizer` under `strategy: fsdp`, CUDA only): FSDP2's
`CPUOffloadPolicy(pin_memory=True)` keeps every sharded parameter and gradient in pinned host RAM, so
the optimizer (built on those shards) keeps its states there and steps on the host; the device holds
only the unit being gathered, its unsharded gradients and the activations — what torchtune's 70B full
fine-tune at 13.9 GiB per GPU runs. Each unit's shard is copied host-to-device before its all-gather and
its reduce-scattered gradient device-to-host after. The global gradient norm is then a reduction of host
tensors, which NCCL cannot do: the process group needs a gloo backend for CPU tensors beside NCCL
(`init_process_group("cuda", cpu_offload=True)`, as torchtune's recipe starts it). The policy refuses to
run without an accelerator, so on CPU only the wiring and the memory model are exercised.

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
from typing import Any, Callable

from fulltune.memory.process import EXPORT_SHARD_BYTES
from fulltune.storage import fsync_dir, fsync_tree

# Where a trainer checkpoint keeps the model and optimizer shards (torch.distributed.checkpoint files).
SHARDED_STATE_DIR = "sharded"
EXTRA_STATE_FILE = "extra_state.json"
MIXED_PRECISIONS = ("no", "bf16")


def init_process_group(device: str, cpu_offload: bool = False) -> None:
    """Start the default process group from torchrun's environment if nobody has (gloo / NCCL).

    `cpu_offload` on CUDA: NCCL for device tensors and gloo for host ones (the sharded gradients whose
    norm is reduced on the host under `CPUOffloadPolicy`). Accelerate starts a plain NCCL group inside the
    trainer unless one exists, so the trainer calls this first when it offloads.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        backend = "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank))
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


def offload_policy(offload: bool) -> Any:
    """FSDP2's offload policy for `train.offload_optimizer`: sharded parameters, gradients (and so the
    optimizer's states) in pinned host RAM; pinned so the per-unit host↔device copies are asynchronous
    and overlap compute. No offload: the default policy (everything on the mesh's device)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()


def shard_model(model: Any, device: str = "cpu", mixed_precision: str = "no", mesh: Any = None,
                reshard_after_forward: bool = True, offload: bool = False) -> Any:
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
    `offload=True` (CUDA only): every unit's shards live in pinned host RAM (`offload_policy`); a model
    built on the meta device is then materialised by `load_sharded_model`, which places them there.
    """
    from torch.distributed.fsdp import fully_shard

    from fulltune.runtime.checkpointing import decoder_layers

    mesh = mesh if mesh is not None else device_mesh(device)
    # Every unit gets the same policies: FSDP2 moves a unit's shards per its own policy, and a unit left
    # on the device would keep its fp32 shard and AdamW states there.
    options = {"mesh": mesh, "mp_policy": mixed_precision_policy(mixed_precision),
               "offload_policy": offload_policy(offload)}
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


# How a checkpoint is read (`fulltune.models.load_model`'s options), passed through by `load_sharded_model`.
SOURCE_OPTIONS = ("revision", "token", "trust_remote_code", "allow_pickle_weights", "attn_implementation")


def load_sharded_model(path: str | Path, *, device: str = "cpu", mixed_precision: str = "no", dtype: Any = None,
                       before_shard: Callable[[Any], None] | None = None,
                       shard: Callable[[Any], Any] | None = None, offload: bool = False, **source: Any) -> Any:
    """Load a Hugging Face causal LM straight into FSDP2 shards: no process ever holds the full model
    (except rank 0 in the fallback below). Collective: every process calls it with the same arguments.

    1. The model is built from its config with its parameters on the meta device (no memory); buffers
       are built for real, so non-persistent ones (rotary `inv_freq`) keep their computed values.
    2. `before_shard(model)` applies what must precede sharding: gradient checkpointing, the TargetHead
       hook, a pure-bf16 cast (`model.to(torch.bfloat16)` on meta parameters is free).
    3. `shard(model)`, the run's kind of parallelism (`fulltune.runtime.parallelize.apply`: FSDP2, or tensor
       parallel's plan and FSDP over its "dp" mesh), by default `shard_model` (the same units as for a loaded
       model); then `to_empty` on the mesh's device: each process allocates its own shards only, and the
       buffers get their values back.
    4. Each process reads only its shards' slices from the checkpoint's safetensors files
       (`torch.distributed.checkpoint.HuggingFaceStorageReader`), converting to the parameters' dtype
       (a bf16 checkpoint becomes fp32 masters; fp32 becomes bf16 under pure bf16, rounded as `.to()` does).
       Checkpoints that reader cannot serve — `pytorch_model.bin`, or tensor names transformers renames or
       fuses while loading — are loaded whole by rank 0 (`fulltune.models.load_model`, in the parameters'
       dtype) and broadcast shard by shard (`set_model_state_dict(broadcast_from_rank0=True)`).

    The result equals `load_model` + `before_shard` + `shard_model` bit for bit. Tied embeddings stay one
    parameter. `offload=True` (`train.offload_optimizer` under FSDP; CUDA only, not with tensor parallel):
    the shards are allocated in pinned host RAM and read there, the buffers go to the device. `path` is a local
    directory or a hub id. `source` is how `fulltune.models.load_model` reads the checkpoint (`SOURCE_OPTIONS`:
    `revision` and `token` resolve a hub id's snapshot, from the cache when offline). `dtype` is the weights' dtype
    before `before_shard` (default fp32). Peak host memory per process: its shards plus one checkpoint tensor's
    slice being read.

    Raises ConfigError (a user error naming model.name_or_path) when the checkpoint cannot be read.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from fulltune.attention import kernel
    from fulltune.errors import ConfigError

    unknown = sorted(set(source) - set(SOURCE_OPTIONS))
    if unknown:
        raise TypeError(f"load_sharded_model: unknown checkpoint options {unknown}")
    trust_remote_code = source.get("trust_remote_code", False)
    directory = _checkpoint_dir(str(path), source.get("revision"), source.get("token"))
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path: cannot read a model config from {str(path)!r}: {exc}") from None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32, trust_remote_code=trust_remote_code,
                                                 attn_implementation=kernel(source.get("attn_implementation", "sdpa")))
    model.tie_weights()  # transformers ties only materialised parameters when it builds a model
    if (Path(directory) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    if before_shard is not None:
        before_shard(model)
    if offload and device != "cuda":
        raise ValueError("FSDP's CPU offload needs a CUDA device (CPUOffloadPolicy refuses to run without one)")
    if shard is not None:
        shard(model)
    else:
        shard_model(model, device=device, mixed_precision=mixed_precision, offload=offload)
    _materialize(model, device, offload)
    names = _checkpoint_names(model, directory)
    if names is not None:
        _read_own_shards(model, directory, names)
    else:
        _broadcast_from_rank0(model, str(path), **source)
    return model


def _checkpoint_dir(path: str, revision: str | None, token: str | None) -> str:
    """The local directory of a checkpoint: `path` itself, or the hub snapshot of `revision` (config, code
    and safetensors files; downloaded when online and not cached)."""
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    from fulltune.errors import ConfigError

    try:
        return snapshot_download(path, revision=revision, token=token,
                                 allow_patterns=["*.json", "*.py", "*.safetensors"])
    except Exception as exc:  # noqa: BLE001 - hub errors have no common base; the message says which
        raise ConfigError(f"model.name_or_path: cannot resolve {path!r} at revision {revision or 'main'}: {exc}") from None


def _device(device: str) -> Any:
    import torch

    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def _materialize(model: Any, device: str, offload: bool = False) -> None:
    """Allocate the (sharded) meta parameters on `device`, uninitialised; buffers keep their values.

    `offload`: the parameters' shards are allocated in host RAM (FSDP2 pins them as it takes them back,
    `FSDPParam.reset_sharded_param`) and the buffers, which FSDP does not manage, go to the device."""
    import torch

    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=torch.device("cpu") if offload else _device(device))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    if offload:
        move_buffers(model, device)


def move_buffers(model: Any, device: str) -> None:
    """Move the model's buffers (rotary `inv_freq`), which FSDP does not manage, to `device`: under CPU
    offload the parameters' shards stay in host RAM while the forward runs on the device."""
    target = _device(device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(target)


def _aliases(model: Any) -> list[list[str]]:
    """Names that share one parameter (tied embeddings), each group in the model's order."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _checkpoint_names(model: Any, directory: str) -> list[str] | None:
    """The state-dict names to read from the safetensors files of `directory`, one per tensor (one name of
    a tied group); None when those files cannot serve the model as it is: no safetensors, a name missing
    (renamed or fused by transformers on load), or a name in two files."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    owner: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key in owner:
                    return None
                owner[key] = file
    if not files:
        return None
    names = set(model.state_dict())
    for group in _aliases(model):
        present = [name for name in group if name in owner] or group[:1]
        names -= set(group) - set(present[:1])
    return sorted(names) if names <= owner.keys() else None


def _read_own_shards(model: Any, directory: str, names: list[str]) -> None:
    """Each process reads its shards' slices of `names` from the safetensors files (collective)."""
    import torch.distributed.checkpoint as dcp

    state = {name: tensor for name, tensor in model.state_dict().items() if name in set(names)}
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(directory))


def _broadcast_from_rank0(model: Any, path: str, **load_kwargs: Any) -> None:
    """Rank 0 loads the whole checkpoint with transformers and sends each process its shards (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from fulltune.models import load_model

    full: dict[str, Any] = {}
    if _is_main():
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        full = load_model(path, dtype=dtype, **load_kwargs).state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


def _unwrap(model: Any) -> Any:
    """The module under torch.compile's wrapper (its state dict keys would carry `_orig_mod.`)."""
    return getattr(model, "_orig_mod", model)


def is_sharded(model: Any) -> bool:
    """Whether `model` (or the module torch.compile wrapped) is a whole model sharded with FSDP2 here. A pipeline
    stage sharded over its data-parallel processes is not: its clip, checkpoints and export are its own
    (fulltune/runtime/pipeline_parallel.py)."""
    from torch.distributed.fsdp import FSDPModule

    from fulltune.runtime.pipeline_parallel import is_stage

    unwrapped = _unwrap(model)
    return isinstance(unwrapped, FSDPModule) and not is_stage(unwrapped)


def gradient_sync(model: Any, enabled: bool) -> None:
    """Reduce-scatter gradients after this backward (True, the default) or accumulate them unsharded
    on every process until a backward with sync on (False: saves communication, costs 4·P bytes)."""
    _unwrap(model).set_requires_gradient_sync(enabled)


def clip_grad_norm_(model: Any, max_norm: float) -> Any:
    """Clip the gradients of all shards to a global L2 norm of `max_norm`; returns that norm before
    clipping as a plain (replicated) 0-d tensor, the same value on every process.

    `torch.nn.utils.clip_grad_norm_` handles DTensor gradients (the norm's reduction over shards is a
    DTensor collective; torch 2.13); its result is a replicated DTensor, which the trainer cannot mix
    with plain tensors, hence `full_tensor()`. Under tensor parallel (fulltune/runtime/parallel.py) the gradients
    have several layouts (split by rows, by columns, replicated), whose norms DTensor cannot stack: each
    layout's norm is taken apart, made a plain number, and the total formed from those.
    """
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    layouts = {(g.device_mesh, g.placements) if isinstance(g, DTensor) else None for g in (p.grad for p in params)}
    if len(layouts) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    from torch.distributed.tensor import Replicate

    groups: dict[Any, list[Any]] = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    # The factor torch's clip_grads_with_norm_ applies, as a replicated DTensor on each layout's mesh.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for key, grads in groups.items():
        factor = coef if key is None else DTensor.from_local(coef, key[0], [Replicate()] * key[0].ndim,
                                                             run_check=False)
        for grad in grads:
            grad.mul_(factor)
    return total


def _optimizers(optimizer: Any) -> Any:
    """What torch.distributed.checkpoint saves for `optimizer`: the per-parameter optimizers of a step in
    backward (`optim.InBackwardOptimizer`, whose own `state` is empty; DCP merges their states by parameter
    name, as torchtitan saves its optimizers-in-backward), else the optimizer itself."""
    inner = getattr(optimizer, "inner_optimizers", None)
    return inner() if inner is not None and getattr(optimizer, "steps_in_backward", False) else optimizer


def sharded_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """{"model", "optimizer"}: the state dicts torch.distributed.checkpoint saves and loads for a sharded model,
    each process's shards as DTensors (views of the live parameters and states, not copies)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(_unwrap(model), _optimizers(optimizer))
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded_state(directory: str | Path, model: Any, optimizer: Any) -> None:
    """Write the model and optimizer shards of every process into `directory` (collective).

    torch.distributed.checkpoint: one file per process plus `.metadata`, loadable by another number of
    processes. Not atomic by itself: write into a temporary directory that is renamed afterwards (the
    trainer's step checkpoints are), or use `save_sharded_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(model, optimizer), checkpoint_id=str(directory))


def load_sharded_state(directory: str | Path, model: Any, optimizer: Any) -> None:
    """Load what `save_sharded_state` wrote into the sharded `model` and its `optimizer` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # get_state_dict creates the optimizer's states (a zero-lr step) when it has none yet, so the
    # loader knows every tensor to fill.
    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(_unwrap(model), _optimizers(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    if _optimizers(optimizer) is not optimizer:
        optimizer.adopt_inner_groups()  # loading replaced the inner groups the LR schedule writes to


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


def save_pretrained(model: Any, directory: str | Path, tokenizer: Any = None,
                    max_shard_bytes: int = EXPORT_SHARD_BYTES) -> None:
    """Write a normal Hugging Face checkpoint of a sharded (or plain) `model` to `directory` (collective).

    Streamed from the sharded state, file by file: the tensors of one safetensors file (at most
    `max_shard_bytes`, split as `huggingface_hub.split_torch_state_dict_into_shards` splits a state dict) are
    gathered (`DTensor.full_tensor`, every process), rank 0 writes them and every process frees them before the
    next file's, so no process holds the whole model in host RAM: rank 0's peak is one file's tensors. A model
    within one file is `model.safetensors`, more is `model-0000k-of-0000n.safetensors` with its index, as
    `save_pretrained(max_shard_size=...)` writes them. Rank 0 writes the config (`architectures` without the
    FSDP class prefix), the generation config and the tokenizer into a temporary directory renamed into place:
    `AutoModelForCausalLM.from_pretrained(directory)` loads it in one process like any single-process result.
    """
    from fulltune.storage import atomic_dir

    unwrapped = _unwrap(model)
    # A tied output embedding is the input embedding's parameter under another name: written once, under the
    # name a single process writes.
    kept = {name for name, _ in unwrapped.named_parameters()}
    tied = {name for name, _ in unwrapped.named_parameters(remove_duplicate=False)} - kept
    state = {name: tensor for name, tensor in unwrapped.state_dict().items() if name not in tied}
    if not _is_main():
        _write_tensor_files(state, None, max_shard_bytes)
        _barrier()
        return
    with atomic_dir(directory) as tmp:
        _write_tensor_files(state, Path(tmp), max_shard_bytes)
        config = unwrapped.config
        config.architectures = [type(unwrapped).__name__.removeprefix("FSDP")]
        config.save_pretrained(tmp)
        if unwrapped.can_generate() and getattr(unwrapped, "generation_config", None) is not None:
            unwrapped.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    _barrier()


def _write_tensor_files(state: dict[str, Any], directory: Path | None, max_shard_bytes: int) -> None:
    """Gather each file's tensors in turn (collective) and, where `directory` is given, write them there."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    # Split by the global shapes (meta tensors: no storage, so none is taken for a shared one).
    split = split_torch_state_dict_into_shards(
        {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for name, tensor in state.items()},
        max_shard_size=max_shard_bytes)
    for filename, names in split.filename_to_tensors.items():
        if directory is None:  # another process: its part of each gather, kept no longer than the gather
            for name in names:
                _full(state[name])
            continue
        tensors = {name: _full(state[name]).detach().to("cpu").contiguous() for name in names}
        save_file(tensors, str(directory / filename), metadata={"format": "pt"})
        del tensors
    if directory is not None and split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def _full(tensor: Any) -> Any:
    """The whole tensor: a DTensor's shards gathered from every process (collective), a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
