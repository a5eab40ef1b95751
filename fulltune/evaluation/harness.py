"""Benchmarks beside the held-out loss: lm-evaluation-harness tasks and a team's own metrics.

- `evaluate.lm_eval.tasks` names registered lm-evaluation-harness tasks or task YAML files. A YAML's
  relative `dataset_kwargs.data_files` are read relative to the YAML, so a task and its data travel
  together, and nothing is downloaded (a run is offline-safe with HF_HUB_OFFLINE=1). Every candidate
  (base, fine-tuned, champion) runs the same tasks with the same `limit`, `num_fewshot` and batch size,
  loaded with its own tokenizer; its metrics are named `<task>/<metric>` (`<task>/<metric>_<filter>`
  for a filter other than `none`).
- `evaluate.metrics` names Python callables `module:function` that get the generated completions and
  their references and return a number (metric `<name>`) or a mapping of numbers (`<name>/<key>`).

`check_benchmarks` is what `fulltune validate` (and `fulltune run`, before any stage) adds: the files
exist, registered names are known and, offline, their hub datasets are cached, the callables import,
and every metric `register.promote_if` names is one the evaluation will produce.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fulltune.errors import ConfigError
from fulltune.spec import BUILTIN_METRICS, DEFAULT_METRIC_TIMEOUT, PipelineSpec
from fulltune.spec_gates import metric_part

YAML_SUFFIXES = (".yaml", ".yml")
# `datasets` builders that read `data_files` from disk; any other dataset_path is a hub dataset.
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def is_task_file(task: str) -> bool:
    """A task given as a YAML path (anything else is a registered lm-evaluation-harness name)."""
    return task.endswith(YAML_SUFFIXES)


# ---------------------------------------------------------------------------------------------------
# Task YAML files, read without running any of their code


class _TaskYamlLoader(yaml.SafeLoader):
    """Safe YAML that keeps lm-evaluation-harness's `!function module.name` tags as strings."""


_TaskYamlLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def read_task_yaml(path: Path, _seen: frozenset[Path] = frozenset()) -> dict[str, Any]:
    """A task YAML with its `include`s merged (the including file wins), as lm-evaluation-harness does."""
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: task YAML includes itself")
    config = _read_one_task_yaml(path)
    include = config.pop("include", None)
    if include is None:
        return config
    merged: dict[str, Any] = {}
    for name in _names(include):
        merged.update(read_task_yaml(path.parent / name, _seen | {path}))
    return {**merged, **config}


