"""Each kind of parallelism's runtime half: how the trainer applies it to a model over its mesh (torchtitan's
`parallelize_llama`), keyed by the kinds of fulltune/memory/parallelism.py and dispatched once (`apply`).

    kind              apply(model, dims, ...)                                   the model it is given
    one process       nothing: accelerate places the model                      loaded whole
    ddp               nothing here: accelerate's prepare wraps it in DDP        loaded whole
    fsdp              FSDP2 over the processes (`sharding.shard_model`)          built empty, read into shards
    tensor parallel   the TP plan per block, then FSDP2 over "dp"                built empty, read into shards
                      (`parallel.apply`)
    pipeline stages   nothing here: the trainer cuts the process's stage and     loaded whole
                      shards or replicates it over its dp processes
                      (`pipeline_parallel.PipelineRun.create`)
    context parallel  its attention over the "cp" group (`context_parallel.     as its data-parallel kind
                      ContextParallel.install`: Ulysses, or ring attention
                      on CUDA), then its data-parallel kind's: FSDP2 over
                      dp × cp, or DDP (accelerate's prepare, over them all)

`sharded_load(dims)`: whether the rank's kind builds the model empty and reads only its own shards
(`sharding.load_sharded_model`, which calls `apply` between the levers and the read); a kind over data parallel
that does not say (context parallel) loads as its data-parallel kind does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fulltune.degrees import ParallelDims
from fulltune.memory import parallelism
from fulltune.runtime import parallel, sharding


@dataclass(frozen=True)
class Runtime:
    """A kind's runtime half: `apply(model, dims, device, mixed_precision, offload)` in place, and whether the model
    is built empty and read into its shards (`sharded_load`)."""

    apply: Callable[[Any, ParallelDims, str, str, bool], Any]
    sharded_load: bool | None = False  # None: as the data-parallel kind under it


def _as_loaded(model: Any, dims: ParallelDims, device: str, mixed_precision: str, offload: bool) -> Any:
    return model


def _fsdp(model: Any, dims: ParallelDims, device: str, mixed_precision: str, offload: bool) -> Any:
    return sharding.shard_model(model, device=device, mixed_precision=mixed_precision, offload=offload)


def _tensor_parallel(model: Any, dims: ParallelDims, device: str, mixed_precision: str, offload: bool) -> Any:
    if offload:
        raise ValueError("FSDP's CPU offload does not combine with tensor parallel here")
    return parallel.apply(model, dims, device, mixed_precision)


def _context_parallel(model: Any, dims: ParallelDims, device: str, mixed_precision: str, offload: bool) -> Any:
    import torch.distributed as dist

    from fulltune.runtime.context_parallel import ContextParallel

    mesh = dims.mesh(device)
    method = dims.context_method(int(model.config.num_attention_heads))
    ContextParallel(mesh["cp"], dims.cp, dims.cp_rank(dist.get_rank()), method).install(model)
    data_parallel = parallelism.kinds_of(dims)[0]
    return RUNTIME[data_parallel.name].apply(model, dims, device, mixed_precision, offload)


RUNTIME = {
    parallelism.ONE_PROCESS.name: Runtime(_as_loaded),
    parallelism.DDP.name: Runtime(_as_loaded),
    parallelism.FSDP.name: Runtime(_fsdp, sharded_load=True),
    parallelism.TENSOR_PARALLEL.name: Runtime(_tensor_parallel, sharded_load=True),
    parallelism.PIPELINE.name: Runtime(_as_loaded),
    parallelism.CONTEXT_PARALLEL.name: Runtime(_context_parallel, sharded_load=None),
}


def runtime(dims: ParallelDims) -> Runtime:
    """The runtime half of the rank's kind (`parallelism.rank_kind_of`)."""
    return RUNTIME[parallelism.rank_kind_of(dims).name]


def apply(model: Any, dims: ParallelDims, device: str, mixed_precision: str = "no", offload: bool = False) -> Any:
    """Apply the rank's kind of parallelism to `model` in place (after the levers, before the optimizer)."""
    return runtime(dims).apply(model, dims, device, mixed_precision, offload)


def row_share(dims: ParallelDims) -> Any:
    """This process's share of each row's positions, the `context_parallel.ContextParallel` that `apply` installed
    (it splits each batch); None where the processes keep whole rows."""
    if not dims.cp_enabled:
        return None
    from fulltune.runtime.context_parallel import active

    return active()


def sharded_load(dims: ParallelDims) -> bool:
    """Whether the rank's kind builds the model empty and reads only its shards (`sharding.load_sharded_model`)."""
    loads = runtime(dims).sharded_load
    return RUNTIME[parallelism.kinds_of(dims)[0].name].sharded_load is True if loads is None else loads
