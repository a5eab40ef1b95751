"""`fulltune` command line: validate, list, plan, run, serve.

User errors (bad config, missing data, an impossible budget) print one message and exit with code 2.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from fulltune.errors import DiskFull, Interrupted, UserError, disk_full, disk_full_error

DEFAULT_FILE = "pipelines.yaml"


def _environment() -> None:
    # Prefect's temporary server otherwise tries to send telemetry; tokenizers forks badly with threads.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "true")
    # Prefect waits 20 s for its temporary server, which a busy 2-core machine can miss.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


class _HideUserErrorTracebacks(logging.Filter):
    """Prefect logs a failed task's traceback; for a user error the CLI's one message is enough. For
    Ctrl-C it logs "Crash detected!" per task and flow; the CLI's one line says what stopped instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            return False
        return not record.getMessage().startswith(INTERRUPT_CRASH)


# What Prefect logs for a task or flow that KeyboardInterrupt stopped.
INTERRUPT_CRASH = "Crash detected! Execution was aborted by an interrupt signal"


def _quiet_user_errors() -> None:
    hide = _HideUserErrorTracebacks()
    for name in ("prefect", "prefect.task_runs", "prefect.flow_runs", "prefect.flow_engine", "prefect.task_engine"):
        logging.getLogger(name).addFilter(hide)
    for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
        handler.addFilter(hide)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-f", "--file", default=DEFAULT_FILE, help="pipelines file (default: pipelines.yaml)")
    common.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a pipeline field, e.g. --set train.learning_rate=1e-4 (repeatable)")
    parser = argparse.ArgumentParser(prog="fulltune", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", parents=[common], help="check a pipelines file; report every problem")
    validate.add_argument("path", nargs="?", help="pipelines file (same as -f)")
    sub.add_parser("list", parents=[common], help="list the pipelines of the file")
    plan = sub.add_parser("plan", parents=[common], help="show the memory estimate and the plan that fits")
    plan.add_argument("name")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--simulate", action="store_true", help="also trace one step under FakeTensorMode")
    plan.add_argument("--measure", action="store_true", help="also run two real steps and report the peak")
    plan.add_argument("--autotune", action="store_true",
                      help="run the top candidates for a few steps on this machine and choose the fastest that fits")
    run = sub.add_parser("run", parents=[common], help="run a pipeline end to end")
    run.add_argument("name")
    serve = sub.add_parser("serve", parents=[common], help="serve one Prefect deployment per pipeline")
    serve.add_argument("--limit", type=int, default=None, help="maximum concurrent runs")
    return parser


# The status `_leave_without_teardown` exits with: 1 until a command returns (an uncaught exception).
_exit_status = {"code": 1}


def _leave_without_teardown() -> None:
    """End the program right after its exit handlers, skipping the interpreter's teardown of its modules.

    Tearing down what a run imports (Prefect, MLflow, SQLAlchemy, pandas, torch: millions of objects for the
    garbage collector's final passes) took 2.3 s of a cached rerun's 9.4 s on an idle 2-core machine
    (BENCHMARKS.md, "Fixed cost"), and does nothing a user needs: outputs are written atomically and fsynced, MLflow's store has committed,
    and the exit handlers that matter (Prefect's last states and logs, stopping the temporary server) were
    registered later, so they run before this one. Only logging's own handler came earlier: it runs here.
    """

    def leave() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_exit_status["code"])

    atexit.register(leave)


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: this program's arguments); its exit status."""
    if argv is None:  # the program itself; a caller in this process (a test) keeps its interpreter
        _leave_without_teardown()
        # `kill -USR1 <pid>` prints every thread's stack to stderr: what a run that seems stuck is doing.
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        code = _main(argv)
    except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
        _exit_status["code"] = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    _exit_status["code"] = code
    return code


