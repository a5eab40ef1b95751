"""Generate text with the current champion of a model that fulltune registered in MLflow.

This is what a downstream service does: it never asks which version is best, it loads
`models:/<name>@champion`, which fulltune's register stage moves only when a new version beats the
old champion on held-out data.

    python examples/load_champion.py --model NAME --prompt "Once upon a time"
    python examples/load_champion.py --model NAME --tracking-uri http://mlflow.internal:5000 \
        --prompt "Once upon a time" --max-new-tokens 32

NAME is the pipeline's `register.model_name` in pipelines.yaml.

The tracking URI comes from --tracking-uri, else $MLFLOW_TRACKING_URI, else fulltune's laptop default
(the SQLite store `mlflow.db` in $FULLTUNE_WORKDIR, or in `.fulltune` under the current directory).
Exit code 2 means the model, its alias or the store does not exist; the message says which.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# fulltune's store when MLFLOW_TRACKING_URI is unset: <workdir>/mlflow.db, the workdir being
# $FULLTUNE_WORKDIR or `.fulltune` next to pipelines.yaml (run this from the repository root).
LOCAL_STORE = Path(os.environ.get("FULLTUNE_WORKDIR") or ".fulltune") / "mlflow.db"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Load models:/NAME@ALIAS from MLflow as a text-generation pipeline and print a generation.",
    )
    parser.add_argument(
        "--model", required=True, help="registered model name (`register.model_name` in pipelines.yaml)"
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument(
        "--alias", default="champion", help="registry alias to load (default: champion; `challenger` is the newest)"
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking server or store (default: $MLFLOW_TRACKING_URI, else sqlite:///.fulltune/mlflow.db)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="number of tokens to generate (default: 64)"
    )
    parser.add_argument(
        "--device", default=None, help="device for the pipeline, e.g. cpu, cuda, cuda:1 (default: transformers' choice)"
    )
    return parser.parse_args(argv)


def resolve_tracking_uri(cli_value: str | None) -> str | None:
    """The store to read from, or None when none is given and fulltune's local store does not exist.

    A missing local store is reported rather than opened: MLflow would create an empty one and then
    only say that the model does not exist.
    """
    if cli_value:
        return cli_value
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if LOCAL_STORE.is_file():
        return f"sqlite:///{LOCAL_STORE}"
    return None


def redact(uri: str) -> str:
    """`postgresql://user:secret@db/mlflow` → `postgresql://user:***@db/mlflow`, for messages."""
    return re.sub(r"(?<=://)([^:/@\s]+):([^@/\s]+)@", r"\1:***@", uri)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tracking_uri = resolve_tracking_uri(args.tracking_uri)
    if tracking_uri is None:
        print(
            f"error: no MLflow store given and no local store at {LOCAL_STORE} under {Path.cwd()}; "
            "pass --tracking-uri URI or set MLFLOW_TRACKING_URI",
            file=sys.stderr,
        )
        return 2

    # Imported here so that --help answers without importing torch and transformers.
    import mlflow
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    try:
        version = mlflow.MlflowClient().get_model_version_by_alias(args.model, args.alias)
    except MlflowException as exc:
        print(
            f"error: {redact(tracking_uri)} has no version of model {args.model!r} with alias {args.alias!r}"
            f" ({exc.message})",
            file=sys.stderr,
        )
        return 2
    print(
        f"loading models:/{args.model}@{args.alias} (version {version.version}, run {version.run_id})"
        f" from {redact(tracking_uri)}",
        file=sys.stderr,
    )

    # A transformers text-generation pipeline (fulltune logs its models with task="text-generation").
    generator = mlflow.transformers.load_model(f"models:/{args.model}@{args.alias}", device=args.device)
    outputs = generator(args.prompt, max_new_tokens=args.max_new_tokens)
    print(outputs[0]["generated_text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