def _read_one_task_yaml(path: Path) -> dict[str, Any]:
    try:
        config = yaml.load(path.read_text(), Loader=_TaskYamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the task YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a task YAML is a mapping with a `task` key")
    return config


def _names(include: str | list[str]) -> list[str]:
    return [include] if isinstance(include, str) else list(include)


def task_files(path: Path, _seen: frozenset[Path] = frozenset()) -> list[str]:
    """Every file besides its data that a task YAML makes the harness read: the YAML, the YAMLs it
    includes, and the module of each `!function` tag, found as the harness finds it (a `.py` beside the
    YAML that names it, else an importable module)."""
    path = path.resolve()
    if path in _seen:
        return []
    config = _read_one_task_yaml(path)
    files = [str(path), *(module for tag in _function_tags(config)
                          if (module := _function_module(tag, path.parent)) is not None)]
    for name in _names(config.get("include") or []):
        files += task_files(path.parent / name, _seen | {path})
    return list(dict.fromkeys(files))


def _function_tags(value: Any) -> list[str]:
    """The `module.function` of every `!function` tag in a task config (as _TaskYamlLoader keeps them)."""
    if isinstance(value, str):
        return [value.removeprefix("!function ").strip()] if value.startswith("!function ") else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [tag for item in items for tag in _function_tags(item)]


def _function_module(tag: str, directory: Path) -> str | None:
    module = tag.rpartition(".")[0]
    beside = directory / f"{module.replace('.', '/')}.py"
    if beside.is_file():
        return str(beside.resolve())
    try:
        origin = getattr(importlib.util.find_spec(module), "origin", None) if module else None
    except (ImportError, ValueError):  # not importable: the harness will say so when it runs the task
        return None
    return origin if origin and Path(origin).is_file() else None


def _data_files(config: dict[str, Any]) -> list[str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return []
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        values = files.values()
        return [f for v in values for f in ([v] if isinstance(v, str) else list(v))]
    return list(files)


def _with_local_files(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The config with relative data files made absolute, relative to the YAML's directory."""
    kwargs = dict(config.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is None:
        return config

    def absolute(name: str) -> str:
        return name if Path(name).is_absolute() or "://" in name else str(directory / name)

    if isinstance(files, str):
        kwargs["data_files"] = absolute(files)
    elif isinstance(files, dict):
        kwargs["data_files"] = {k: absolute(v) if isinstance(v, str) else [absolute(f) for f in v]
                                for k, v in files.items()}
    else:
        kwargs["data_files"] = [absolute(f) for f in files]
    return {**config, "dataset_kwargs": kwargs}


def _declared_metrics(config: dict[str, Any]) -> set[str] | None:
    """The metric names a task config declares, or None when the config does not say (a group, or a task
    whose metrics come from code)."""
    listed = config.get("metric_list")
    if not listed or "task" not in config:
        return None
    names = {str(entry["metric"]) for entry in listed if isinstance(entry, dict) and "metric" in entry}
    filters = [f.get("name") for f in config.get("filter_list") or [] if isinstance(f, dict)]
    if not filters:
        return names
    return {f"{name}_{flt}" if flt and flt != "none" else name for name in names for flt in filters}


# ---------------------------------------------------------------------------------------------------
# What the evaluation will produce, and the validate-time checks


@dataclass(frozen=True)
class HarnessTask:
    """One entry of `evaluate.lm_eval.tasks`: its lm-evaluation-harness name and what it reads."""

    entry: str  # as written in the pipelines file
    name: str  # the task (or group) name its metrics are prefixed with
    path: str | None  # the YAML file, absolute; None for a registered task
    metrics: frozenset[str] | None  # declared metric names; None: not known before running
    higher_is_better: tuple[tuple[str, bool], ...] = ()
    hub_dataset: str | None = None  # the hub dataset a registered task reads, when its YAML names one


def resolve_tasks(spec: PipelineSpec, base_dir: str | Path, field: str = "evaluate.lm_eval.tasks") -> list[HarnessTask]:
    """The configured tasks; raises ConfigError naming `field` for a missing file or an unknown name."""
    tasks, problems = _resolve_tasks(spec, base_dir, field)
    if problems:
        raise ConfigError("\n".join(problems) if len(problems) == 1 else
                          f"{len(problems)} problem(s)\n  " + "\n  ".join(problems))
    return tasks


def _resolve_tasks(spec: PipelineSpec, base_dir: str | Path, field: str) -> tuple[list[HarnessTask], list[str]]:
    """(the tasks that resolve, the problems of those that do not)."""
    if spec.evaluate.lm_eval is None:
        return [], []
    problems: list[str] = []
    tasks: list[HarnessTask] = []
    registered = [entry for entry in spec.evaluate.lm_eval.tasks if not is_task_file(entry)]
    index = _registered_index() if registered else {}
    for i, entry in enumerate(spec.evaluate.lm_eval.tasks):
        where = f"{field}[{i}]"
        if is_task_file(entry):
            path = Path(entry).expanduser()
            path = path if path.is_absolute() else Path(base_dir) / path
            if not path.is_file():
                problems.append(f"{where}: task YAML not found: {path}")
                continue
            try:
                config = read_task_yaml(path)
            except ConfigError as exc:
                problems.append(f"{where}: {exc}")
                continue
            name = config.get("task") or config.get("group")
            if not isinstance(name, str):
                problems.append(f"{where}: {path} names no `task` (or `group`)")
                continue
            missing = [f for f in _data_files(_with_local_files(config, path.parent))
                       if "://" not in f and not Path(f).exists()]
            problems += [f"{where}: {path}: data file not found: {f}" for f in missing]
            if not _data_files(config) and config.get("dataset_path") not in LOCAL_BUILDERS:
                problems.append(f"{where}: {path} reads the dataset {config.get('dataset_path')!r}, which would be "
                                "downloaded; point dataset_path at a local format (json, csv, parquet) and "
                                "dataset_kwargs.data_files at local files")
            declared = _declared_metrics(config)
            better = tuple((str(m["metric"]), bool(m["higher_is_better"])) for m in config.get("metric_list") or []
                           if isinstance(m, dict) and "metric" in m and "higher_is_better" in m)
            tasks.append(HarnessTask(entry, name, str(path.resolve()),
                                     frozenset(declared) if declared is not None else None, better))
        else:
            found = index.get(entry)
            if found is None:
                problems.append(f"{where}: {entry!r} is not a registered lm-evaluation-harness task (nor a path "
                                "ending in .yaml)")
                continue
            config: dict[str, Any] = {}
            if found is not True:
                with contextlib.suppress(ConfigError):
                    config = read_task_yaml(Path(found))
            declared = _declared_metrics(config) if config else None
            tasks.append(HarnessTask(entry, entry, None, frozenset(declared) if declared is not None else None,
                                     hub_dataset=_hub_dataset(config)))
    return tasks, problems


def _hub_dataset(config: dict[str, Any]) -> str | None:
    """The hub dataset a task config reads (`dataset_path`), or None for local files or a group."""
    path = config.get("dataset_path")
    if not isinstance(path, str) or path in LOCAL_BUILDERS or _data_files(config) or Path(path).exists():
        return None
    return path


def _offline_problems(tasks: list[HarnessTask], entries: list[str], field: str) -> list[str]:
    """With HF_HUB_OFFLINE=1, each registered task whose hub dataset is not in the local cache: the run
    could not read it, and would find out only after training."""
    from fulltune import hub

    if not hub.offline():
        return []
    return [f"{field}[{entries.index(task.entry)}]: task {task.name} reads the hub dataset {task.hub_dataset}, "
            f"which is not in the Hugging Face cache ({hub.cache_dir()}) while HF_HUB_OFFLINE=1; download it once "
            f"(`hf download {task.hub_dataset} --repo-type dataset`, or run online), or give the task as a YAML "
            "over local files"
            for task in tasks if task.hub_dataset and hub.cached_commit(task.hub_dataset, None, "dataset") is None]


@functools.lru_cache(maxsize=1)
def _registered_index() -> dict[str, str | bool]:
    """Registered task name → its YAML path (True where it has none). Scanning the harness's ~15,000
    task files takes seconds, so it happens only when a pipeline names a registered task."""
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index
    return {name: str(entry.yaml_path) if getattr(entry, "yaml_path", None) else True for name, entry in index.items()}


def check_benchmarks(spec: PipelineSpec, base_dir: str | Path, prefix: str) -> list[str]:
    """Problems with `evaluate.lm_eval`, `evaluate.metrics` and the metrics `register.promote_if` names,
    each with its YAML path under `prefix` (`pipelines.<name>`)."""
    from fulltune.data.sources import eval_source_names, generating_sources

    tasks, problems = _resolve_tasks(spec, base_dir, f"{prefix}.evaluate.lm_eval.tasks")
    if spec.evaluate.lm_eval is not None:
        problems += _offline_problems(tasks, spec.evaluate.lm_eval.tasks, f"{prefix}.evaluate.lm_eval.tasks")
    custom = spec.evaluate.metrics
    for name, target in custom.items():
        try:
            load_callable(target, base_dir)
        except ConfigError as exc:
            problems.append(f"{prefix}.evaluate.metrics.{name}: {exc}")
    generated = spec.evaluate.max_generate_examples > 0 and any(generating_sources(spec.data))
    if custom and not generated:
        problems.append(f"{prefix}.evaluate.metrics: the metrics score generated completions, which need an eval "
                        "source of format prompt_completion and evaluate.max_generate_examples > 0")
    some_tasks_failed = bool(problems) and spec.evaluate.lm_eval is not None
    for i, gate in enumerate(spec.registration.gates):
        if some_tasks_failed and "/" in gate.metric and gate.metric.partition("/")[0] not in {t.name for t in tasks}:
            continue  # the metric may be one of a task whose problem is listed already
        problem = unknown_metric(gate.metric, tasks, custom, eval_source_names(spec.data)) or \
            _not_generated(gate.metric, spec)
        if problem:
            problems.append(f"{prefix}.register.promote_if[{i}].metric: {problem}")
            continue
        wrong = _wrong_direction(gate.metric, gate.mode, tasks)
        if wrong:
            problems.append(f"{prefix}.register.promote_if[{i}].mode: {wrong}")
    return problems


def _not_generated(metric: str, spec: PipelineSpec) -> str | None:
    """Why exact match (`exact_match`, `exact_match/<source>`) is never measured for this pipeline, or None: it
    compares generations with completions, which only prompt_completion sources have."""
    from fulltune.data.sources import eval_source_names, generating_sources

    head, _, tail = metric.partition("/")
    if head != "exact_match":
        return None
    if spec.evaluate.max_generate_examples == 0:
        return "exact match is measured on generations, and evaluate.max_generate_examples is 0"
    names, generating = eval_source_names(spec.data), generating_sources(spec.data)
    if tail and tail in names and not generating[names.index(tail)]:
        return (f"data.eval source {tail} has no completions to compare generations with (its format is chat or "
                "text); exact match is measured on prompt_completion sources")
    if not tail and not any(generating):
        return "no eval source has completions to compare generations with (exact match needs prompt_completion)"
    return None


def unknown_metric(metric: str, tasks: list[HarnessTask], custom: Mapping[str, str],
                   sources: list[str] | None = None) -> str | None:
    """Why `metric` is not one the evaluation produces, or None when it is. `sources`: the names of the
    data.eval sources, whose built-in metrics are reported one by one (`eval_loss/<source>`)."""
    if metric in BUILTIN_METRICS or metric in custom:
        return None
    reported = "/".join(metric_part(part) for part in metric.split("/"))
    if reported != metric:
        return (f"{metric!r} is not a metric name MLflow accepts (letters, digits, '_', '-', '.' between the "
                f"'/'s); it is reported as {reported!r}")
    head, _, tail = metric.partition("/")
    if head in BUILTIN_METRICS and tail:
        if tail in (sources or []):
            return None
        named = f"the data.eval sources are {', '.join(sources)}" if sources else "data.eval is not a list of sources"
        return f"no data.eval source {tail!r} to report {head} of ({named})"
    if tail and head in custom:
        return None  # a metric function returning a mapping names its keys only when it runs
    for task in tasks:
        if head == task.name and tail:
            if task.metrics is None or tail in task.metrics:
                return None
            return f"task {task.name} reports {', '.join(sorted(task.metrics))}; no {tail!r}"
    known = [*BUILTIN_METRICS, *custom, *(f"{t.name}/{m}" for t in tasks for m in sorted(t.metrics or {"<metric>"}))]
    return f"unknown metric {metric!r}; known: {', '.join(known)}"


def _wrong_direction(metric: str, mode: str | None, tasks: list[HarnessTask]) -> str | None:
    head, _, tail = metric.partition("/")
    for task in tasks:
        if task.name == head:
            for name, higher in task.higher_is_better:
                if name == tail and mode != ("max" if higher else "min"):
                    return f"{metric} improves in mode '{'max' if higher else 'min'}' (the task's higher_is_better)"
    return None


def sources_key(spec: PipelineSpec, base_dir: str | Path) -> dict[str, Any]:
    """What the evaluate stage's cache key must see besides the spec: the content of each task YAML, the
    YAMLs it includes, its `!function` modules and its data files, and the source of each metric
    function's module (a changed task re-evaluates)."""
    key: dict[str, Any] = {}
    if spec.evaluate.lm_eval is not None:
        import lm_eval

        key["lm_eval"] = getattr(lm_eval, "__version__", "?")
        for task in resolve_tasks(spec, base_dir):
            if task.path is not None:
                config = _with_local_files(read_task_yaml(Path(task.path)), Path(task.path).parent)
                files = [*task_files(Path(task.path)), *sorted(f for f in _data_files(config) if Path(f).is_file())]
                key[task.entry] = [_file_sha256(f) for f in files]
    for name, target in spec.evaluate.metrics.items():
        module = target.partition(":")[0]
        with _importable_from(base_dir):
            found = importlib.util.find_spec(module)
        origin = getattr(found, "origin", None)
        key[f"metric:{name}"] = _file_sha256(origin) if origin and Path(origin).is_file() else target
    return key


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------
# A team's own metrics


@contextlib.contextmanager
def _importable_from(directory: str | Path) -> Iterator[None]:
    """The pipelines file's directory first on sys.path while a metric module is imported."""
    entry = str(Path(directory).resolve())
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def load_callable(target: str, base_dir: str | Path) -> Callable[..., Any]:
    """Import `module:function`; ConfigError saying what is wrong when it cannot be used."""
    module_name, _, function = target.partition(":")
    try:
        with _importable_from(base_dir):
            module = importlib.import_module(module_name)
    except Exception as exc:  # any error while importing user code is the user's to fix
        raise ConfigError(f"cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    found = getattr(module, function, None)
    if not callable(found):
        raise ConfigError(f"{module_name!r} has no function {function!r}")
    return found


def custom_metrics(spec_metrics: Mapping[str, str], base_dir: str | Path, completions: list[str],
                   references: list[str], *, timeout: float = DEFAULT_METRIC_TIMEOUT,
                   progress: Callable[[str], None] | None = None, label: str = "model") -> dict[str, float]:
    """Each metric function on the completions and their references, as `{name or name/key: value}`.

    Any number passes (numpy's too). A function that raises (SystemExit included), returns something
    else or runs past `timeout` seconds (`evaluate.metric_timeout`) stops the evaluation with a
    ConfigError naming the metric: it is the team's code to fix, and a retry would fail the same way.
    `progress` gets a line when each function starts and every PROGRESS_SECONDS while it runs.
    """
    values: dict[str, float] = {}
    for name, target in spec_metrics.items():
        function = load_callable(target, base_dir)
        where = f"evaluate.metrics.{name}: {target}"
        say = progress or (lambda line: None)
        say(f"{label}: metric {name} ({target}) on {len(completions)} completions")
        try:
            result = _call_with_limit(function, (list(completions), list(references)), timeout,
                                      lambda seconds: say(f"{label}: metric {name} still running after "
                                                          f"{seconds:.0f} s (evaluate.metric_timeout {timeout:g} s)"))
        except TimeoutError:
            raise ConfigError(f"{where} ran longer than evaluate.metric_timeout ({timeout:g} s); make it faster or "
                              "raise evaluate.metric_timeout") from None
        except (Exception, SystemExit) as exc:  # a bug in the team's metric: stop with its message, never retry
            raise ConfigError(f"{where} raised {type(exc).__name__}: {exc}") from None
        items = result.items() if isinstance(result, Mapping) else [(None, result)]
        keys: dict[str, Any] = {}
        for key, value in items:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"{where} returned {value!r}; return a number or a mapping of numbers")
            # A key is reported in the characters MLflow accepts in a metric name ("digits (strict)" →
            # digits/digits_strict), as a gate names it; two keys that read the same there would overwrite.
            reported = name if key is None else f"{name}/{metric_part(str(key))}"
            if reported in keys:
                raise ConfigError(f"{where} returned the keys {keys[reported]!r} and {key!r}, both reported as "
                                  f"{reported} (metric names keep letters, digits, '_', '-', '.'); rename one")
            keys[reported] = key
            values[reported] = float(value)
    return values


# A metric function running longer than this says so, so a slow one is visibly alive.
PROGRESS_SECONDS = 10.0


def _call_with_limit(function: Callable[..., Any], args: tuple[Any, ...], limit: float,
                     tick: Callable[[float], None]) -> Any:
    """`function(*args)` in a daemon thread, waited for at most `limit` seconds (TimeoutError after), with
    `tick(elapsed)` every PROGRESS_SECONDS. Python cannot stop a thread: one that runs over is left
    behind, and the process ends with the error rather than waiting for it."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # handed to the waiting thread, which decides
            outcome["error"] = exc

    thread = threading.Thread(target=call, name="fulltune-metric", daemon=True)
    started = time.monotonic()
    thread.start()
    while True:
        elapsed = time.monotonic() - started
        thread.join(max(0.0, min(PROGRESS_SECONDS, limit - elapsed)))
        if not thread.is_alive():
            break
        elapsed = time.monotonic() - started
        if elapsed >= limit:
            raise TimeoutError
        tick(elapsed)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# ---------------------------------------------------------------------------------------------------
# Running the harness on a loaded model


def harness_metrics(results: dict[str, Any]) -> dict[str, float]:
    """`simple_evaluate`'s results as `{<task>/<metric>: value}` (standard errors left out)."""
    metrics: dict[str, float] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, sep, flt = key.partition(",")
            if not sep or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = f"{task}/{metric}" if flt in ("", "none") else f"{task}/{metric}_{flt}"
            if math.isfinite(float(value)):
                metrics[name] = float(value)
    return metrics


def run_harness(model: Any, tokenizer: Any, tasks: list[HarnessTask], *, limit: int | None, num_fewshot: int | None,
                batch_size: int, device: str, seed: int = 0) -> dict[str, float]:
    """lm-evaluation-harness tasks on an already loaded model and its own tokenizer.

    The bos token is added exactly when the tokenizer adds one to plain text, as training saw the data.
    Bootstrap standard errors are skipped (they cost seconds per metric and no gate reads them).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from fulltune.data import adds_bos

    specs: list[str | dict[str, Any]] = []
    for task in tasks:
        if task.path is None:
            specs.append(task.name)
        else:
            path = Path(task.path)
            specs.append(_with_local_files(_load_task_config(path), path.parent))
    with _quiet_harness():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                  add_bos_token=adds_bos(tokenizer))
        manager = TaskManager(include_defaults=any(task.path is None for task in tasks))
        results = simple_evaluate(model=lm, tasks=specs, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                  bootstrap_iters=0, log_samples=False, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed)
    return harness_metrics(results or {})


@contextlib.contextmanager
def _quiet_harness() -> Iterator[None]:
    """Keep the harness's progress bars, drop what a user cannot act on: its warnings about being handed
    a loaded model (the supported way to evaluate one) and the `git describe` it runs in the current
    directory for its own results record (a "fatal: not a git repository" line outside a checkout)."""
    import logging
    from unittest import mock

    import lm_eval.evaluator

    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
            yield
    finally:
        log.setLevel(level)


def _load_task_config(path: Path) -> dict[str, Any]:
    """The task config as the harness itself reads it (`!function` tags imported, includes merged)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=True)


@dataclass(frozen=True)
class Benchmarks:
    """What every candidate runs besides the loss: the harness tasks and the metric functions."""

    tasks: tuple[HarnessTask, ...]
    limit: int | None
    num_fewshot: int | None
    batch_size: int
    metrics: tuple[tuple[str, str], ...]  # (name, module:function)
    base_dir: str
    metric_timeout: float = DEFAULT_METRIC_TIMEOUT  # seconds each metric function may run

    @classmethod
    def from_spec(cls, spec: PipelineSpec, base_dir: str | Path) -> Benchmarks | None:
        """None when the pipeline configures neither lm_eval tasks nor metric functions."""
        lm = spec.evaluate.lm_eval
        if lm is None and not spec.evaluate.metrics:
            return None
        return cls(tuple(resolve_tasks(spec, base_dir)), lm.limit if lm else None, lm.num_fewshot if lm else None,
                   (lm.batch_size if lm and lm.batch_size else spec.evaluate.batch_size),
                   tuple(spec.evaluate.metrics.items()), str(base_dir), spec.evaluate.metric_timeout)

    def on_model(self, model: Any, tokenizer: Any, device: str) -> dict[str, float]:
        if not self.tasks:
            return {}
        return run_harness(model, tokenizer, list(self.tasks), limit=self.limit, num_fewshot=self.num_fewshot,
                           batch_size=self.batch_size, device=device)

    def on_generations(self, completions: list[str], references: list[str],
                       progress: Callable[[str], None] | None = None, label: str = "model") -> dict[str, float]:
        if not self.metrics:
            return {}
        return custom_metrics(dict(self.metrics), self.base_dir, completions, references,
                              timeout=self.metric_timeout, progress=progress, label=label)
