"""Prefect flows: the pipeline DAG, and deployments built from pipelines.yaml."""
