"""The temporary Prefect API of a `fulltune run`, and the check that a configured one answers.

Prefect's own temporary server (what a flow starts when `PREFECT_API_URL` is unset) runs in the CLI's
process group. Ctrl-C in a terminal signals that whole group, so the server died with the run and
the flow then spent minutes retrying "Error logging to API" before exiting with a traceback. The
server started here runs in a session of its own, out of reach of the terminal's SIGINT, and ends with
the process that started it (PR_SET_PDEATHSIG where Linux offers it, a parent watch everywhere), so an
interrupted run can still report its states and exits in seconds.

It also starts booting before the flow's imports (Prefect, torch, transformers, MLflow) run, so its
start-up overlaps them instead of adding to them.

Starting the server imports nothing of Prefect in the calling process; `connect` then points Prefect's
settings at it, unless a profile or prefect.toml already names an API.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from fulltune.errors import ConfigError

# Prefect's default (20 s) is too short for a busy 2-core machine; the CLI sets the same variable.
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
# How long `stop` lets a server that is still starting finish before it stops it.
STOP_WAIT_SECONDS = 30.0
# uvicorn exits with 3 when its port was taken between choosing it and binding it.
PORT_IN_USE = 3
# The server's background services one local run never uses — schedules, workers' heartbeats, late, paused or
# cancelled runs, automations — each polls the database every few seconds: off (0.7 of 1.8 CPU-s a minute idle,
# measured). A setting in the environment wins.
UNUSED_SERVICES = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "SCHEDULER", "LATE_RUNS", "FOREMAN", "REPOSSESSOR", "CANCELLATION_CLEANUP", "PAUSE_EXPIRATIONS", "TRIGGERS")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


class TemporaryServer:
    """A Prefect API server on a free local port, in its own session, for the life of this process."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.started = time.monotonic()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> TemporaryServer:
        """Start the server process and return at once; `wait` blocks until it answers."""
        env = {**UNUSED_SERVICES, **os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        env.pop("PREFECT_API_URL", None)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flows.server", str(self.port), str(os.getpid())],
            env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait(self, timeout: float | None = None) -> float:
        """Block until the API answers; the seconds since `start`. RuntimeError when it never does."""
        timeout = timeout if timeout is not None else float(os.environ.get(STARTUP_TIMEOUT_ENV, "120"))
        deadline, port_retries = self.started + timeout, 3
        while time.monotonic() < deadline:
            assert self.process is not None
            code = self.process.poll()
            if code == PORT_IN_USE and port_retries > 0:
                port_retries -= 1
                self.port = _free_port()
                self.start()
                continue
            if code is not None:
                raise RuntimeError(f"the temporary Prefect server exited with code {code} before it answered")
            if _answers(f"{self.api_url}/health", timeout=1.0):
                return time.monotonic() - self.started
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the temporary Prefect server did not answer within {timeout:.0f} s "
                           f"(raise {STARTUP_TIMEOUT_ENV})")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s). One still starting is let finish first (up
        to STOP_WAIT_SECONDS): Prefect's server stopped before its services start fails its own shutdown
        with a traceback on the terminal ("Reactive triggers not started"), after a user error's message."""
        if self.process is None or self.process.poll() is not None:
            return
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        while (time.monotonic() < deadline and self.process.poll() is None
               and not _answers(f"{self.api_url}/health", timeout=1.0)):
            time.sleep(0.05)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_temporary_server() -> TemporaryServer:
    """Start a temporary Prefect API; it boots while the caller imports and checks what it needs.

    The server is stopped when this process exits, by an atexit handler registered before Prefect is
    imported, so it runs after Prefect's own exit handlers have sent their last logs and states.
    """
    server = TemporaryServer().start()
    atexit.register(server.stop)
    return server


def connect(server: TemporaryServer | None) -> TemporaryServer | None:
    """Point Prefect at the API this run uses, after `flows.pipeline` (and with it Prefect) is imported.

    An API configured in Prefect's settings (a profile, prefect.toml) wins over the temporary server,
    which is then stopped; it is checked like PREFECT_API_URL. Otherwise Prefect's settings are
    refreshed to name the temporary server, and this waits until it answers.
    """
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    configured = get_current_settings().api.url
    if server is None or (configured and configured != server.api_url):
        if server is not None:
            server.stop()
        if configured:
            check_api_url(configured)
        return None
    os.environ["PREFECT_API_URL"] = server.api_url
    os.environ.setdefault("PREFECT_UI_URL", "")  # it serves no UI: no "View at" link to a page that is not there
    refresh_global_settings_context()
    server.wait()
    return server


def check_api_url(url: str, timeout: float = 5.0) -> None:
    """Raise ConfigError naming PREFECT_API_URL when no Prefect API answers at `url`."""
    health = url.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):  # an API behind authentication answers: the client brings its key
            return
        reason = f"{health} answered HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        reason = str(getattr(exc, "reason", exc))
    raise ConfigError(f"PREFECT_API_URL={url}: no Prefect API answers there ({reason}); start the server, or "
                      "unset PREFECT_API_URL to let fulltune run a temporary one")


# ---------------------------------------------------------------------------------------------------
# The server process itself: python -m flows.server PORT PARENT_PID


def _end_with_parent(parent: int) -> None:
    """Stop this server when `parent` ends, also when it was killed and could not stop it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the watch below is enough

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    # The parent may have ended before prctl took effect; the watch also covers that.
    threading.Thread(target=watch, daemon=True).start()


def _serve(port: int, parent: int) -> None:
    _end_with_parent(parent)
    import uvicorn

    try:
        uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1", port=port,
                    log_level="error", lifespan="on")
    except SystemExit as exc:
        # uvicorn exits 1 when it cannot bind; say "port in use" so the parent picks another
        raise SystemExit(PORT_IN_USE if exc.code == 1 else exc.code) from None


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
