"""Hugging Face Hub references: tell a hub id from a local path, pin a revision to its commit, fetch a snapshot.

A reference in pipelines.yaml (`model.name_or_path`, `model.tokenizer`, `data.train`, `data.eval`) is
local when it exists on disk, or when it can only be meant as a path (absolute, `./x`, `~/x`, a data
file suffix such as `data/train.jsonl`, or not spelled like a hub id). Otherwise it is a hub id,
`org/name` or `name`, where names may hold dots (`Qwen/Qwen2.5-0.5B`, `TinyLlama/TinyLlama-1.1B-Chat-v1.0`).
Datasets may name a split: `org/name:validation`.

Hub ids resolve through `huggingface_hub`: with `HF_HUB_OFFLINE=1` only from the local cache
(`$HF_HOME/hub/<type>s--ORG--NAME/` with `refs/<branch>` naming a commit under `snapshots/`), otherwise
from the Hub, falling back to the cache when the Hub cannot be reached. Stage cache keys use the resolved
commit, so a new upstream commit re-runs what depends on it and an unchanged one does not.

Hub datasets are read from their repository snapshot with `datasets.load_dataset(<snapshot dir>, split=…)`
(data files and splits as `datasets` infers them from the repository layout or its README). `datasets`
itself cannot open a hub id offline (it asks the Hub), so a dataset must be in the hub cache, e.g. from
`hf download --repo-type dataset ORG/NAME`; an earlier `datasets.load_dataset` does not count.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from fulltune.errors import UserError

RepoType = Literal["model", "dataset"]

# The Hub's own rule for repository ids: letters, digits, `-`, `_`, `.`; no `--` or `..`; at most 96 chars.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Files a tokenizer never needs: fetching a tokenizer from a model repository skips the weights.
WEIGHT_PATTERNS = ["*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx",
                   "*.npz", "*.ot", "*.safetensors.index.json", "*.bin.index.json"]


def is_hub_id(reference: str) -> bool:
    """Whether `reference` is spelled like a hub repository id (`org/name` or `name`)."""
    return bool(_HUB_ID.match(reference)) and ".." not in reference and "--" not in reference


def looks_local(reference: str, *, data_suffixes: tuple[str, ...] = ()) -> bool:
    """Whether a reference that does not exist on disk can only be meant as a local path: absolute,
    `./x`, `~/x`, a backslash, a data file suffix (`data/train.jsonl`, for data fields), or not spelled
    like a hub id. A dataset id may end in `:split`."""
    if reference.startswith((".", "~", "/")) or "\\" in reference or Path(reference).is_absolute():
        return True
    name = split_dataset_id(reference)[0] if data_suffixes else reference
    if data_suffixes and Path(name).suffix.lower() in data_suffixes:
        return True
    return not is_hub_id(name)


def split_dataset_id(reference: str) -> tuple[str, str | None]:
    """`org/name:split` → (`org/name`, `split`); no split → None."""
    name, sep, split = reference.partition(":")
    return name, (split or None) if sep else None


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _repo_cache(repo_id: str, repo_type: RepoType) -> Path:
    return cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}"


def cached_commit(repo_id: str, revision: str | None = None, repo_type: RepoType = "model") -> str | None:
    """The commit `revision` (default `main`) names in the local cache, when its snapshot is there."""
    root = _repo_cache(repo_id, repo_type)
    revision = revision or "main"
    if _COMMIT.match(revision):
        commit = revision
    else:
        try:
            commit = (root / "refs" / revision).read_text().strip()
        except OSError:
            return None
    return commit if (root / "snapshots" / commit).is_dir() else None


def cached_file(repo_id: str, filename: str, revision: str | None = None,
                repo_type: RepoType = "model") -> Path | None:
    """`filename` in the cached snapshot that `revision` (a commit, or a branch or tag; default `main`)
    names, read offline; None when that snapshot or the file in it is not in the local cache."""
    commit = cached_commit(repo_id, revision, repo_type)
    if commit is None:
        return None
    path = _repo_cache(repo_id, repo_type) / "snapshots" / commit / filename
    return path if path.is_file() else None


class HubError(UserError):
    """A hub id that cannot be resolved (unknown repository or revision, not cached while offline)."""


def _describe(repo_id: str, revision: str | None, repo_type: RepoType) -> str:
    kind = "dataset" if repo_type == "dataset" else "model"
    return f"hub {kind} {repo_id}" + (f" at revision {revision}" if revision else "")


def commit_of(repo_id: str, revision: str | None = None, repo_type: RepoType = "model",
              token: str | None = None) -> str:
    """The commit a hub repository's `revision` names: asked of the Hub, from the cache when offline.

    Raises HubError (a user error) when the repository or revision does not exist, or is not cached
    while the Hub cannot be asked.
    """
    cached = cached_commit(repo_id, revision, repo_type)
    if revision and _COMMIT.match(revision) and cached:
        return revision
    if offline():
        if cached is None:
            raise HubError(f"{_describe(repo_id, revision, repo_type)} is not in the Hugging Face cache "
                           f"({cache_dir()}) and HF_HUB_OFFLINE=1 forbids downloading it")
        return cached
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        return str(HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type, token=token).sha)
    except RepositoryNotFoundError:
        raise HubError(f"{_describe(repo_id, None, repo_type)} does not exist, or is private or gated "
                       "(set model.token_env to the variable holding a token that may read it)") from None
    except RevisionNotFoundError:
        raise HubError(f"{_describe(repo_id, None, repo_type)} has no revision {revision!r}") from None
    except Exception as exc:  # noqa: BLE001 - any network failure: the cache is the answer if it has one
        if cached is not None:
            return cached
        raise HubError(f"{_describe(repo_id, revision, repo_type)}: the Hub cannot be reached and the "
                       f"repository is not cached ({type(exc).__name__}: {exc})") from None


def snapshot(repo_id: str, revision: str | None = None, repo_type: RepoType = "model", token: str | None = None,
             ignore_patterns: list[str] | None = None) -> Path:
    """The local directory of a repository snapshot, downloading what is missing unless offline."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, token=token,
                                      ignore_patterns=ignore_patterns))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one message: which repo, and why
        if offline() and cached_commit(repo_id, revision, repo_type) is None:
            raise HubError(f"{_describe(repo_id, revision, repo_type)} is not in the Hugging Face cache "
                           f"({cache_dir()}) and HF_HUB_OFFLINE=1 forbids downloading it") from None
        raise HubError(f"{_describe(repo_id, revision, repo_type)} could not be fetched: "
                       f"{type(exc).__name__}: {exc}") from None

