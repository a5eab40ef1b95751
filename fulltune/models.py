"""Load models and tokenizers by path or hub id, or build a fresh model from a config.

Safe by default: no remote code unless `model.trust_remote_code` is set, and only safetensors weights
unless `model.allow_pickle_weights` is set.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulltune.attention import kernel
from fulltune.errors import ConfigError, root_message
from fulltune.storage import atomic_dir, tree_sha256
from fulltune.spec import ModelSpec


def hub_token(token_env: str | None) -> str | None:
    """Read a Hub token from the environment variable the user named (never from the YAML).

    Offline (HF_HUB_OFFLINE=1) everything comes from the local cache, which needs no token: an unset
    variable is then no error."""
    if token_env is None:
        return None
    token = os.environ.get(token_env)
    if not token:
        from fulltune import hub

        if hub.offline():
            return None
        raise ConfigError(f"model.token_env: environment variable {token_env} is not set")
    return token


def read_model_config(model: ModelSpec, tokenizer_vocab: int | None = None) -> Any:
    """The transformers config of the model, without loading weights (used by the memory planner)."""
    from transformers import AutoConfig

    if model.from_config is not None:
        return config_from_spec(model.from_config, tokenizer_vocab)
    if os.path.isabs(model.name_or_path) and not Path(model.name_or_path).is_dir():
        raise ConfigError(f"model.name_or_path: directory {model.name_or_path} not found; check the path")
    try:
        return AutoConfig.from_pretrained(
            model.name_or_path,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            token=hub_token(model.token_env),
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path: cannot read a model config from {model.name_or_path!r}: {exc}") from None


def config_from_spec(from_config: str | dict[str, Any], tokenizer_vocab: int | None = None) -> Any:
    """Build a PretrainedConfig from a config.json path or an inline mapping."""
    from transformers import AutoConfig

    if isinstance(from_config, str):
        path = Path(from_config)
        if not path.is_file():
            raise ConfigError(f"model.from_config: file not found: {from_config}")
        try:
            mapping = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model.from_config: {from_config} is not valid JSON (line {exc.lineno})") from None
    else:
        mapping = dict(from_config)
    model_type = mapping.pop("model_type", None)
    if not model_type:
        raise ConfigError("model.from_config: needs a `model_type` (for example llama, qwen2, gpt2, gpt_neox)")
    if tokenizer_vocab is not None:
        mapping["vocab_size"] = tokenizer_vocab
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs validate their fields with it

    try:
        return AutoConfig.for_model(model_type, **mapping)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:
        cause = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ is not None else exc
        raise ConfigError(f"model.from_config: {cause}") from None


def check_model_config(from_config: str | dict[str, Any]) -> None:
    """Build the model `model.from_config` describes on the meta device (no weights, no memory) so that a config
    transformers cannot build — a wrong-typed value, heads that do not divide the hidden size — is a ConfigError
    at validate, not a traceback at plan or train."""
    import torch
    from transformers import AutoModelForCausalLM

    config = config_from_spec(from_config)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, ZeroDivisionError) as exc:
        raise ConfigError(f"model.from_config: transformers cannot build this {config.model_type} model: "
                          f"{type(exc).__name__}: {exc}") from None


def load_tokenizer(path_or_id: str, *, revision: str | None = None, trust_remote_code: bool = False,
                   token: str | None = None) -> Any:
    """AutoTokenizer with a pad token (the eos token when the checkpoint has none): the one way every stage
    loads a tokenizer, so tokenization, planning, training and evaluation agree on the pad id.

    Raises ConfigError naming the tokenizer when it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path_or_id, revision=revision, trust_remote_code=trust_remote_code, token=token
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.tokenizer: cannot load a tokenizer from {path_or_id!r} ({root_message(exc)}); "
                          "check model.tokenizer (or model.name_or_path)") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Placement:
    """Where a loaded model's weights go: all on `device`, or with `max_memory` (accelerate's bytes per device,
    e.g. {0: 20 GiB, "cpu": 200 GiB}) by `device_map="auto"`: the layers that do not fit the device stay in host
    RAM, beyond that on disk under `offload_folder`, and are brought to the device for their forward
    (accelerate's big-model inference)."""

    device: str = "cpu"
    max_memory: dict[int | str, int] | None = None
    offload_folder: str | None = None

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        if self.max_memory is None:
            return {}
        return {"device_map": "auto", "max_memory": self.max_memory, "offload_folder": self.offload_folder}


