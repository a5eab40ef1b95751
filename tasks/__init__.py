"""Prefect tasks: one per pipeline stage, thin wrappers adding cache keys, retries and artifacts."""
