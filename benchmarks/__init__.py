"""Benchmarks of fulltune: each module measures one claim of BENCHMARKS.md through the engine's public functions.

They form a package run from the repository root, `python -m benchmarks.<name> [--help]`, so that they, and
every process they start (their children run `-m benchmarks.<name>` from the root; torchrun ranks through
`benchmarks.ranks`), import this checkout's `fulltune`. From another directory `python -m benchmarks.<name>`
fails with "No module named benchmarks" (or, with the root on PYTHONPATH, works the same).
"""
