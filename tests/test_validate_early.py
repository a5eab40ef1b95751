"""What used to fail late — in plan with a traceback, or in the register stage after the whole run — is refused by
`fulltune validate` (exit 2, one message naming the field): a model config transformers cannot build, and a
registered model name MLflow refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fulltune.spec import RegisterSpec

ROOT = Path(__file__).resolve().parents[1]


def fulltune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fulltune.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def pipelines_file(tmp_path: Path, model: dict) -> Path:
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"workdir": str(tmp_path / "work"), "pipelines": {"tiny": {
        "model": model, "data": {"train": str(ROOT / "data" / "demo" / "train.jsonl"), "format": "prompt_completion",
                                 "max_length": 32},
        "train": {"effective_batch_size": 4, "max_steps": 2}, "budget": {"device": "cpu"}}}}))
    return path


LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.mark.slow
def test_an_inline_config_transformers_cannot_build_is_a_validate_error(tmp_path: Path) -> None:
    path = pipelines_file(tmp_path, {"from_config": {**LLAMA, "hidden_size": 30}, "tokenizer": {"vocab_size": 96}})
    result = fulltune("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "pipelines.tiny.model.from_config" in result.stderr and "multiple of the number of attention heads" \
        in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "work").exists()  # nothing written


@pytest.mark.slow
def test_run_refuses_an_inline_config_transformers_cannot_build_before_writing_anything(tmp_path: Path) -> None:
    # The config itself is valid; only building the model finds the unknown activation.
    path = pipelines_file(tmp_path, {"from_config": {**LLAMA, "hidden_act": "nope"}, "tokenizer": {"vocab_size": 96}})
    result = fulltune("run", "tiny", "-f", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "pipelines.tiny.model.from_config: transformers cannot build this llama model" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "work").exists()  # nothing written: no workdir, no tracking database, no data


def test_an_inline_config_is_built_once_per_machine_and_each_changed_one_again(tmp_path: Path, monkeypatch) -> None:
    from fulltune import models
    from fulltune.errors import ConfigError
    from fulltune.stages import BUILT_CONFIGS, check_model_builds, resolve_pipeline

    def pipeline(directory: Path, **fields: object):
        directory.mkdir(exist_ok=True)
        path = pipelines_file(directory, {"from_config": {**LLAMA, **fields}, "tokenizer": {"vocab_size": 96}})
        return resolve_pipeline(str(path), "tiny")

    monkeypatch.setenv("FULLTUNE_CACHE_DIR", str(tmp_path / "cache"))
    builds: list[object] = []
    build = models.check_model_config
    monkeypatch.setattr(models, "check_model_config", lambda config: (builds.append(config), build(config)))
    check_model_builds(pipeline(tmp_path / "a"))
    check_model_builds(pipeline(tmp_path / "a"))  # validate, then run: built before on this machine
    check_model_builds(pipeline(tmp_path / "b"))  # the same config in another project's workdir
    assert len(builds) == 1
    (record,) = (tmp_path / "cache" / BUILT_CONFIGS).iterdir()
    with pytest.raises(ConfigError, match="pipelines.tiny.model.from_config: transformers cannot build"):
        check_model_builds(pipeline(tmp_path / "a", hidden_act="nope"))  # a changed config is built again
    with pytest.raises(ConfigError, match="transformers cannot build"):
        check_model_builds(pipeline(tmp_path / "a", hidden_act="nope"))  # and a refused one is never recorded
    assert len(builds) == 3 and list((tmp_path / "cache" / BUILT_CONFIGS).iterdir()) == [record]
    record.unlink()  # a cleared cache: build again
    check_model_builds(pipeline(tmp_path / "a"))
    assert len(builds) == 4


@pytest.mark.slow
def test_an_inline_config_written_as_a_user_writes_it_validates_and_plans(tmp_path: Path) -> None:
    # `1e-6` is a float to a user (YAML 1.1 would read it as a string).
    path = tmp_path / "pipelines.yaml"
    text = pipelines_file(tmp_path, {"from_config": LLAMA, "tokenizer": {"vocab_size": 96}}).read_text()
    path.write_text(text.replace("max_position_embeddings: 64", "max_position_embeddings: 64\n        rms_norm_eps: 1e-6"))
    assert "1e-6" in path.read_text()
    assert fulltune("validate", str(path), cwd=tmp_path).returncode == 0
    result = fulltune("plan", "tiny", "-f", str(path), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["../x", "a/b", "team:bot", "", ".", "x/.."])
def test_a_registered_model_name_mlflow_refuses_is_refused_at_validate(name: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_name

    with pytest.raises(MlflowException):
        _validate_model_name(name)  # MLflow's own rule refuses it ...
    with pytest.raises(ValueError, match="model registry"):
        RegisterSpec(model_name=name)  # ... and so does the spec


@pytest.mark.parametrize("name", ["support-bot", "team.bot_v2", "Support Bot"])
def test_names_mlflow_accepts_are_accepted(name: str) -> None:
    from mlflow.utils.validation import _validate_model_name

    _validate_model_name(name)
    assert RegisterSpec(model_name=name).model_name == name


def test_the_cli_refuses_a_bad_model_name_before_anything_runs(tmp_path: Path) -> None:
    result = fulltune("validate", str(ROOT / "pipelines.yaml"), "--set", "register.model_name=../x", cwd=ROOT)
    assert result.returncode == 2 and "pipelines.demo.register.model_name" in result.stderr, result.stderr


ARC_LIKE = {"task": "arc_like", "dataset_path": "someorg/arc_like", "dataset_name": "Easy", "output_type":
            "multiple_choice", "test_split": "test", "doc_to_text": "{{question}}", "doc_to_target": "label",
            "doc_to_choice": "{{choices}}", "metric_list": [{"metric": "acc"}]}


@pytest.mark.slow
def test_validate_offline_refuses_a_registered_task_whose_dataset_is_not_cached(tmp_path: Path, monkeypatch,
                                                                                 capsys, hf_home) -> None:
    pytest.importorskip("lm_eval")
    from fulltune.evaluation import harness
    from fulltune.cli import main

    from tiny import fake_hub_repo

    # A registered task as the harness ships them: a YAML naming a hub dataset (scanning the harness's
    # real index takes a minute; this one holds the task alone).
    task_yaml = tmp_path / "arc_like.yaml"
    task_yaml.write_text(yaml.safe_dump(ARC_LIKE))
    monkeypatch.setattr(harness, "_registered_index", lambda: {"arc_like": str(task_yaml)})
    path = pipelines_file(tmp_path, {"from_config": LLAMA, "tokenizer": {"vocab_size": 96}})
    config = yaml.safe_load(path.read_text())
    config["pipelines"]["tiny"]["evaluate"] = {"lm_eval": {"tasks": ["arc_like"]}}
    path.write_text(yaml.safe_dump(config))

    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pipelines.tiny.evaluate.lm_eval.tasks[0]: task arc_like reads the hub dataset someorg/arc_like" in err
    assert "HF_HUB_OFFLINE=1" in err and "hf download someorg/arc_like --repo-type dataset" in err
    assert not (tmp_path / "work").exists()

    fake_hub_repo(hf_home, "someorg/arc_like", "c" * 40, repo_type="dataset")
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
