"""The candidates' evaluation sharded over the processes their training used (FSDP2), in the training's launch path.

A run trained with `distributed.strategy: fsdp` (or tensor parallel) over N processes never held its weights in
one process, and its evaluation does not either: the evaluate stage writes a job beside the eval rows and starts
N processes the way training starts them (`fulltune.runtime.launch.run_sharded_evaluation`: torchrun, gloo on
CPU, NCCL on CUDA):

    evaluate_sharded_candidates([base, fine_tuned], rows, options)   # the evaluate stage (the champion: its own)
      ├─ <work_dir>/<tmp>/EVAL_JOB.json + rows.parquet
      ├─ torchrun --nproc_per_node N -m fulltune.evaluation.sharded EVAL_JOB.json
      │    each rank, one candidate after another, each freed before the next loads: load_sharded_model (its
      │    1/N of the weights, in the trained dtype; every unit resharded after its forward) → its share of
      │    the loss batches → its share of the generation batches → all-reduce of the loss sums and target
      │    tokens, all-gather of the generations; rank 0 writes eval-result.json
      └─ ModelMetrics per candidate (the metric functions run here, on the gathered generations)

The batches are the one-process evaluation's (`EvalOptions.batch_size`, rows in order; the rows each source
generates for, `evaluate.generation_rows`), dealt round-robin:
batch i runs on rank i mod N with the same rows, padding and gathered weights, so the loss sums and the greedy
texts are those of one process (the loss to float64 summation order). FSDP2 all-gathers a unit in every
forward, so every rank makes the same number of forward calls: a rank with fewer batches repeats its first one
and discards it, and generation runs with transformers' `synced_gpus` (a rank whose sequences ended keeps
stepping until every rank's have). lm-evaluation-harness tasks run on every rank on the same requests (the same
forwards); rank 0's results are kept. A user error in the child (error.json) is raised here as it is there.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.errors import UserError
from fulltune.evaluation.evaluate import (EvalOptions, ModelMetrics, Progress, batch_loss, generate_batch,
                                          generation_rows, loss_batches, metrics_of)

if TYPE_CHECKING:
    from fulltune.evaluation.harness import Benchmarks

EVAL_JOB_FILE = "EVAL_JOB.json"
ROWS_FILE = "rows.parquet"
EVAL_RESULT_FILE = "eval-result.json"
# The hub token of a private model reaches the child in its environment, never in EVAL_JOB.json.
TOKEN_ENV = "FULLTUNE_EVAL_HUB_TOKEN"
# The runtime modules the evaluation runs, in one process or in the training's (the evaluate stage's key hashes them):
# the loss, the launch path, FSDP2's shards, tensor parallel's and context parallel's layouts, the checkpoints.
RUNTIME_CODE = ("runtime/loss.py", "runtime/launch.py", "runtime/sharding.py", "runtime/parallel.py",
                "runtime/context_parallel.py", "runtime/checkpointing.py")
# load_model's keyword arguments the child reads (the placement is the shards', the token from TOKEN_ENV).
LOAD_KEYS = ("dtype", "revision", "trust_remote_code", "allow_pickle_weights", "attn_implementation")


@dataclass(frozen=True)
class Candidate:
    """One model to evaluate: its name in the report, checkpoint, tokenizer and `load_model` keyword arguments."""

    name: str
    model_path: str
    tokenizer_path: str
    load_kwargs: dict[str, Any]


def evaluate_sharded(model_path: str, tokenizer_path: str, rows: list[dict[str, Any]], options: EvalOptions, *,
                     load_kwargs: dict[str, Any], benchmarks: Benchmarks | None = None,
                     progress: Progress | None = None, name: str = "model") -> ModelMetrics:
    """`evaluate_model` with the model sharded over `options.processes` child processes (module docstring)."""
    candidate = Candidate(name, model_path, tokenizer_path, load_kwargs)
    return evaluate_sharded_candidates([candidate], rows, options, benchmarks, progress)[name]


def evaluate_sharded_candidates(candidates: list[Candidate], rows: list[dict[str, Any]], options: EvalOptions,
                                benchmarks: Benchmarks | None = None,
                                progress: Progress | None = None) -> dict[str, ModelMetrics]:
    """Each candidate's metrics, evaluated one after another (each freed before the next loads) in one launch
    of `options.processes` processes: the processes start once for all of them. The candidates share one hub
    token (the run's model's), or have none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fulltune.runtime.launch import run_sharded_evaluation
    from fulltune.storage import atomic_write_text

    if options.work_dir is not None:
        Path(options.work_dir).mkdir(parents=True, exist_ok=True)
    tokens = {c.load_kwargs["token"] for c in candidates if c.load_kwargs.get("token")}
    with tempfile.TemporaryDirectory(prefix="sharded-eval-", dir=options.work_dir) as directory:
        job_dir = Path(directory)
        pq.write_table(pa.Table.from_pylist(rows), job_dir / ROWS_FILE)
        job = {"candidates": [{"name": c.name, "model_path": c.model_path, "tokenizer_path": c.tokenizer_path,
                               "load": {key: c.load_kwargs[key] for key in LOAD_KEYS if key in c.load_kwargs},
                               "token": bool(c.load_kwargs.get("token")), "offload": _offloaded(c.load_kwargs)}
                              for c in candidates],
               "options": asdict(options), "harness": _harness_job(benchmarks)}
        atomic_write_text(job_dir / EVAL_JOB_FILE, json.dumps(job, indent=1))
        env = {TOKEN_ENV: tokens.pop()} if tokens else {}
        if progress is not None:
            for candidate in candidates:
                progress(f"{candidate.name}: evaluating sharded over {options.processes} processes (FSDP2)")
        result = run_sharded_evaluation(job_dir / EVAL_JOB_FILE, options.processes, progress, env)
    return {c.name: _metrics(c, result[c.name], rows, options, benchmarks, progress) for c in candidates}


