"""Cache keys re-run exactly the stages whose inputs changed, seen through the flow on real Prefect."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline, write_addition_data
from tiny import fake_hub_model, make_tokenizer

STAGES = ("tokenize", "memory-budget", "fine-tune", "evaluate", "register")
QUICK = {"train": {"max_steps": 2, "checkpoint_every_steps": 0},
         "evaluate": {"max_generate_examples": 1, "max_new_tokens": 1}}


def ran(*names: str) -> dict[str, str]:
    return {stage: "ran" if stage in names else "cached" for stage in STAGES}


def run(path: Path):
    from flows.pipeline import finetune_pipeline

    return finetune_pipeline(pipeline="tiny", pipelines_file=str(path))


@pytest.fixture(scope="module")
def local(tmp_path_factory, prefect_server) -> Path:
    """The tiny pipeline with its own eval file, run once."""
    root = tmp_path_factory.mktemp("keys")
    write_addition_data(root / "eval.jsonl", 8, seed=1)
    path = tiny_pipeline(root, data={"eval": "eval.jsonl"}, **QUICK)
    assert run(path).stages == ran(*STAGES)
    return path


@pytest.mark.slow
def test_memory_picture_is_embedded_in_the_artifact(local):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["tiny-memory-plan"])))
    markdown = artifacts[0].data
    assert "file://" not in markdown
    encoded = markdown.split("(data:image/png;base64,", 1)[1].split(")", 1)[0]
    assert base64.b64decode(encoded).startswith(b"\x89PNG")


@pytest.mark.slow
def test_eval_data_change_reevaluates_without_retraining(local):
    write_addition_data(local.parent / "eval.jsonl", 10, seed=2)
    summary = run(local)
    # tokenize re-runs to tokenize the new held-out rows; the training rows and the model stay.
    assert summary.stages == ran("tokenize", "evaluate", "register")
    assert summary.version == "1", "the same weights are not registered again"


@pytest.mark.slow
def test_same_settings_on_another_machine_replan_but_keep_the_model(local, monkeypatch):
    from fulltune.memory import budget

    monkeypatch.setattr(budget, "host_ram", lambda: 64 * 2**30 + 12345)
    assert run(local).stages == ran("memory-budget")


@pytest.mark.slow
def test_smaller_machine_under_auto_replans_and_retrains(local, monkeypatch):
    from fulltune.memory import budget, overhead
    from fulltune.pipelines_file import load_pipelines

    # On CPU the evaluate stage's process (Prefect and MLflow imported) is ~96 MiB larger than the trainer's,
    # which for this tiny model makes the evaluation the pipeline's peak: a machine too small for the training's
    # settings would fail the evaluation first. Counted as small as the trainer here, the training decides.
    monkeypatch.setattr(overhead, "CPU_EVAL_PROCESS_BYTES", overhead.CPU_PROCESS_BYTES)
    before = _plan(local)["plan"]
    headroom = load_pipelines(local).pipelines["tiny"].budget.headroom
    # Just too small for the settings chosen so far: the planner must split the batch differently.
    small = int((before["estimate"]["device_bytes"] - 1) / (1 - headroom))
    monkeypatch.setattr(budget, "host_ram", lambda: small)
    after = _plan(local)["plan"]
    assert (after["micro_batch_size"], after["gradient_checkpointing"]) != (before["micro_batch_size"],
                                                                          before["gradient_checkpointing"])
    assert run(local).stages == ran("memory-budget", "fine-tune", "evaluate", "register")


@pytest.mark.slow
def test_train_data_change_reruns_everything(local):
    write_addition_data(local.parent / "train.jsonl", 100, seed=3)
    assert run(local).stages == ran(*STAGES)


def _plan(path: Path) -> dict:
    """`fulltune plan tiny --json`, in this process (so a patched machine applies)."""
    import contextlib
    import io

    from fulltune.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.slow
def test_new_hub_commit_reruns_the_stages_that_use_the_model(tmp_path, hf_home, prefect_server):
    repo = "Org/Keys-0.5B.v1"
    snapshot = fake_hub_model(hf_home, repo, "d" * 40)
    tokenizer = make_tokenizer(tmp_path / "tokenizer")  # its own: only the model changes upstream
    path = tiny_pipeline(tmp_path, model={"name_or_path": repo, "tokenizer": tokenizer, "from_config": None}, **QUICK)
    assert run(path).stages == ran(*STAGES)
    assert run(path).stages == ran(), "an unchanged commit is a cache hit"
    # Upstream pushes new weights to main.
    fake_hub_model(hf_home, repo, "e" * 40, seed=1)
    assert run(path).stages == ran("memory-budget", "fine-tune", "evaluate", "register")
    shutil.rmtree(snapshot)


def test_local_checkpoints_are_hashed_once_then_known_by_size_and_mtime(tmp_path, monkeypatch):
    from fulltune import storage

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"w" * 1000)
    (checkpoint / "config.json").write_text("{}")
    work = tmp_path / "work"
    work.mkdir()
    reads = []
    real = storage.file_sha256
    monkeypatch.setattr(storage, "file_sha256", lambda file: reads.append(file.name) or real(file))
    first = storage.tree_sha256(checkpoint, work)
    assert sorted(reads) == ["config.json", "model.safetensors"]
    assert storage.tree_sha256(checkpoint, work) == first and len(reads) == 2, "nothing read the second time"
    (checkpoint / "config.json").write_text('{"a": 1}')
    assert storage.tree_sha256(checkpoint, work) != first
    assert reads[2:] == ["config.json"], "only the changed file is read again"
    (checkpoint / "config.json").unlink()
    storage.tree_sha256(checkpoint, work)
    assert str(checkpoint / "config.json") not in json.loads((work / storage.HASH_CACHE).read_text())
