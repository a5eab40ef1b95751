"""Every shipped pipelines file, and the commented real-model examples, pass the real validator."""

from __future__ import annotations

import re

import yaml

from fulltune.spec import load_pipelines, validate_pipelines

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
        validate_pipelines(yaml.safe_load(block))
