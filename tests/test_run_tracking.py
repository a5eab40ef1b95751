"""The trainer's metrics.jsonl forwarded into its MLflow run by the launching process
(fulltune/runtime/run_tracking.py): every line once, in order, across a crash of the launcher; an MLflow that
cannot be reached costs a warning, not the training."""

from __future__ import annotations

from pathlib import Path

from fulltune.runtime.run_tracking import FORWARDED_FILE, METRICS_FILE, Forwarded, metric_line


def _write(path: Path, text: str) -> None:
    with open(path, "a") as handle:
        handle.write(text)


def test_each_line_is_forwarded_once_also_after_the_launcher_is_replaced(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "a"))).info.run_id
    out = tmp_path / "run"
    out.mkdir()
    metrics = out / METRICS_FILE
    _write(metrics, metric_line(1, 1000, {"train_loss": 2.0, "grad_norm": float("nan")}))
    _write(metrics, metric_line(2, 2000, {"train_loss": 1.5}) + '{"step": 3, "timest')  # the trainer mid-line

    first = Forwarded(uri, run_id, out)
    first.forward()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train_loss")] == [(1, 2.0), (2, 1.5)]
    assert "grad_norm" not in client.get_run(run_id).data.metrics  # not finite: not logged

    # The line is finished and another follows; a new launcher (a rerun) forwards only those.
    _write(metrics, 'amp": 3000, "values": {"train_loss": 1.25}}\n' + metric_line(4, 4000, {"train_loss": 1.0}))
    Forwarded(uri, run_id, out).forward()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train_loss")] == [
        (1, 2.0), (2, 1.5), (3, 1.25), (4, 1.0)]
    assert int((out / FORWARDED_FILE).read_text()) == metrics.stat().st_size


def test_an_unreachable_mlflow_warns_once_and_keeps_the_lines(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "run"
    out.mkdir()
    _write(out / METRICS_FILE, metric_line(1, 1000, {"train_loss": 2.0}))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    forwarded = Forwarded("http://127.0.0.1:9", "0123456789abcdef", out)  # nothing listens on port 9
    forwarded.forward()
    forwarded.forward()
    err = capsys.readouterr().err
    assert err.count("could not log training metrics to MLflow") == 1 and METRICS_FILE in err
    assert not (out / FORWARDED_FILE).exists()  # nothing was sent: a later forward sends it all
