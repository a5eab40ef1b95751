"""Shared fixtures: an isolated Prefect server per session, and tiny pipelines in temp workdirs."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile

# Before anything imports prefect or tokenizers.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("FULLTUNE_WORKDIR", None)
# A Hugging Face cache of the session's own: tests write fake hub repositories into it (tests/tiny.py),
# and nothing a developer has cached can make a test pass or fail.
for _name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
    os.environ.pop(_name, None)
_HF_HOME = tempfile.mkdtemp(prefix="fulltune-test-hf-")
os.environ["HF_HOME"] = _HF_HOME
atexit.register(shutil.rmtree, _HF_HOME, True)
# fulltune's machine cache (traced peaks, fulltune/planning/trace.py) of the session's own, shared by the
# pytest-xdist workers (they inherit it from the process that starts them, which removes it at the end).
if "FULLTUNE_TEST_CACHE_DIR" not in os.environ:
    os.environ["FULLTUNE_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="fulltune-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FULLTUNE_TEST_CACHE_DIR"], True)
os.environ["FULLTUNE_CACHE_DIR"] = os.environ["FULLTUNE_TEST_CACHE_DIR"]

# The commands the tests start get Ctrl-C as a terminal's foreground job does. A shell that starts the test
# runner in the background (`make test &`, a CI step run with `&`) ignores SIGINT and SIGQUIT in it, and an
# ignored signal stays ignored across fork and exec: every `fulltune run` would then ignore the Ctrl-C that
# tests/test_interrupt.py sends, and hang there. Restored to Python's own handlers here, the children start
# with the default dispositions (exec resets a handled signal; only an ignored one is inherited).
for _signal, _handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL)):
    if signal.getsignal(_signal) == signal.SIG_IGN:
        signal.signal(_signal, _handler)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hf_home() -> Path:
    """The session's HF_HOME (huggingface_hub read it at import): write fake hub repos under `hub/`."""
    return Path(_HF_HOME)


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect API for the whole session (prefect_test_harness), per pytest-xdist worker: the
    flows this process runs use it, and so do the `fulltune run` processes given its URL (`runs.fulltune_run`)
    — `PREFECT_API_URL`, the door a team with a Prefect server uses. The tests of the temporary server a
    run starts when none is named (the default) start theirs without it."""
    from prefect.settings import get_current_settings
    from prefect.testing.utilities import prefect_test_harness

    from flows.server import UNUSED_SERVICES

    for name, value in UNUSED_SERVICES.items():  # as the temporary server of a run: no idle polling
        os.environ.setdefault(name, value)
    with prefect_test_harness(server_startup_timeout=120):
        yield get_current_settings().api.url


# The longest files first (by their wall time on the 2-core CI machine): `make test`'s `--dist loadfile
# --no-loadscope-reorder` hands files out in this order, so the last minutes are short files on both workers,
# not one worker finishing a long file alone (xdist's own order, most tests first, left the files of one long
# test to the end).
LONGEST_FIRST = ("test_train.py", "test_tensor_parallel.py", "test_plan_margin.py", "test_context_parallel.py",
                 "test_lever_table.py", "test_float8.py", "test_fsdp_run.py", "test_cache_keys.py",
                 "test_pipeline_run.py", "test_flow.py", "test_cli.py", "test_servers.py", "test_memory_accuracy.py",
                 "test_interrupt.py", "test_fsdp_optimizers.py", "test_hub.py", "test_fsdp_levers.py",
                 "test_sharding.py", "test_autotune.py", "test_benchmark_gate.py", "test_rerun.py",
                 "test_tensor_parallel_memory.py", "test_train_levers.py", "test_frontier_plan.py",
                 "test_retrain.py", "test_concurrency.py", "test_cpu_rss.py", "test_eval_sources.py",
                 "test_sharded_load.py", "test_ui.py", "test_data_memory.py", "test_evaluate.py",
                 "test_process_memory.py", "test_sharded_memory.py")


def pytest_collection_modifyitems(config, items):
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_mlflow_environment():
    """`mlflow.set_tracking_uri` exports the URI to the environment; keep one test's database from
    leaking into the next test's child processes."""
    yield
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        os.environ.pop(name, None)


@pytest.fixture
def shared_run(tmp_path_factory, prefect_server):
    """`shared_run(**sections)`: a started `runs.SharedRun` of the tiny pipeline, trained once per session
    (across pytest-xdist workers); `.finish()` gives its directory. Released at teardown whatever happens."""
    from runs import SharedRun

    started = []

    def start(**sections):
        started.append(SharedRun(tmp_path_factory, prefect_server, **sections).start())
        return started[-1]

    yield start
    for run in started:
        run.close()
