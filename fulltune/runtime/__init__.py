"""The training runtime: the child process (`python -m fulltune.runtime.train JOB.json`), its one step, the
optimizers, the loss head, the levers' runtime (checkpointing, offload), parallelism (FSDP2, tensor and
pipeline parallel, rendezvous), sharded checkpoints and export, the launcher that starts it all, and the
measurement of a run's resident memory (`measure`).
Importing this package imports nothing heavy; each module imports torch where it needs it."""
