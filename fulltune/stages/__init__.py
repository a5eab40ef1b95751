"""The stages' floor: the pipeline as the stages read it, and what every stage shares.

Each stage is one module of this package that ends with `STAGE = Stage(...)` (fulltune/stages/runner.py: its
code, key, run and the files it writes; `registry` finds them): `tokenize`, `budget` (the memory budget),
`finetune`, `evaluate`, `register`. The flow only orders them. Here: `resolve_pipeline` (a pipeline with its
overrides, paths made absolute, hub commits pinned), what a cache key sees of a file or a hub repository, the
stage markers (a cache hit whose files are gone or damaged re-runs), and the checks a run makes before any stage.

Cache keys are content hashes of a stage's inputs plus the source of the engine code it runs, so changing data,
config or engine code re-runs exactly the stages that depend on it:

- local files count by their bytes (hashed once, then remembered by size and mtime in
  `<workdir>/file-hashes.json`, fulltune/storage.py), hub models, tokenizers and datasets by the commit their revision names;
- the budget counts the device and memory `auto` resolves to on this machine, so a new machine replans;
- training counts the training data only (`TokenizedData.train_fingerprint`), evaluation and
  registration the held-out data too, so new eval data re-evaluates without retraining.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from fulltune import hub
from fulltune.evaluation import harness
from fulltune.degrees import DegreesError
from fulltune.errors import ConfigError, DataError
# The pipeline as every stage reads it; resolved and given its budget here (the CLI and the flow import them here).
from fulltune.planning.inputs import ResolvedPipeline, resolved_budget, with_budget  # noqa: F401
from fulltune.storage import FileHashes, atomic_write_text, cache_dir, code_version, hash_json, tree_sha256
from fulltune.pipelines_file import get_pipeline, load_pipelines
from fulltune.spec import PipelineSpec

# Each stage's one name: its Prefect task, cache key, marker directory (`<workdir>/stages/<name>/`), line of the
# run summary and MLflow tag `fulltune.stage.<name>`.
TOKENIZE, MEMORY_BUDGET, FINE_TUNE, EVALUATE, REGISTER = "tokenize", "memory-budget", "fine-tune", "evaluate", "register"


# Fields that change neither the plan nor the trained weights: how often a run checkpoints, logs and keeps
# checkpoints (a resume is bit-exact, so the cadence cannot change the weights), how many non-finite steps in a
# row stop it, and the name of the variable a hub token is read from. The budget and training keys leave them
# out, so changing one after Ctrl-C resumes the same run from its newest checkpoint instead of training anew.
OUTSIDE_THE_WEIGHTS = {"train": {"checkpoint_every_steps", "keep_checkpoints", "log_every_steps",
                                 "max_nonfinite_steps"},
                       "model": {"token_env"}}


# What changes the plan but not the weights: whether checkpoints are written in the background (the same files,
# fulltune/runtime/async_checkpoints.py; the plan counts the copy they are written from). The budget key keeps it,
# the training key leaves it out, so turning it on or off resumes the same run from its newest checkpoint.
PLANNED_NOT_WEIGHTS = frozenset({"checkpoint_async"})


def weights_inputs(spec: PipelineSpec) -> dict[str, Any]:
    """The `model:` and `train:` sections as the budget and training keys see them (OUTSIDE_THE_WEIGHTS out)."""
    return {section: getattr(spec, section).model_dump(mode="json", exclude=OUTSIDE_THE_WEIGHTS[section])
            for section in ("model", "train")}


def resolve_pipeline(pipelines_file: str, name: str, overrides: list[str] | dict[str, Any] | None = None) -> ResolvedPipeline:
    """Load the file, apply `--set` overrides to pipeline `name`, validate; the workdir becomes absolute.

    A relative workdir is relative to the pipelines file's directory, as are relative data paths.
    """
    pipelines = load_pipelines(pipelines_file, {name: overrides} if overrides else None)
    spec = get_pipeline(pipelines, name)
    base = Path(pipelines_file).resolve().parent
    workdir = Path(os.environ.get("FULLTUNE_WORKDIR") or pipelines.workdir)
    workdir = workdir if workdir.is_absolute() else base / workdir
    return ResolvedPipeline(name, _absolute_paths(spec, base), str(workdir), str(Path(pipelines_file).resolve()))


def _absolute_paths(spec: PipelineSpec, base: Path) -> PipelineSpec:
    """Make local file references absolute so stages do not depend on the current directory; hub ids
    stay as they are (fulltune/hub.py tells them apart: after this, a reference is local iff absolute)."""
    from fulltune.data import SUFFIX_BUILDERS
    from fulltune.data.sources import map_references

    def local(value: str | None, data: bool = False, always: bool = False) -> str | None:
        if value is None:
            return None
        candidate = Path(value).expanduser()
        if candidate.is_absolute():
            return str(candidate)
        suffixes = tuple(SUFFIX_BUILDERS) if data else ()
        if always or (base / candidate).exists() or hub.looks_local(value, data_suffixes=suffixes):
            return str(base / candidate)
        return value

    data = spec.data.model_copy(update={split: map_references(getattr(spec.data, split), lambda v: local(v, True))
                                        for split in ("train", "eval")})
    model_updates: dict[str, Any] = {}
    if spec.model.name_or_path is not None:
        model_updates["name_or_path"] = local(spec.model.name_or_path)
    if isinstance(spec.model.from_config, str):
        model_updates["from_config"] = local(spec.model.from_config, always=True)  # never a hub id
    if isinstance(spec.model.tokenizer, str):
        model_updates["tokenizer"] = local(spec.model.tokenizer)
    return spec.model_copy(update={"data": data, "model": spec.model.model_copy(update=model_updates)})


def is_hub(reference: str | None) -> bool:
    """After resolve_pipeline, a reference is a hub id exactly when it is not an absolute path."""
    return reference is not None and not os.path.isabs(reference)


def pin_hub_revisions(p: ResolvedPipeline) -> ResolvedPipeline:
    """Replace `model.revision` of a hub model by the commit it names now (from the cache when offline),
    so every stage loads, and every cache key names, the same weights. Local models are unchanged.

    Raises ConfigError naming model.name_or_path when the hub id cannot be resolved.
    """
    from fulltune.models import hub_token

    model = p.spec.model
    if not is_hub(model.name_or_path):
        return p
    try:
        token = hub_token(model.token_env)
    except ConfigError as exc:
        raise ConfigError(f"pipelines.{p.name}.{exc}") from None
    try:
        commit = hub.commit_of(model.name_or_path, model.revision, "model", token)
    except hub.HubError as exc:
        raise ConfigError(f"pipelines.{p.name}.model.name_or_path: {_not_local(p, model.name_or_path)}, and as a "
                          f"hub model: {exc}") from None
    spec = p.spec.model_copy(update={"model": model.model_copy(update={"revision": commit})})
    return replace(p, spec=spec)


def _not_local(p: ResolvedPipeline, reference: str) -> str:
    where = Path(p.pipelines_file).parent / reference
    return f"{reference!r} is not a local path ({where} does not exist)"


# ---------------------------------------------------------------- what a key sees of a file or a hub repo


def source_key(p: ResolvedPipeline, reference: str | None, field: str, repo_type: hub.RepoType = "model",
                revision: str | None = None) -> str | None:
    """What a cache key sees of a model, tokenizer or data reference: a local file's or directory's
    content hash, a hub repository's commit (and a dataset's split)."""
    if reference is None:
        return None
    if not is_hub(reference):
        return tree_sha256(reference, p.workdir) if Path(reference).exists() else reference
    from fulltune.models import hub_token

    name, split = hub.split_dataset_id(reference) if repo_type == "dataset" else (reference, None)
    try:
        commit = hub.commit_of(name, revision, repo_type, hub_token(p.spec.model.token_env))
    except hub.HubError as exc:
        error = DataError if repo_type == "dataset" else ConfigError
        raise error(f"pipelines.{p.name}.{field}: {_not_local(p, reference)}, and as a hub {repo_type}: {exc}") from None
    return f"hub:{repo_type}:{name}@{commit}" + (f":{split}" if split else "")


def model_source(p: ResolvedPipeline) -> str | None:
    return source_key(p, p.spec.model.name_or_path, "model.name_or_path", revision=p.spec.model.revision)


def model_config_key(p: ResolvedPipeline) -> str | None:
    """What a key that depends on the model's shape only (not its weights) sees: the sha256 of its config.json
    (a local checkpoint's, or the resolved hub commit's from the cache); the model source when that file
    cannot be read here. `from_config` models are keyed by their spec."""
    import hashlib

    reference = p.spec.model.name_or_path
    if reference is None:
        return None
    if is_hub(reference):
        source = model_source(p)
        commit = source.rsplit("@", 1)[-1] if source else None
        path = hub.cached_file(reference, "config.json", commit) if commit else None
    else:
        path = Path(reference) / "config.json"
    if path is None or not path.is_file():
        return model_source(p)
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- markers: "a cache hit whose files are gone re-runs"


def marker_path(workdir: str, stage: str, key: str) -> Path:
    return Path(workdir) / "stages" / stage / f"{key}.json"


def record_outputs(workdir: str, stage: str, key: str, paths: list[str], extra: dict[str, Any] | None = None) -> None:
    """Write the marker of a finished stage: the outputs its cached result points to and, for those under
    the workdir (what the stage wrote; inputs outside it are covered by the cache key), every file's size
    and sha256. Digests come from the workdir's hash cache (fulltune/storage.py), so a file is read once
    here and never again while its size, mtime and ctime stand."""
    files: dict[str, list[Any]] = {}
    with FileHashes(workdir) as hashes:
        for path in paths:
            if _inside(path, workdir):
                for file in _files_of(Path(path)):
                    files[str(file)] = [file.stat().st_size, hashes.sha256(file)]
    atomic_write_text(marker_path(workdir, stage, key),
                      json.dumps({"paths": paths, "files": files, **(extra or {})}, indent=1))


def outputs_present(workdir: str, stage: str, key: str) -> bool:
    """Whether the outputs a cached result of `stage` points to are all on disk and whole.

    When one is damaged (truncated, deleted, rewritten), the stage must run again: its outputs under the
    workdir are moved to `<workdir>/damaged/` first, so that nothing downstream takes the damaged copy
    for a finished one (the trainer treats an existing model/ as done), and a warning says what was
    wrong and where the copy went.
    """
    recorded, damaged = _damage(workdir, stage, key)
    if not damaged or recorded is None:
        return not damaged
    moved = [_set_aside(workdir, stage, output) for output in recorded.get("paths", [])
             if _inside(output, workdir) and Path(output).exists()
             and any(Path(path).is_relative_to(output) for path, _ in damaged)]
    problems = [f"{path} {reason}" for path, reason in damaged]
    logging.getLogger("fulltune").warning(
        "%s: its cached outputs are damaged (%s); running the stage again%s", stage,
        "; ".join(problems[:3]) + (" …" if len(problems) > 3 else ""),
        f"; set aside: {', '.join(moved)}" if moved else "")
    return False


def _damage(workdir: str, stage: str, key: str) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """(the marker, [(path, what is wrong with it)]) of a stage's recorded outputs."""
    recorded = read_marker(workdir, stage, key)
    if recorded is None:
        return None, [(str(marker_path(workdir, stage, key)), "is missing: no record of the stage's outputs")]
    damaged = [(path, "is missing") for path in recorded.get("paths", []) if not Path(path).exists()]
    with FileHashes(workdir) as hashes:
        for name, (size, digest) in (recorded.get("files") or {}).items():
            file = Path(name)
            if not file.is_file():
                damaged.append((name, "is missing"))
            elif file.stat().st_size != size:
                damaged.append((name, f"is {file.stat().st_size} bytes, written as {size}"))
            elif hashes.sha256(file) != digest:
                damaged.append((name, "changed since it was written (its sha256 differs)"))
    return recorded, list(dict.fromkeys(damaged))


