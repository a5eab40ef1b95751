"""The command line: user errors exit 2 with one message naming the field or file, and leave nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fulltune.cli import main

from conftest import ROOT
from pipelines_fixture import TINY_LLAMA, tiny_pipeline

CLI = [sys.executable, "-m", "fulltune.cli"]


def run_cli(*args: str, cwd: Path, api: str | None = None) -> subprocess.CompletedProcess:
    """The CLI in a process of its own; a run with `api` uses that Prefect API (PREFECT_API_URL), without
    one its own temporary server."""
    from runs import with_prefect_api

    env = with_prefect_api({**os.environ, "PYTHONPATH": str(ROOT)}, api)
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in result.stderr


def test_validate_ok_and_list(tmp_path, capsys):
    path = tiny_pipeline(tmp_path)
    assert main(["validate", str(path)]) == 0
    assert "1 pipeline(s) valid: tiny" in capsys.readouterr().out
    assert main(["list", "-f", str(path)]) == 0
    assert "tiny" in capsys.readouterr().out


def test_bad_config_exits_2_naming_the_field(tmp_path):
    path = tiny_pipeline(tmp_path, train={"learning_rate": -1})
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert_user_error(result, "pipelines.tiny.train.learning_rate: must be > 0")


def test_malformed_yaml_exits_2_with_line(tmp_path):
    (tmp_path / "pipelines.yaml").write_text("pipelines:\n  a: [1, 2\n")
    result = run_cli("run", "a", cwd=tmp_path)
    assert_user_error(result, "pipelines.yaml", "line")


def test_unknown_pipeline_exits_2(tmp_path, capsys):
    path = tiny_pipeline(tmp_path)
    assert main(["run", "nope", "-f", str(path)]) == 2
    assert "unknown pipeline 'nope'" in capsys.readouterr().err


def test_unknown_override_key_exits_2(tmp_path, capsys):
    path = tiny_pipeline(tmp_path)
    assert main(["plan", "tiny", "-f", str(path), "--set", "train.lr=1"]) == 2
    assert "pipelines.tiny.train.lr: unknown key" in capsys.readouterr().err


def test_missing_data_file_exits_2_before_anything_runs(tmp_path):
    path = tiny_pipeline(tmp_path, data={"train": "missing.jsonl"})
    result = run_cli("run", "tiny", "-f", str(path), cwd=tmp_path)
    assert_user_error(result, "data.train", "missing.jsonl")
    assert not (tmp_path / "work").exists()


def test_plan_json_keeps_the_contract(tmp_path, capsys):
    path = tiny_pipeline(tmp_path)
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device"] == "cpu"
    assert isinstance(plan["budget_bytes"], int) and plan["fits"] is True
    breakdown_keys = {"parameters", "gradients", "optimizer_states", "activations", "logits", "temporary",
                      "runtime_overhead"}
    for estimate in (plan["estimate"], plan["plan"]["estimate"]):
        assert set(estimate["breakdown"]) == breakdown_keys
        assert estimate["device_bytes"] >= estimate["peak_bytes"] > 0
    chosen = plan["plan"]
    assert chosen["micro_batch_size"] * chosen["gradient_accumulation_steps"] == 4
    for key in ("gradient_checkpointing", "mixed_precision", "optimizer"):
        assert key in chosen
    assert isinstance(plan["alternatives"], list)
    # Before the data is tokenized the logits are sized for every position; the plan says so.
    assert plan["planned_on"].startswith("planned before the data is tokenized: every row at data.max_length (16)")
    assert main(["plan", "tiny", "-f", str(path)]) == 0
    assert "`fulltune run` tokenizes first" in capsys.readouterr().out


def test_impossible_budget_with_fail_exits_2_with_breakdown(tmp_path):
    path = tiny_pipeline(tmp_path, budget={"device": "cpu", "memory": 1000, "on_overflow": "fail"})
    result = run_cli("plan", "tiny", "-f", str(path), cwd=tmp_path)
    assert_user_error(result, "budget")
    assert "parameters" in result.stderr


def test_validate_lists_every_missing_local_file_with_its_yaml_path(tmp_path):
    path = tiny_pipeline(tmp_path, data={"train": "missing.jsonl", "eval": "data/held-out.jsonl"},
                         model={"from_config": "configs/nope.json"})
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert_user_error(result, "3 problem(s)", "pipelines.tiny.data.train: file not found:", "missing.jsonl",
                      "pipelines.tiny.data.eval: file not found:", "data/held-out.jsonl",
                      "pipelines.tiny.model.from_config: file not found:", "configs/nope.json")
    (tmp_path / "ckpt").mkdir()
    path = tiny_pipeline(tmp_path, model={"from_config": None, "tokenizer": None, "name_or_path": "./ckpt"})
    assert_user_error(run_cli("validate", str(path), cwd=tmp_path),
                      "pipelines.tiny.model.name_or_path:", "ckpt holds no config.json")
    path = tiny_pipeline(tmp_path, model={"tokenizer": "ckpt"})
    assert_user_error(run_cli("validate", str(path), cwd=tmp_path),
                      "pipelines.tiny.model.tokenizer:", "ckpt holds no tokenizer files")


@pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="needs a machine without a GPU")
@pytest.mark.parametrize("command", ["plan", "run"])
def test_cuda_auto_memory_without_a_gpu_exits_2_naming_budget_memory(tmp_path, command):
    path = tiny_pipeline(tmp_path, budget={"device": "cuda", "memory": "auto"})
    result = run_cli(command, "tiny", "-f", str(path), cwd=tmp_path)
    assert_user_error(result, "pipelines.tiny.budget.memory:", "GPU")
    assert not (tmp_path / "work").exists()


def test_simulate_a_multi_process_plan_exits_2_naming_the_strategy(tmp_path, capsys):
    path = tiny_pipeline(tmp_path, distributed={"strategy": "ddp", "num_processes": 2})
    assert main(["plan", "tiny", "-f", str(path), "--simulate"]) == 2
    assert "pipelines.tiny.distributed.strategy" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("content,needles", [
    ('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": \n', ["train.jsonl", "line 2"]),
    ("", ["train.jsonl", "empty"]),
    ('{"question": "1+1=", "completion": "2"}\n' * 8, ["train.jsonl", "prompt"]),
    (b'{"prompt": "1+1=", "completion": "2"}\n{"prompt": "caf\xe9", "completion": "x"}\n',
     ["data.train", "train.jsonl line 2 (byte 53): not UTF-8"]),
])
def test_broken_data_exits_2_and_registers_nothing(tmp_path, content, needles, prefect_server):
    path = tiny_pipeline(tmp_path)
    if isinstance(content, bytes):
        (tmp_path / "train.jsonl").write_bytes(content)
    else:
        (tmp_path / "train.jsonl").write_text(content)
    result = run_cli("run", "tiny", "-f", str(path), cwd=tmp_path, api=prefect_server)
    assert_user_error(result, *needles)
    assert not list((tmp_path / "work").glob("tokenized/[!.]*"))
    assert registered_versions(tmp_path / "work" / "mlflow.db") == 0


@pytest.mark.slow
def test_a_broken_record_in_the_third_source_exits_2_naming_it_and_registers_nothing(tmp_path, prefect_server):
    from pipelines_fixture import write_addition_data

    write_addition_data(tmp_path / "more.jsonl", 8, seed=1)
    (tmp_path / "third.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": 4}\n')
    path = tiny_pipeline(tmp_path, data={"train": ["train.jsonl", {"path": "more.jsonl", "weight": 2}, "third.jsonl"]})
    result = run_cli("run", "tiny", "-f", str(path), cwd=tmp_path, api=prefect_server)
    assert_user_error(result, "data.train[2]: ", "third.jsonl line 2: column 'completion' is a number")
    assert not list((tmp_path / "work").glob("tokenized/[!.]*"))
    assert registered_versions(tmp_path / "work" / "mlflow.db") == 0
    (tmp_path / "third.jsonl").unlink()
    assert_user_error(run_cli("validate", str(path), cwd=tmp_path), "pipelines.tiny.data.train[2]: file not found")


def registered_versions(database: Path) -> int:
    """Model versions in a tracking database (MLflow's store opens it as the run starts, before any stage)."""
    import sqlite3

    if not database.exists():
        return 0
    with sqlite3.connect(database) as connection:
        tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        return connection.execute("SELECT COUNT(*) FROM model_versions").fetchone()[0] if "model_versions" in tables else 0


def test_a_full_disk_outside_the_stages_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import errno
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from fulltune import cli

    path = tiny_pipeline(tmp_path)

    def full(args):
        raise OperationalError("CREATE TABLE", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setitem(cli.COMMANDS, "run", full)
    assert main(["run", "tiny", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: /") and "the filesystem is full" in err and "Traceback" not in err
    assert err.rstrip().endswith("rerun: the stages that finished are cached")

    def no_space(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "work" / "mlflow.db"))

    monkeypatch.setitem(cli.COMMANDS, "run", no_space)
    assert main(["run", "tiny", "-f", str(path)]) == 2
    assert f"while writing {tmp_path / 'work' / 'mlflow.db'}" in capsys.readouterr().err


def test_a_key_written_twice_exits_2_naming_it_before_anything_runs(tmp_path, capsys):
    # YAML would keep the second `train:` only: the run trained at another learning rate and batch than written.
    path = tiny_pipeline(tmp_path)
    text = path.read_text().replace("    evaluate:\n", "    train:\n      learning_rate: 2.0e-5\n    evaluate:\n", 1)
    path.write_text(text)
    for command in (["validate", str(path)], ["run", "tiny", "-f", str(path)], ["plan", "tiny", "-f", str(path)]):
        assert main(command) == 2
        assert "pipelines.tiny.train appears twice in one mapping (first at line" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()
    # Two pipelines of one name are the same mistake one level up.
    path.write_text(text.replace("pipelines:\n", "pipelines:\n  tiny: {model: {name_or_path: x}, data: {train: y}}\n"))
    assert main(["validate", str(path)]) == 2
    assert "pipelines.tiny appears twice" in capsys.readouterr().err


def test_plan_json_prints_the_plan_when_nothing_fits(tmp_path, capsys):
    path = tiny_pipeline(tmp_path, budget={"device": "cpu", "memory": "10MiB"})
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    plan = json.loads(out)  # the whole of stdout is the plan object
    assert plan["fits"] is False and plan["budget_bytes"] == 10 * 2**20
    assert plan["suggestions"][0].startswith("a budget of ") and plan["estimate"]["breakdown"]["parameters"] > 0
    assert "no configuration fits the budget" in err


def test_a_micro_batch_that_leaves_1f1b_fewer_micro_batches_than_stages_is_refused_naming_it(tmp_path, capsys):
    # Two stages, 1F1B, micro-batch = the effective batch: one micro-batch per step for two stages.
    path = tiny_pipeline(tmp_path, model={"from_config": {**TINY_LLAMA, "tie_word_embeddings": False}},
                         distributed={"num_processes": 2, "pipeline_parallel": 2}, train={"micro_batch_size": 4})
    for command in (["validate", str(path)], ["run", "tiny", "-f", str(path)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "pipelines.tiny: train.micro_batch_size with distributed.pipeline_schedule: 1F1B needs" in err
        assert "model.from_config" not in err
    assert not (tmp_path / "work").exists()
    # Two micro-batches of 2 per step train (the accumulation the planner fills in is 2).
    assert main(["validate", str(path), "--set", "train.micro_batch_size=2"]) == 0


def test_cpu_processes_share_the_machines_ram_under_memory_auto(tmp_path, capsys):
    from fulltune.memory.budget import host_ram

    path = tiny_pipeline(tmp_path, distributed={"strategy": "ddp", "num_processes": 3},
                         train={"effective_batch_size": 6})
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["budget_bytes"] == host_ram() // 3  # each process plans against its third of the RAM, not all of it
    assert any("memory is auto on cpu: this machine's" in r and "shared by its 3 processes" in r
               for r in plan["reasons"])
    # Two machines of 2 processes each (3 rounded up): each process's share of its own machine.
    assert main(["plan", "tiny", "-f", str(path), "--json", "--set", "distributed.num_machines=2"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_bytes"] == host_ram() // 2


def test_validate_names_each_eval_source_as_its_metrics_are_reported(tmp_path, capsys):
    from fulltune.data.sources import eval_source_names
    from fulltune.spec import DataSpec

    from pipelines_fixture import write_addition_data

    for name in ("data/demo/eval.jsonl", "data/other/eval.jsonl", "data/demo/eval-1.jsonl", "held-out (v2).jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write_addition_data(tmp_path / name, 4)
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "1+1="}]}\n')
    evals = ["data/demo/eval.jsonl", "data/other/eval.jsonl", "data/demo/eval-1.jsonl", "held-out (v2).jsonl",
             {"path": "chat.jsonl", "format": "chat"}]
    refused = {
        # Three names that share a name after one round of positions: every name stays distinct.
        "eval_loss/eval-1": "no data.eval source 'eval-1' to report eval_loss of (the data.eval sources are eval-0, "
                            "eval-1-1, eval-1-2, held-out_v2, chat)",
        "eval_loss/held-out (v2)": "'eval_loss/held-out (v2)' is not a metric name MLflow accepts (letters, digits, "
                                   "'_', '-', '.' between the '/'s); it is reported as 'eval_loss/held-out_v2'",
        "exact_match/chat": "data.eval source chat has no completions to compare generations with",
    }
    for metric, message in refused.items():
        path = tiny_pipeline(tmp_path, data={"eval": evals}, register={"promote_if": {"metric": metric}})
        assert main(["validate", str(path)]) == 2
        assert f"pipelines.tiny.register.promote_if[0].metric: {message}" in capsys.readouterr().err
    for metric in ("eval_loss/eval-1-2", "eval_loss/held-out_v2", "exact_match/held-out_v2", "exact_match"):
        path = tiny_pipeline(tmp_path, data={"eval": evals}, register={"promote_if": {"metric": metric}})
        assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    path = tiny_pipeline(tmp_path, data={"eval": evals}, evaluate={"max_generate_examples": 0},
                         register={"promote_if": {"metric": "exact_match"}})
    assert main(["validate", str(path)]) == 2
    assert "exact match is measured on generations, and evaluate.max_generate_examples is 0" in capsys.readouterr().err
    # A hub split is named `<name>-<split>` however it is written.
    split = DataSpec(train="t.jsonl", eval=["org/name:validation", {"path": "org/other", "split": "test"}])
    assert eval_source_names(split) == ["name-validation", "other-test"]


@pytest.mark.slow
def test_an_unset_strategy_lets_the_plan_choose_it_for_one_process(tmp_path, capsys):
    # An 8B Llama on one 12 GiB GPU: its 16 GiB of bf16 weights fit only in host RAM, under FSDP2's CPU offload over
    # the one process. Without a `distributed:` section the plan chooses that, and says so.
    llama_8b = {**TINY_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 2048,
                "tie_word_embeddings": False}
    path = tiny_pipeline(tmp_path, model={"from_config": llama_8b, "tokenizer": {"vocab_size": 128256}},
                         data={"max_length": 2048},
                         budget={"device": "cuda", "memory": "12GiB", "host_memory": "256GiB"},
                         train={"effective_batch_size": 8, "mixed_precision": "bf16"})
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and (plan["plan"]["strategy"], plan["plan"]["offload_optimizer"]) == ("fsdp", True)
    assert "pipelines.tiny.distributed.strategy is not set: for one process the plan chooses it as under auto" \
        in plan["reasons"]
    assert any(r.startswith("strategy fsdp (distributed.strategy auto)") for r in plan["reasons"])
    # A strategy the user set is kept: none does not fit, and the advice names the one that does.
    assert main(["plan", "tiny", "-f", str(path), "--json", "--set", "distributed.strategy=none"]) == 2
    plan = json.loads(capsys.readouterr().out)
    assert not plan["fits"] and any(s.startswith("distributed.strategy: fsdp (or auto)") for s in plan["suggestions"])