def _offloaded(load_kwargs: dict[str, Any]) -> bool:
    """Whether the plan put the shards in host RAM (its placement's `max_memory`: memory/evaluation.py
    `_sharded_offloaded`): FSDP2's CPU offload, each unit copied to the GPU for its forward."""
    placement = load_kwargs.get("placement")
    return placement is not None and placement.max_memory is not None


def _metrics(candidate: Candidate, result: dict[str, Any], rows: list[dict[str, Any]], options: EvalOptions,
             benchmarks: Benchmarks | None, progress: Progress | None) -> ModelMetrics:
    """A candidate's ModelMetrics from what its child's rank 0 reported (the metric functions run here)."""
    from fulltune.models import load_tokenizer

    load = candidate.load_kwargs
    tokenizer = load_tokenizer(candidate.tokenizer_path, revision=load.get("revision"),
                               trust_remote_code=load.get("trust_remote_code", False), token=load.get("token"))
    samples = tuple(tuple(sample) for sample in result["samples"])
    sums = [(float(loss), int(tokens)) for loss, tokens in result["sums"]]
    return metrics_of(tokenizer, rows, options, sums, samples, dict(result["extra"]),  # type: ignore[arg-type]
                      benchmarks=benchmarks, progress=progress, name=candidate.name)


def _harness_job(benchmarks: Benchmarks | None) -> dict[str, Any] | None:
    """The lm-evaluation-harness part of `benchmarks` as JSON (the metric functions run in the evaluate stage)."""
    if benchmarks is None or not benchmarks.tasks:
        return None
    tasks = [{**asdict(task), "metrics": sorted(task.metrics) if task.metrics is not None else None}
             for task in benchmarks.tasks]
    return {"tasks": tasks, "limit": benchmarks.limit, "num_fewshot": benchmarks.num_fewshot,
            "batch_size": benchmarks.batch_size}


def _benchmarks(harness: dict[str, Any] | None) -> Benchmarks | None:
    from fulltune.evaluation.harness import Benchmarks, HarnessTask

    if harness is None:
        return None
    tasks = tuple(HarnessTask(**{**task, "metrics": None if task["metrics"] is None else frozenset(task["metrics"]),
                                 "higher_is_better": tuple(tuple(pair) for pair in task["higher_is_better"])})
                  for task in harness["tasks"])
    return Benchmarks(tasks, harness["limit"], harness["num_fewshot"], harness["batch_size"], (), "")