def _main(argv: list[str] | None) -> int:
    from fulltune.logs import quiet_known_noise

    _environment()
    quiet_known_noise()
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:
        _stop_children()
        print(f"interrupted: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        _stop_children()
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a full disk before or after the stages (the flow words the stages' own)
        if not disk_full(exc):
            raise
        print(f"error: {disk_full_error(exc, Path.cwd(), 'the stages that finished are cached')}", file=sys.stderr)
        return DiskFull.exit_code


def _stop_children() -> None:
    """Stop the trainers and evaluators this process still waits on (fulltune.runtime.launch.stop_children);
    none when the launcher was never imported."""
    launch = sys.modules.get("fulltune.runtime.launch")
    if launch is not None:
        launch.stop_children()


def cmd_validate(args: argparse.Namespace) -> int:
    """The schema, then every file the pipelines read: each missing local file (and, offline, each hub
    id missing from the cache) is listed with its YAML path; hub ids online are left to run time."""
    from fulltune.errors import ConfigError
    from fulltune.stages import check_sources, resolve_pipeline
    from fulltune.pipelines_file import load_pipelines, read_yaml

    path = args.path or args.file
    names = read_yaml(Path(path)).get("pipelines") or {}
    # `--set` applies to every pipeline of the file, as `plan` and `run` apply it to the one they run.
    pipelines = load_pipelines(path, {name: args.overrides for name in names} if isinstance(names, dict) else None)
    problems, notes = [], []
    for name in pipelines.pipelines:
        found, said = check_sources(resolve_pipeline(path, name, args.overrides))
        problems += found
        notes += said
    if problems:
        raise ConfigError(f"{path}: {len(problems)} problem(s)\n  " + "\n  ".join(problems))
    for note in notes:
        print(f"note: {note}")
    print(f"{path}: {len(pipelines.pipelines)} pipeline(s) valid: {', '.join(pipelines.pipelines)}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from fulltune.data.sources import describe
    from fulltune.pipelines_file import load_pipelines

    pipelines = load_pipelines(args.file)
    for name, spec in pipelines.pipelines.items():
        source = spec.model.name_or_path or "from_config"
        schedule = f"  schedule: {spec.schedule}" if spec.schedule else ""
        print(f"{name:20s} model: {source}  data: {describe(spec.data.train)}{schedule}")
        if spec.description:
            print(f"{'':20s} {spec.description}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from fulltune.errors import BudgetError
    from fulltune.stages.budget import plan_and_tune
    from fulltune.stages import pin_hub_revisions, resolve_pipeline, with_budget

    p = with_budget(pin_hub_revisions(resolve_pipeline(args.file, args.name, args.overrides)))
    # --simulate plans for the larger of the estimate and the traced step; otherwise estimate + margin.
    # --autotune (or budget.autotune: true) measures the top candidates on this machine (fulltune/planning/autotune.py).
    try:
        decision = plan_and_tune(p, trace=bool(args.simulate), force=True if args.autotune else None,
                                 auto_tunes=False)
    except BudgetError as exc:  # nothing fits: a script still gets the plan that says so, and exit 2
        if args.json and exc.plan is not None:
            print(json.dumps(exc.plan, indent=2))
        raise
    extra: dict[str, Any] = {}
    if args.simulate or args.measure:
        extra = _simulate_or_measure(p, decision, decision.vocab_size, args.simulate, args.measure)
    if args.json:
        print(json.dumps({**decision.plan, **extra}, indent=2))
    else:
        print(decision.table)  # with why autotune did not run, when it did not
        if extra:
            print(_comparison_table(decision.plan["plan"]["estimate"], extra))
    return 0


def _comparison_table(analytic: dict[str, Any], extra: dict[str, Any]) -> str:
    """The analytic breakdown beside the traced one (and the measured peak) for the planned settings."""
    from fulltune.memory import format_bytes

    columns = [("analytic", analytic)] + ([("simulated", extra["simulated"])] if "simulated" in extra else [])
    rows = [f"{'':18s}" + "".join(f"{name:>14s}" for name, _ in columns)]
    for key in analytic["breakdown"]:
        if key == "runtime_overhead":
            continue
        rows.append(f"{key:18s}" + "".join(f"{format_bytes(c['breakdown'].get(key, 0)):>14s}" for _, c in columns))
    rows.append(f"{'peak (allocated)':18s}" + "".join(f"{format_bytes(c['peak_bytes']):>14s}" for _, c in columns))
    if "measured_peak_bytes" in extra:
        measured = extra["measured_peak_bytes"]
        error = (analytic["peak_bytes"] - measured) / measured * 100
        rows.append(f"measured peak {format_bytes(measured)}: the analytic estimate is {error:+.1f}% off")
    return "\n".join(rows)


def _simulate_or_measure(p: Any, decision: Any, vocab: int | None, simulate: bool, measure: bool) -> dict[str, Any]:
    from fulltune.errors import ConfigError
    from fulltune.planning import measure_memory, simulate_memory
    from fulltune.models import read_model_config

    strategy = decision.settings.strategy  # what the plan chose (strategy auto, or unset for one process)
    if not decision.settings.dims.alone or decision.settings.num_processes != 1:
        raise ConfigError(f"pipelines.{p.name}.distributed.strategy: --simulate and --measure run one process; "
                          f"the analytic plan covers {strategy} (drop the flags, or --set distributed.strategy=none "
                          "--set distributed.num_processes=1)")
    config = read_model_config(p.spec.model, vocab)
    settings = decision.settings
    extra: dict[str, Any] = {}
    try:
        if simulate:
            traced = simulate_memory(config, settings)
            extra["simulated"] = traced.to_dict() if hasattr(traced, "to_dict") else traced
        if measure:
            extra["measured_peak_bytes"] = measure_memory(config, settings)
    except ValueError as exc:  # e.g. measuring on cuda where no GPU is visible
        raise ConfigError(f"pipelines.{p.name}.budget.device: {exc}") from None
    return extra


def cmd_run(args: argparse.Namespace) -> int:
    from flows.server import start_temporary_server
    from fulltune.stages import ensure_local_data, ensure_workdir, pin_hub_revisions, resolve_pipeline, resolved_budget

    # Validate before any stage runs, so a bad config costs seconds, starts no server and leaves nothing
    # behind. The temporary Prefect server then boots (in its own process; it writes nothing to the workdir)
    # while the flow's imports and MLflow's start-up run here.
    p = resolve_pipeline(args.file, args.name, args.overrides)
    ensure_local_data(p, check_hub=True)
    pin_hub_revisions(p)
    resolved_budget(p)
    server = start_temporary_server() if _check_servers(p.workdir) else None
    try:
        ensure_workdir(p)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    try:
        _quiet_user_errors()
        from flows.pipeline import Overrides, finetune_pipeline
        from flows.server import connect

        from fulltune.pipelines_file import parse_override
        from fulltune.tracking import warm_up

        warm_up(p.workdir)
        connect(server)
        # What the imports made (Prefect, MLflow, torch, transformers: millions of objects) lives as long as the
        # process: out of the collector's passes, each full one (and the evaluate stage's between models) then
        # scans only what the run itself allocates.
        gc.freeze()
        overrides = {".".join(parts): value for parts, value in map(parse_override, args.overrides)}
        summary = finetune_pipeline(pipeline=args.name, overrides=Overrides(extra=overrides) if overrides else None,
                                    pipelines_file=str(Path(args.file).resolve()))
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(f"pipeline {p.name} stopped; rerunning continues after the stages that finished "
                          "(they are cached)") from None
    print()
    print("\n".join(summary.lines()))
    return 0


def _check_servers(workdir: str) -> bool:
    """Check that the Prefect API and the MLflow server the run will use answer, before any stage runs
    (their clients would otherwise retry for minutes); whether a temporary Prefect server is needed."""
    from flows.server import check_api_url
    from fulltune.tracking import check_tracking_server

    api = os.environ.get("PREFECT_API_URL")
    if api:
        check_api_url(api)
    check_tracking_server(workdir)
    return not api


def cmd_serve(args: argparse.Namespace) -> int:
    from flows.server import check_api_url

    if os.environ.get("PREFECT_API_URL"):
        check_api_url(os.environ["PREFECT_API_URL"])
    from flows.deployments import serve_pipelines

    serve_pipelines(str(Path(args.file).resolve()), limit=args.limit)
    return 0


COMMANDS = {"validate": cmd_validate, "list": cmd_list, "plan": cmd_plan, "run": cmd_run, "serve": cmd_serve}


if __name__ == "__main__":
    sys.exit(main())
