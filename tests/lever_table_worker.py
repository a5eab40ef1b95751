"""Train each train job of a list for a few optimizer steps through the trainer's own setup and step, one after
another in this process (or in each process of a torchrun group), for tests/test_lever_table.py.

    python tests/lever_table_worker.py JOBS.json OUT.json
    torchrun --standalone --nproc_per_node 2 tests/lever_table_worker.py JOBS.json OUT.json

JOBS.json: a list of TrainJob JSON texts. OUT.json (rank 0): one entry per job, {"losses": [...], "moved": bool
(the weights changed), "schedule": the pipeline schedule's class or null} or {"error": "..."}; a job that fails
is recorded and the next one runs. Accelerate's state is process-wide, so it is reset between jobs (the process
group stays).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def train_briefly(job_text: str, steps: int = 2) -> dict:
    import torch
    from accelerate.state import AcceleratorState

    from fulltune.runtime import sharding
    from fulltune.runtime.launch import TrainJob, validate_job
    from fulltune.runtime.train import setup, train_step

    AcceleratorState._reset_state(reset_partial_state=False)
    job = TrainJob.from_json(job_text)
    validate_job(job)
    run = setup(job)
    parameter = next(p for p in run.model.parameters() if p.ndim == 2)
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    before = local.detach().float().clone()
    losses = []
    for step in range(steps):
        rows = run.schedule.step_rows(step)
        outcome = train_step(run, rows, step + 1)
        losses.append(float(outcome.loss_sum) / outcome.targets)
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    moved = not torch.equal(before, local.detach().float())
    run.head.remove()
    remove = getattr(getattr(run.optimizer, "optimizer", run.optimizer), "remove", None)
    if remove is not None:
        remove()  # the lever wrappers' gradient hooks
    if sharding.is_sharded(run.model):
        run.accelerator.wait_for_everyone()
    schedule = type(run.pipeline.schedule).__name__ if run.pipeline is not None else None
    return {"losses": losses, "moved": moved, "schedule": schedule}


def main() -> None:
    import torch.distributed as dist

    jobs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    results = []
    for text in jobs:
        try:
            results.append(train_briefly(text))
        except Exception as exc:  # one combination's failure is this test's finding, not the end of the run
            results.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)})
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
