"""Hub ids, dots and all, through the command line, offline from a Hugging Face cache written by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fulltune import hub

from conftest import ROOT
from pipelines_fixture import write_addition_data
from tiny import fake_hub_model, fake_hub_repo

CLI = [sys.executable, "-m", "fulltune.cli"]
MODEL = "Org/Tiny-0.5B.v1"
DATASET = "Org/Add.v2"
MAIN, V2 = "a" * 40, "b" * 40


@pytest.mark.parametrize("reference", ["TinyLlama/TinyLlama-1.1B-Chat-v1.0", "Qwen/Qwen2.5-0.5B",
                                       "mistralai/Mistral-7B-v0.3", "gpt2", "Org/Tiny-0.5B.v1"])
def test_dotted_hub_ids_are_hub_ids(reference):
    assert hub.is_hub_id(reference)
    assert not hub.looks_local(reference)
    assert not hub.looks_local(reference + ":validation", data_suffixes=(".jsonl",))


@pytest.mark.parametrize("reference", ["./model", "~/ckpt", "/abs/model", "a/b/c", "data/train.jsonl",
                                       "train.jsonl:x", "..", "org/..", "org/a--b", "C:\\models\\x"])
def test_paths_that_can_only_be_local(reference):
    assert hub.looks_local(reference, data_suffixes=(".jsonl",))


@pytest.fixture
def hf_cache(tmp_path) -> Path:
    """A Hugging Face home with the model on `main` and a wider model on branch `v2`, and a dataset repo."""
    home = tmp_path / "hf"
    fake_hub_model(home, MODEL, MAIN)
    fake_hub_model(home, MODEL, V2, branch="v2", hidden=64)
    data = fake_hub_repo(home, DATASET, "c" * 40, repo_type="dataset")
    (data / "data").mkdir()
    write_addition_data(data / "data" / "train.jsonl", 48)
    write_addition_data(data / "data" / "validation.jsonl", 8, seed=1)
    return home


def write_pipeline(directory: Path, **model) -> Path:
    body = {
        "model": {"name_or_path": MODEL, **model},
        "data": {"train": DATASET, "eval": f"{DATASET}:validation", "format": "prompt_completion", "max_length": 16},
        "budget": {"device": "cpu", "memory": "auto"},
        "train": {"effective_batch_size": 4, "max_steps": 2, "checkpoint_every_steps": 0, "mixed_precision": "no",
                  "log_every_steps": 1},
        "evaluate": {"max_generate_examples": 2, "max_new_tokens": 2},
        "register": {"model_name": "tiny-hub", "require_better_than_base": False},
    }
    path = directory / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"workdir": "work", "pipelines": {"hub": body}}, sort_keys=False))
    return path


def cli(*args: str, cwd: Path, hf_home: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run([*CLI, *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=900)


def test_cached_file_resolves_a_branch_or_commit_offline(hf_cache, monkeypatch):
    monkeypatch.setattr(hub, "cache_dir", lambda: hf_cache / "hub")
    main, v2 = hub.cached_file(MODEL, "config.json"), hub.cached_file(MODEL, "config.json", "v2")
    assert json.loads(main.read_text())["hidden_size"] == 32 and json.loads(v2.read_text())["hidden_size"] == 64
    assert hub.cached_file(MODEL, "config.json", V2) == v2
    assert hub.cached_file(MODEL, "missing.json") is None
    assert hub.cached_file(MODEL, "config.json", "no-such-branch") is None
    assert hub.cached_file("Org/not-cached", "config.json") is None


def test_plan_by_dotted_id_and_revision(tmp_path, hf_cache):
    path = write_pipeline(tmp_path)
    main = cli("plan", "hub", "-f", str(path), "--json", cwd=tmp_path, hf_home=hf_cache)
    assert main.returncode == 0, main.stderr[-3000:]
    parameters = json.loads(main.stdout)["estimate"]["breakdown"]["parameters"]
    # Branch v2 holds a wider model: its plan counts more parameter bytes.
    v2 = cli("plan", "hub", "-f", str(path), "--json", "--set", "model.revision=v2", cwd=tmp_path, hf_home=hf_cache)
    assert v2.returncode == 0, v2.stderr[-3000:]
    assert json.loads(v2.stdout)["estimate"]["breakdown"]["parameters"] > parameters
    missing = cli("plan", "hub", "-f", str(path), "--set", "model.revision=v3", cwd=tmp_path, hf_home=hf_cache)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "pipelines.hub.model.name_or_path" in missing.stderr and "revision v3" in missing.stderr


def test_a_run_pins_the_commit_its_revision_names(tmp_path, hf_cache):
    path = write_pipeline(tmp_path)
    script = ("import sys; from fulltune.stages import pin_hub_revisions, resolve_pipeline as r; "
              "print(pin_hub_revisions(r(sys.argv[1], 'hub', sys.argv[2:])).spec.model.revision)")
    environment = {**os.environ, "HF_HOME": str(hf_cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for overrides, commit in (([], MAIN), (["model.revision=v2"], V2), ([f"model.revision={V2}"], V2)):
        out = subprocess.run([sys.executable, "-c", script, str(path), *overrides], capture_output=True, text=True,
                             env=environment, timeout=300)
        assert out.stdout.strip() == commit, out.stderr[-2000:]


@pytest.mark.parametrize("model,data,needles", [
    ({"name_or_path": "Org/Missing-1.5B"}, {}, ["pipelines.hub.model.name_or_path", "Org/Missing-1.5B",
                                               "not in the Hugging Face cache"]),
    ({"name_or_path": "./checkpoints/mine"}, {}, ["pipelines.hub.model.name_or_path", "checkpoints/mine"]),
    ({}, {"train": "data/train.jsonl"}, ["pipelines.hub.data.train", "data/train.jsonl"]),
    ({}, {"train": "Org/Missing.v1"}, ["data.train", "Org/Missing.v1", "not in the Hugging Face cache"]),
])
def test_unresolvable_references_exit_2_naming_the_field(tmp_path, hf_cache, model, data, needles):
    path = write_pipeline(tmp_path, **model)
    raw = yaml.safe_load(path.read_text())
    raw["pipelines"]["hub"]["data"].update(data)
    path.write_text(yaml.safe_dump(raw))
    for command in (["validate", str(path)], ["run", "hub", "-f", str(path)]):
        result = cli(*command, cwd=tmp_path, hf_home=hf_cache)
        assert result.returncode == 2, (command, result.stderr[-3000:])
        assert "Traceback" not in result.stderr + result.stdout
        for needle in needles:
            assert needle in result.stderr, (command, result.stderr)
    assert not (tmp_path / "work").exists()


def test_validate_checks_the_cache_offline_and_defers_hub_ids_online(tmp_path, hf_cache):
    path = write_pipeline(tmp_path)
    offline = cli("validate", str(path), cwd=tmp_path, hf_home=hf_cache)
    assert offline.returncode == 0, offline.stderr
    assert "1 pipeline(s) valid" in offline.stdout
    empty = tmp_path / "empty-hf"
    online = cli("validate", str(path), cwd=tmp_path, hf_home=empty, HF_HUB_OFFLINE="0")
    assert online.returncode == 0, online.stderr
    assert f"pipelines.hub.model.name_or_path: hub model {MODEL} is resolved at run time" in online.stdout
    assert f"pipelines.hub.data.eval: hub dataset {DATASET} is resolved at run time" in online.stdout
    missing = cli("validate", str(path), cwd=tmp_path, hf_home=empty)
    assert missing.returncode == 2
    assert "3 problem(s)" in missing.stderr, missing.stderr


@pytest.mark.slow
def test_run_by_dotted_id_with_a_hub_dataset(tmp_path, hf_cache, prefect_server):
    path = write_pipeline(tmp_path, token_env="FULLTUNE_TEST_TOKEN")
    result = cli("run", "hub", "-f", str(path), cwd=tmp_path, hf_home=hf_cache, FULLTUNE_TEST_TOKEN="hf_dummy",
                 PREFECT_API_URL=prefect_server)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "registered tiny-hub version 1" in result.stdout
    assert "hf_dummy" not in result.stdout + result.stderr
    meta = json.loads(next((tmp_path / "work" / "tokenized").glob("[!.]*/meta.json")).read_text())
    assert meta["num_train_examples"] == 48 and meta["num_eval_examples"] == 8
    snapshot = hf_cache / "hub" / f"models--{MODEL.replace('/', '--')}" / "snapshots" / MAIN
    assert meta["tokenizer"] == str(snapshot), "the tokenizer is the model's own, from its pinned snapshot"
