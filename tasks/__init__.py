"""Prefect tasks: one factory that makes each stage of fulltune/stages/ a task with its cache policy and retries
(`stage_task`), each stage's artifacts (`artifacts`), and what the flow asks besides (`run`)."""
