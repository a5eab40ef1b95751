"""Every shipped pipelines file, and the commented real-model examples, pass the real validator."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import yaml

from fulltune.pipelines_file import load_pipelines, validate_pipelines
from fulltune.sizes import parse_size

from conftest import ROOT


def test_shipped_pipelines_validate():
    pipelines = load_pipelines(ROOT / "pipelines.yaml")
    assert "demo" in pipelines.pipelines
    demo = pipelines.pipelines["demo"]
    assert demo.model.from_config is not None
    assert (ROOT / demo.model.from_config).is_file()
    assert (ROOT / demo.data.train).is_file()


def test_commented_real_model_examples_validate():
    text = (ROOT / "pipelines.yaml").read_text()
    block = re.search(r"# BEGIN EXAMPLES\n(.*?)# END EXAMPLES", text, re.S).group(1)
    uncommented = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in block.splitlines())
    examples = yaml.safe_load("pipelines:\n" + uncommented)
    raw = yaml.safe_load(text)
    parsed = validate_pipelines({"defaults": raw.get("defaults", {}), **examples})
    assert set(parsed.pipelines) == {"tinyllama-sft", "mistral-7b-fsdp"}
    assert parsed.pipelines["mistral-7b-fsdp"].distributed.num_processes == 8


def test_readme_yaml_examples_validate():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    assert blocks, "README shows at least one pipelines.yaml example"
    for block in blocks:
        validate_pipelines(_whole(yaml.safe_load(block)))


def _whole(block: dict) -> dict:
    """A README example as a pipelines file: a fragment (sections of one pipeline, no `pipelines:`) is set into
    the README's first pipeline, so its keys are validated where a user would write them."""
    if "pipelines" in block:
        return block
    first = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0])
    name, pipeline = next(iter(first["pipelines"].items()))
    return {**first, "pipelines": {name: {**pipeline, **block}}}


def _examples() -> dict:
    """Every pipeline the README and the commented block of pipelines.yaml show, with the file's defaults."""
    text = (ROOT / "pipelines.yaml").read_text()
    block = re.search(r"# BEGIN EXAMPLES\n(.*?)# END EXAMPLES", text, re.S).group(1)
    uncommented = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in block.splitlines())
    pipelines = dict(yaml.safe_load("pipelines:\n" + uncommented)["pipelines"])
    for block in re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        if "pipelines" in yaml.safe_load(block):  # fragments are validated by test_readme_yaml_examples_validate
            pipelines.update(yaml.safe_load(block)["pipelines"])
    return {"workdir": "work", "defaults": yaml.safe_load(text).get("defaults", {}), "pipelines": pipelines}


def _user_files(directory, pipelines: dict) -> None:
    """The data files the examples name, a few rows each in the format they declare."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {"chat": [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}] * 4,
            "prompt_completion": [{"prompt": "1+1=", "completion": "2"}] * 4, "text": [{"text": "1+1=2"}] * 4}
    for spec in pipelines.values():
        data = spec["data"]
        for name in ("train", "eval"):
            if name not in data:
                continue
            path = directory / data[name]
            path.parent.mkdir(parents=True, exist_ok=True)
            records = rows[data.get("format", "text")]
            if path.suffix == ".parquet":
                pq.write_table(pa.Table.from_pylist(records), path)
            else:
                path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_every_example_validates_and_plans_by_its_real_hub_id(tmp_path):
    """As a user would: the examples' real hub ids (a tiny checkpoint under each id in an offline cache),
    their data files in place, then `fulltune validate` and `fulltune plan NAME --json` for each."""
    from tiny import fake_hub_model

    examples = _examples()
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump(examples, sort_keys=False))
    home = tmp_path / "hf"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_TOKEN", None)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fulltune.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)

    missing = cli("validate", str(path))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    for name, spec in examples["pipelines"].items():
        assert f"pipelines.{name}.model.name_or_path" in missing.stderr, "not in the cache yet"
        assert f"pipelines.{name}.data.train: file not found" in missing.stderr
    for n, repo in enumerate(sorted({spec["model"]["name_or_path"] for spec in examples["pipelines"].values()})):
        fake_hub_model(home, repo, f"{n + 1:040d}")
    _user_files(tmp_path, examples["pipelines"])
    valid = cli("validate", str(path))
    assert valid.returncode == 0, valid.stderr
    # `fulltune plan NAME -f FILE --json` for each example, in one process (the command's `main`, as the console
    # script calls it): one interpreter's imports instead of one per example.
    names = list(examples["pipelines"])
    script = ("import sys; from fulltune.cli import main; "
              "sys.exit(max(main(['plan', name, '-f', sys.argv[1], '--json']) for name in sys.argv[2:]))")
    planned = subprocess.run([sys.executable, "-c", script, str(path), *names], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
    assert planned.returncode == 0, planned.stderr[-3000:]
    decoder, text, plans = json.JSONDecoder(), planned.stdout, []
    while text.strip():
        plan, end = decoder.raw_decode(text.lstrip())
        plans.append(plan)
        text = text.lstrip()[end:]
    assert len(plans) == len(names), planned.stdout[-3000:]
    for name, plan in zip(names, plans):
        spec = examples["pipelines"][name]
        assert plan["device"] == spec["budget"]["device"] and plan["fits"], name
        assert plan["budget_bytes"] == parse_size(spec["budget"]["memory"])
