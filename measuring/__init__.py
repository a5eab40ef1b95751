"""The measuring harness of the memory tests and benchmarks: real training runs measured against the memory
model's estimates. Outside the engine (nothing in `fulltune/` imports it); the tests (`pytest` puts the repository
root on the path) and the benchmarks (`python -m benchmarks.<name>`, from the root) import it alike.

- `measure`: a training run's resident memory measured from a fresh process, per phase or per rank; the torchrun
  driver that gathers several ranks' results.
- `rank_memory`: FSDP, tensor-parallel and pipeline ranks' real steps (and the FSDP export) under torch's memory
  trackers, against the per-rank estimates.
- `memory_runs`: the models, rows and jobs those runs train, and the evaluate stage they measure.
"""
