"""Reading a pipelines file: the YAML mapping, `defaults` merged into each pipeline, `--set` overrides, and
every problem reported at once with its YAML path (the schema is fulltune/spec.py's)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fulltune import yamlio
from fulltune.errors import ConfigError
from fulltune.spec import PipelineSpec, PipelinesFile

# Words YAML 1.1 reads as booleans besides true/false; an override keeps them as typed.
YAML11_BOOLEAN_WORDS = {"yes", "no", "on", "off", "y", "n"}


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return `base` updated recursively with `override` (mappings merge, everything else replaces)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse `dotted.key=value`; the value is read as a YAML scalar (`1e-4`, `true`, `null`, `[1, 2]`)."""
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected dotted.key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item}: empty key part")
    if raw.strip().lower() in YAML11_BOOLEAN_WORDS:
        return parts, raw.strip()  # `--set train.mixed_precision=no` means the word; pydantic reads it for bools
    try:
        value = yamlio.load(raw) if raw.strip() else ""
    except yamlio.YamlError as exc:
        if "alias" in str(exc):  # a bounded expansion is refused, not read as a plain string
            raise ConfigError(f"--set {key.strip()}: {exc}") from None
        value = raw
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Apply `--set` overrides, relative to one pipeline's raw mapping."""
    items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides)
    result = copy.deepcopy(raw)
    for parts, value in items:
        if isinstance(parts, str):
            parts = parts.split(".")
        node = result
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return result


# A value that fits none of a union's members: pydantic reports each scalar member too
# ("should be a valid boolean", "should be 'auto'") beside the mapping member's real problems.
SCALAR_MISMATCH = {"bool_type", "bool_parsing", "literal_error", "int_type", "int_parsing", "float_type",
                   "float_parsing", "string_type"}


def format_errors(error: ValidationError, prefix: str) -> list[str]:
    items = [(tuple(p for p in item["loc"] if not _is_union_tag(p)), item) for item in error.errors()]
    deeper = {loc[:n] for loc, _ in items for n in range(len(loc))}
    lines = []
    for loc, item in items:
        if item["type"] in SCALAR_MISMATCH and loc in deeper:
            continue  # the union's scalar members, when a mapping member says what is wrong inside
        path = ""
        for part in [prefix, *loc]:
            # A list position reads as YAML paths are written elsewhere: data.train[2].messages_field.
            path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif item["type"] == "greater_than":
            message = f"must be > {item['ctx']['gt']}"
        elif item["type"] == "greater_than_equal":
            message = f"must be >= {item['ctx']['ge']}"
        elif item["type"] == "less_than":
            message = f"must be < {item['ctx']['lt']}"
        elif item["type"] == "less_than_equal":
            message = f"must be <= {item['ctx']['le']}"
        lines.append(f"{path}: {message}")
    return list(dict.fromkeys(lines))


def _is_union_tag(part: Any) -> bool:
    # pydantic adds the member type of a union to the location ("int", "literal['auto']", "AutotuneSpec":
    # a section's class name, never a YAML key, which are lower case).
    return isinstance(part, str) and (part in {"int", "str", "bool", "float"} or part.startswith(("literal[", "function-"))
                                      or (part[:1].isupper() and part.isidentifier()))


def read_yaml(path: Path) -> dict[str, Any]:
    """Safe-load a YAML mapping; errors name the file and line."""
    if not path.is_file():
        raise ConfigError(f"{path}: pipelines file not found")
    try:
        data = yamlio.load(path.read_text())  # safe_load, aliases bounded, `1e-6` a float (fulltune/yamlio.py)
    except yamlio.YamlError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with a `pipelines` key")
    return data


def load_pipelines(path: str | Path, overrides: dict[str, list[str]] | None = None) -> PipelinesFile:
    """Parse and validate a pipelines file. `overrides` maps pipeline name → `--set` items.

    Raises ConfigError listing every problem, each with its YAML path.
    """
    path = Path(path)
    raw = read_yaml(path)
    return validate_pipelines(raw, overrides, source=str(path))


def validate_pipelines(
    raw: dict[str, Any], overrides: dict[str, list[str]] | None = None, source: str = "pipelines.yaml"
) -> PipelinesFile:
    errors: list[str] = []
    unknown = set(raw) - {"workdir", "defaults", "pipelines"}
    errors += [f"{key}: unknown key" for key in sorted(unknown)]
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        errors.append("defaults: must be a mapping")
        defaults = {}
    pipelines_raw = raw.get("pipelines")
    if not isinstance(pipelines_raw, dict) or not pipelines_raw:
        errors.append("pipelines: declare at least one pipeline as a mapping")
        pipelines_raw = {}
    pipelines: dict[str, PipelineSpec] = {}
    for name, body in pipelines_raw.items():
        if not isinstance(body, dict):
            errors.append(f"pipelines.{name}: must be a mapping")
            continue
        merged = deep_merge(defaults, body)
        if overrides and name in overrides:
            merged = apply_overrides(merged, overrides[name])
        try:
            pipelines[str(name)] = PipelineSpec.model_validate(merged)
        except ValidationError as exc:
            errors += format_errors(exc, f"pipelines.{name}")
    workdir = raw.get("workdir", ".fulltune")
    if not isinstance(workdir, str) or not workdir:
        errors.append("workdir: must be a path")
    if errors:
        raise ConfigError(f"{source}: {len(errors)} problem(s)\n  " + "\n  ".join(errors))
    try:
        return PipelinesFile(workdir=workdir, pipelines=pipelines)
    except ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(format_errors(exc, ""))) from None


def get_pipeline(pipelines: PipelinesFile, name: str) -> PipelineSpec:
    if name not in pipelines.pipelines:
        known = ", ".join(sorted(pipelines.pipelines))
        raise ConfigError(f"unknown pipeline {name!r}; pipelines in this file: {known}")
    return pipelines.pipelines[name]