def _files_of(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())


def _inside(path: str, workdir: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(workdir).resolve())


def _set_aside(workdir: str, stage: str, path: str) -> str:
    """Move a damaged output to `<workdir>/damaged/<stage>-<name>-<time>`; returns where it went."""
    import time

    target = Path(workdir) / "damaged" / f"{stage}-{Path(path).name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(path, target)
    return str(target)


def check_positions(p: ResolvedPipeline, config: Any) -> None:
    """Refuse `data.max_length` beyond the positions the model was built for (`max_position_embeddings`).

    Refused rather than clamped: clamping would silently change how the data is cut (and every cache
    key), while a longer row feeds the model positions it never learned — learned position embeddings
    (GPT-2) fail with an index error, rotary ones extrapolate into garbage. The message names the limit.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and p.spec.data.max_length > limit:
        model = "the model built from model.from_config" if p.spec.model.from_config is not None \
            else f"model {p.spec.model.name_or_path}"
        raise ConfigError(f"pipelines.{p.name}.data.max_length: {p.spec.data.max_length} is more than the {limit} "
                          f"positions {model} has (max_position_embeddings); set data.max_length to at most {limit}")


def check_model_split(p: ResolvedPipeline, config: Any) -> None:
    """Refuse a `distributed.tensor_parallel` that does not split the model's attention heads, key/value heads
    or MLP width evenly (`degrees.ParallelDims`), naming the field, before anything trains. With auto the
    planner tries only the degrees that split them. Pipeline stages need a decoder layer each and an untied head
    (`runtime.pipeline_parallel.check_model_config`). A `distributed.context_parallel` that does not divide the
    attention heads is ring attention, refused on a CPU device (`ParallelDims.check_context`)."""
    from fulltune.runtime import pipeline_parallel

    stages = p.spec.distributed.pipeline_parallel
    if stages != "auto":  # auto: the planner tries only the numbers of stages that split the model
        pipeline_parallel.check_model_config(config, stages, f"pipelines.{p.name}.")
    dims = p.spec.distributed.dims
    dims.check_split(config, f"pipelines.{p.name}.")
    device = p.spec.budget.device
    dims.check_context(config, None if device == "auto" else device, f"pipelines.{p.name}.")


def _split_problems(p: ResolvedPipeline) -> list[str]:
    """`check_model_split` for `validate`, on the config of a local model (a hub model's is left to `plan`;
    a config that cannot be read is the source checks' to report)."""
    from fulltune.models import read_model_config

    model = p.spec.model
    dims = p.spec.distributed.dims
    if (dims.tp in (None, 1) and dims.pp == 1 and not dims.cp_enabled) or (
            model.from_config is None and is_hub(model.name_or_path)):
        return []
    try:
        check_model_split(p, read_model_config(model))
    except DegreesError as exc:
        return [str(exc)]
    except ConfigError:
        return []  # the config cannot be read: check_model_builds or the source checks say why
    return []


def ensure_workdir(p: ResolvedPipeline) -> None:
    """Create the workdir if needed and check that files can be written there, before anything runs.

    Raises ConfigError naming where the workdir came from (FULLTUNE_WORKDIR or the pipelines file's
    `workdir`), so that an unusable one fails in one line rather than in every stage.
    """
    import tempfile

    where = "FULLTUNE_WORKDIR" if os.environ.get("FULLTUNE_WORKDIR") else f"{p.pipelines_file}: workdir"
    try:
        Path(p.workdir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p.workdir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create or write the workdir {p.workdir} ({exc.strerror or exc}); "
                          "point it at a directory this user can write") from None


def read_marker(workdir: str, stage: str, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(marker_path(workdir, stage, key).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# Inline model configs transformers has built on this machine: `check_model_builds` skips them.
BUILT_CONFIGS = "built-model-configs"


def _model_config_identity(from_config: str | dict[str, Any]) -> str:
    """What decides whether a `model.from_config` builds: its content, the code that turns it into a
    config (fulltune/models.py) and the installed transformers and torch (read without importing them)."""
    from importlib.metadata import version

    content: Any = from_config if isinstance(from_config, dict) else tree_sha256(from_config)
    return hash_json({"config": content, "code": code_version("models.py"),
                      "transformers": version("transformers"), "torch": version("torch")})


def check_model_builds(p: ResolvedPipeline) -> None:
    """Build the pipeline's `model.from_config` on the meta device (`fulltune.models.check_model_config`), so
    that a config transformers cannot build is a ConfigError naming `pipelines.<name>.model.from_config`
    before anything is written or trained. Nothing to do for a checkpoint, or a config file that is missing
    (check_sources reports that).

    A config built before on this machine is not built again: a build is a pure function of
    `_model_config_identity` (the config, fulltune/models.py, the installed transformers and torch), recorded
    in the machine cache (`<cache_dir>/built-model-configs/<identity>`, fulltune/storage.py `cache_dir`) once it
    succeeds. The build imports torch and transformers, seconds that `validate`, `plan` and a cached rerun
    would otherwise spend; a new or changed config is built, and a refused one is never recorded.
    """
    from_config = p.spec.model.from_config
    if not (isinstance(from_config, dict) or (isinstance(from_config, str) and Path(from_config).is_file())):
        return
    record = cache_dir() / BUILT_CONFIGS / _model_config_identity(from_config)
    if record.is_file():
        return
    from fulltune.models import check_model_config

    try:
        check_model_config(from_config)
    except ConfigError as exc:
        raise ConfigError(f"pipelines.{p.name}.{exc}") from None
    try:
        atomic_write_text(record, "built\n")
    except OSError:
        pass  # a read-only cache: the next check builds it again


def ensure_local_data(p: ResolvedPipeline, check_hub: bool = False) -> None:
    """Fail fast, before any stage runs, on a local file the pipeline names that does not exist (every
    one of them in one message, each with its YAML path); with `check_hub`, also on a hub id that is
    not in the cache while offline. An inline model config is built unless this machine built it before
    (a cached rerun then imports neither torch nor transformers here)."""
    problems, _ = check_sources(p, check_hub=check_hub, in_run=True)
    if problems:
        error = DataError if all(".data." in problem for problem in problems) else ConfigError
        raise error("\n".join(problems) if len(problems) == 1 else
                    f"{len(problems)} problem(s)\n  " + "\n  ".join(problems))


def references(p: ResolvedPipeline) -> list[tuple[str, str, str, str | None]]:
    """(YAML field, reference, kind, hub revision) of every file or repository the pipeline reads, each list
    item on its own (`data.train[2]`), whatever shape the YAML gave it (a string, a list, `{path, split}`)."""
    from fulltune.data.sources import sources
    from fulltune.data.tokenizer import tokenizer_revision

    m, d = p.spec.model, p.spec.data
    refs = [(s.what, s.reference, "data", None) for split in ("train", "eval") for s in sources(d, split)]
    if m.name_or_path is not None:
        refs.append(("model.name_or_path", m.name_or_path, "model", m.revision))
    if isinstance(m.from_config, str):
        refs.append(("model.from_config", m.from_config, "config", None))
    if isinstance(m.tokenizer, str) and m.tokenizer != m.name_or_path:
        refs.append(("model.tokenizer", m.tokenizer, "tokenizer", tokenizer_revision(m)))
    return refs


def check_sources(p: ResolvedPipeline, check_hub: bool = True,
                  in_run: bool = False) -> tuple[list[str], list[str]]:
    """(problems, notes) about the files and hub repositories the pipeline reads, each with its YAML path.

    A local file or directory must exist (a model directory must hold config.json). A hub id is looked
    up in the local Hugging Face cache when HF_HUB_OFFLINE=1 (a run could not fetch it); online it is
    left to run time, which a note says. A `model.from_config` is built on the meta device
    (`check_model_builds`: not again once this machine has built it). Outside a run (`in_run` False:
    `validate`), a tensor-parallel degree must split a local model (`check_model_split`).
    """
    from fulltune.data.tokenizer import TOKENIZER_FILES

    problems, notes = [], []
    try:
        check_model_builds(p)
    except ConfigError as exc:
        problems.append(str(exc))
    if not in_run:  # a run checks the split in its budget stage, on the config it reads there
        problems += _split_problems(p)
    token_env = p.spec.model.token_env
    if check_hub and token_env and not os.environ.get(token_env) and not hub.offline():
        problems.append(f"pipelines.{p.name}.model.token_env: environment variable {token_env} is not set")
    for field, reference, kind, revision in references(p):
        where = f"pipelines.{p.name}.{field}"
        if is_hub(reference):
            if not check_hub:
                continue
            repo = hub.split_dataset_id(reference)[0] if kind == "data" else reference
            repo_type: hub.RepoType = "dataset" if kind == "data" else "model"
            if not hub.offline():
                notes.append(f"{where}: hub {repo_type} {repo} is resolved at run time")
            elif hub.cached_commit(repo, revision, repo_type) is None:
                at = f" at revision {revision}" if revision else ""
                problems.append(f"{where}: {_not_local(p, reference)}, and hub {repo_type} {repo}{at} is not in the "
                                f"Hugging Face cache ({hub.cache_dir()}) while HF_HUB_OFFLINE=1")
            continue
        path = Path(reference)
        if not path.exists():
            problems.append(f"{where}: {'directory' if kind in ('model', 'tokenizer') else 'file'} not found: {path}")
        elif kind == "model" and not (path / "config.json").is_file():
            problems.append(f"{where}: {path} holds no config.json; point it at a checkpoint directory")
        elif kind == "config" and not path.is_file():
            problems.append(f"{where}: {path} is not a file; point it at a config.json")
        elif kind == "tokenizer" and not any((path / name).is_file() for name in TOKENIZER_FILES):
            problems.append(f"{where}: {path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    # lm_eval task files, metric functions, and the metrics register.promote_if names
    problems += harness.check_benchmarks(p.spec, Path(p.pipelines_file).parent, f"pipelines.{p.name}")
    return problems, notes