# ---------------------------------------------------------------------------------------------------
# The child: one rank of the sharded evaluation


def _dealt(batches: list[Any], rank: int, world: int) -> list[tuple[Any, bool]]:
    """Rank `rank`'s batches (i mod world), padded with its first (or the first) batch, marked not counted,
    so every rank runs ceil(len / world) of them."""
    mine = [(batch, True) for batch in batches[rank::world]]
    rounds = -(-len(batches) // world)
    while batches and len(mine) < rounds:
        mine.append((mine[0][0] if mine else batches[0], False))
    return mine


def _load(candidate: dict[str, Any], device: str) -> Any:
    """This rank's FSDP2 shards of the candidate in the evaluation's dtype (in pinned host RAM where the plan
    offloads them; CUDA only); every unit reshards after its forward (nothing stays gathered: no backward)."""
    import torch

    from fulltune.models import DTYPES
    from fulltune.runtime.sharding import load_sharded_model

    load = candidate["load"]
    dtype = getattr(torch, DTYPES[load.get("dtype") or "fp32"])
    model = load_sharded_model(candidate["model_path"], device=device, dtype=dtype, revision=load.get("revision"),
                               trust_remote_code=load.get("trust_remote_code", False),
                               allow_pickle_weights=load.get("allow_pickle_weights", False),
                               attn_implementation=load.get("attn_implementation", "sdpa"),
                               token=os.environ.get(TOKEN_ENV) if candidate["token"] else None,
                               offload=candidate.get("offload", False))
    model.set_reshard_after_forward(True)
    return model.eval()


def _loss_sums(model: Any, tokenizer: Any, rows: list[dict[str, Any]], options: EvalOptions,
               report: Any) -> list[list[float]]:
    """[summed loss, target tokens] of each source group over every rank's batches: this rank's share,
    all-reduced."""
    import torch
    import torch.distributed as dist

    from fulltune.evaluation.evaluate import source_groups
    from fulltune.runtime.loss import TargetHead

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = loss_batches(rows, options)
    totals = torch.zeros((len(source_groups(rows, options)), 2), dtype=torch.float64)
    context, data_rank, readers = _context_parallel(model, options, rank, world)
    head = TargetHead(model, chunked=options.chunked_loss)
    try:
        with torch.inference_mode():
            for done, ((index, batch), counted) in enumerate(_dealt(batches, data_rank, readers), start=1):
                loss, tokens = batch_loss(model, head, tokenizer, batch, options.device, context)
                if counted:
                    totals[index] += torch.stack([loss, torch.tensor(float(tokens), dtype=torch.float64)])
                report("loss", min(done * world * options.batch_size, len(rows)), len(rows))
    finally:
        head.remove()
        if context is not None:
            context.remove(model)
    totals = totals.to(_collective_device(options.device))
    dist.all_reduce(totals)
    return totals.cpu().tolist()


def _context_parallel(model: Any, options: EvalOptions, rank: int, world: int) -> tuple[Any, int, int]:
    """(the context parallel the plan splits each loss row's positions with, or None; this process's data rank;
    the data ranks): with `options.row_split` N the processes of a group share their batches, each keeping
    its share of the positions (fulltune/runtime/context_parallel.py, as the run trained)."""
    if options.row_split == 1:
        return None, rank, world
    from fulltune.degrees import ParallelDims
    from fulltune.runtime.context_parallel import ContextParallel

    dims = ParallelDims(world, 1, 1, "fsdp", options.row_split)
    context = ContextParallel(dims.mesh(options.device)["cp"], dims.cp, dims.cp_rank(rank))
    context.install(model)
    return context, dims.data_rank(rank), dims.dp


def _generations(model: Any, tokenizer: Any, rows: list[dict[str, Any]], options: EvalOptions,
                 report: Any) -> list[list[str]]:
    """Every generation batch's (prompt, expected, generated), in the rows' order: this rank's share of the
    batches, gathered."""
    import torch.distributed as dist

    chosen = [rows[i] for group in generation_rows(rows, options) for i in group]
    if not chosen:
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    size = options.generation_batch
    batches = [chosen[start:start + size] for start in range(0, len(chosen), size)]
    mine = []
    for done, (batch, counted) in enumerate(_dealt(batches, rank, world), start=1):
        samples = generate_batch(model, tokenizer, batch, options.max_new_tokens, options.device, synced=True)
        if counted:
            mine.append(samples)
        report("generation", min(done * world * size, len(chosen)), len(chosen))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    # Batch i is rank i mod world's (i // world)-th.
    ordered = [gathered[i % world][i // world] for i in range(len(batches))]
    return [list(sample) for batch in ordered for sample in batch]


def _collective_device(device: str) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def evaluate_rank(job: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """This rank's part of the sharded evaluation of every candidate, one after another (collective); rank 0
    returns each candidate's result by name, the others None."""
    import torch.distributed as dist

    from fulltune.models import release_memory
    from fulltune.runtime.sharding import init_process_group

    options = EvalOptions(**{**job["options"], "sources": tuple(tuple(s) for s in job["options"]["sources"])})
    init_process_group(options.device)
    results = {}
    for candidate in job["candidates"]:
        results[candidate["name"]] = _evaluate_candidate(candidate, rows, options, job["harness"])
        release_memory()  # the candidate's shards are gone before the next one's load
    return results if dist.get_rank() == 0 else None


def _evaluate_candidate(candidate: dict[str, Any], rows: list[dict[str, Any]], options: EvalOptions,
                        harness: dict[str, Any] | None) -> dict[str, Any]:
    """One candidate on this rank: loaded, its share of the loss and generation batches, the harness tasks."""
    import torch.distributed as dist

    from fulltune.evaluation.evaluate import Reporter, check_ids_fit
    from fulltune.models import load_tokenizer

    load = candidate["load"]
    tokenizer = load_tokenizer(candidate["tokenizer_path"], revision=load.get("revision"),
                               trust_remote_code=load.get("trust_remote_code", False),
                               token=os.environ.get(TOKEN_ENV) if candidate["token"] else None)
    model = _load(candidate, options.device)
    check_ids_fit(model, rows, candidate["model_path"], candidate["tokenizer_path"])
    main = dist.get_rank() == 0
    report = Reporter(lambda line: print(line, flush=True) if main else None, candidate["name"])
    sums = _loss_sums(model, tokenizer, rows, options, report)
    samples = _generations(model, tokenizer, rows, options, report)
    benchmarks = _benchmarks(harness)
    extra = {}
    if benchmarks is not None:
        import torch

        # In inference mode like the loss and the generations: FSDP2 keeps the all-gather buffers it made there
        # (inference tensors), and lm-evaluation-harness's own no_grad would write them outside it, which torch
        # refuses ("Inplace update to inference tensor outside InferenceMode").
        with torch.inference_mode():
            extra = benchmarks.on_model(model, tokenizer, options.device)
    del model
    return {"sums": sums, "samples": samples, "extra": extra}


def main(argv: list[str] | None = None) -> int:
    """`torchrun … -m fulltune.evaluation.sharded EVAL_JOB.json`: 0 done (rank 0 wrote eval-result.json),
    2 a user error (error.json beside the job)."""
    import pyarrow.parquet as pq

    from fulltune.logs import quiet_known_noise
    from fulltune.runtime.launch import ERROR_FILE, watch_launcher
    from fulltune.storage import atomic_write_text

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fulltune.evaluation.sharded EVAL_JOB.json", file=sys.stderr)
        return 2
    job_file = Path(args[0])
    watch_launcher()
    quiet_known_noise()
    try:
        job = json.loads(job_file.read_text())
        result = evaluate_rank(job, pq.read_table(job_file.parent / ROWS_FILE).to_pylist())
    except UserError as exc:
        message = " ".join(str(exc).split())
        if int(os.environ.get("RANK", "0")) == 0:
            atomic_write_text(job_file.parent / ERROR_FILE, json.dumps({"type": type(exc).__name__, "message": message}))
        print(f"fulltune evaluate: error: {message}", file=sys.stderr, flush=True)
        return 2
    if result is not None:
        atomic_write_text(job_file.parent / EVAL_RESULT_FILE, json.dumps(result))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