def load_model(path_or_id: str, *, revision: str | None = None, trust_remote_code: bool = False,
               allow_pickle_weights: bool = False, attn_implementation: str = "sdpa",
               token: str | None = None, dtype: Any = None, placement: Placement = Placement()) -> Any:
    """AutoModelForCausalLM placed as `placement` says, in `dtype` (a torch dtype or `fp32`/`bf16`/`fp16`;
    None: fp32, the trainer's masters: mixed precision is autocast's job, not the weights')."""
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, DTYPES[dtype])
    try:
        with _local_weights_quietly(path_or_id):
            model, loading = AutoModelForCausalLM.from_pretrained(
                path_or_id,
                revision=revision,
                trust_remote_code=trust_remote_code,
                use_safetensors=None if allow_pickle_weights else True,
                attn_implementation=kernel(attn_implementation),
                dtype=dtype or torch.float32,
                token=token,
                # Mismatches are collected and refused below, in one message, instead of a RuntimeError.
                ignore_mismatched_sizes=True,
                output_loading_info=True,
                **placement.from_pretrained_kwargs(),
            )
    except (OSError, ValueError) as exc:
        hint = ""
        if "safetensors" in str(exc).lower() and not allow_pickle_weights:
            hint = " (only safetensors weights load unless model.allow_pickle_weights: true)"
        raise ConfigError(f"model.name_or_path: cannot load {path_or_id!r}{hint}: {exc}") from None
    check_weights_fit(path_or_id, loading)
    return model if placement.max_memory is not None or placement.device == "cpu" else model.to(placement.device)


@contextlib.contextmanager
def _local_weights_quietly(path: str | Path) -> Iterator[None]:
    """transformers' per-tensor progress bars ("Loading weights", "Writing model shards") off while weights are read
    from or written to a local directory (nothing to wait for; they would only clutter the run's log); a hub id
    keeps its download bars."""
    from transformers.utils import logging as transformers_logging

    if not Path(path).is_dir() or not transformers_logging.is_progress_bar_enabled():
        yield
        return
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.enable_progress_bar()


def release_memory() -> None:
    """Collect what dropped models leave behind, before the next one loads: the objects their reference cycles
    keep alive (modules, hooks) and, on a GPU, the caching allocator's blocks."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_weights_fit(path_or_id: str, loading: dict[str, Any]) -> None:
    """Refuse a checkpoint whose weights do not fit its config.json: tensors of another shape, or weights
    the config needs that the checkpoint lacks. transformers would initialise those at random (with a
    warning in a long report), and fine-tuning would start from a partly untrained model."""
    mismatched = [f"{name}: checkpoint {list(ckpt)}, config {list(model)}"
                  for name, ckpt, model in sorted(loading.get("mismatched_keys") or [])]
    missing = sorted(loading.get("missing_keys") or [])
    if not (mismatched or missing):
        return
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) of another shape than the config says ({'; '.join(mismatched[:3])}"
                        + (" …)" if len(mismatched) > 3 else ")"))
    if missing:
        problems.append(f"{len(missing)} weight(s) the config needs are not in the checkpoint ({', '.join(missing[:3])}"
                        + (" …)" if len(missing) > 3 else ")"))
    raise ConfigError(f"model.name_or_path: {path_or_id}: the weights do not fit its config.json: {'; '.join(problems)}; "
                      "point it at a checkpoint whose config.json matches its weights")


def base_model_key(model: ModelSpec, tokenizer: str, seed: int) -> str:
    """Identity of the base model: its source, plus tokenizer and seed for a model built from a config."""
    from fulltune import __version__

    parts = {"model": model.model_dump(mode="json"), "version": __version__}
    if model.from_config is not None:
        parts["tokenizer"] = tree_sha256(tokenizer) if Path(tokenizer).exists() else tokenizer
        parts["seed"] = seed
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def prepare_base_model(model: ModelSpec, tokenizer: str, workdir: str | Path, seed: int) -> str:
    """The path or hub id the trainer and the evaluator load the base model from.

    A checkpoint is used where it is. A model built from a config is initialised once with `seed`,
    sized to the tokenizer, and saved under `<workdir>/base/<key>/`, so that training and the
    base-model evaluation see the same weights.
    """
    if model.from_config is None:
        return model.name_or_path
    import torch
    from transformers import AutoModelForCausalLM

    target = Path(workdir) / "base" / base_model_key(model, tokenizer, seed)
    if (target / "config.json").is_file():
        return str(target)
    tok = load_tokenizer(tokenizer, trust_remote_code=model.trust_remote_code)
    config = config_from_spec(model.from_config, len(tok))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(config, name, getattr(tok, name))
    torch.manual_seed(seed)
    built = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=model.attn_implementation)
    with atomic_dir(target) as tmp, _local_weights_quietly(tmp):
        built.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return str(target)
