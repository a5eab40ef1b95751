"""The memory levers in the real trainer (a child process, as the flow runs it): each changes where memory
goes, not what is learned — checked against a run without them — and a run with them resumes bit-exact (the steps
it trains again after resuming, as the first time)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from test_train import assets, make_job, model_tensors, quiet, run_with_fault, single_thread_children  # noqa: F401

pytestmark = pytest.mark.slow

# Global clipping and per-parameter clipping (step in backward) differ by design; compare without it.
NO_CLIP = dict(max_grad_norm=1e6, max_steps=4, checkpoint_every_steps=0, gradient_checkpointing=2)


@pytest.fixture(scope="module")
def plain(assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        return quiet(make_job(assets, tmp_path_factory.mktemp("plain") / "run", **NO_CLIP))


def test_optimizer_in_backward_offloaded_activations_and_chunked_loss_train_like_the_plain_step(
        assets: dict[str, Path], tmp_path: Path, plain) -> None:  # noqa: F811
    import torch

    # A plan steps in backward with accumulation 1 (fulltune.memory.Settings): the same 4 rows per step in one
    # micro-batch.
    job = make_job(assets, tmp_path / "run", optimizer_in_backward=True, offload_activations=True,
                   chunked_loss=True, micro_batch_size=4, gradient_accumulation_steps=1, **NO_CLIP)
    result = quiet(job)
    np.testing.assert_allclose([loss for _, loss in result.loss_history],
                               [loss for _, loss in plain.loss_history], rtol=1e-5)
    got, want = model_tensors(result.model_dir), model_tensors(plain.model_dir)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_pure_bf16_with_states_in_host_ram_learns_and_resumes_bit_exact(
        assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain) -> None:  # noqa: F811
    import torch

    from runs import assert_steps_trained_again_alike

    settings = dict(NO_CLIP, pure_bf16=True, offload_optimizer=True, chunked_loss=True, max_steps=6,
                    checkpoint_every_steps=3, max_grad_norm=1.0)
    job = make_job(assets, tmp_path / "killed", **settings)
    run_with_fault(job, "micro_step:11", monkeypatch)  # the first micro-batch of step 6
    result = quiet(job)
    assert result.resumed_from_step == 3
    # Steps 4 and 5 trained again from checkpoint 3 (the host's optimizer states among what it restores), each
    # to the loss it had the first time, bit for bit.
    assert_steps_trained_again_alike(Path(job.paths.output_dir), [4, 5])
    losses = [loss for _, loss in result.loss_history]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses
    assert all(t.dtype == torch.bfloat16 for t in model_tensors(result.model_dir).values())


def test_pure_bf16_kahan_adamw_tracks_the_fp32_run(assets: dict[str, Path], tmp_path: Path, plain) -> None:  # noqa: F811
    result = quiet(make_job(assets, tmp_path / "run", pure_bf16=True, **NO_CLIP))
    np.testing.assert_allclose([loss for _, loss in result.loss_history],
                               [loss for _, loss in plain.loss_history], rtol=0.02)


def test_impossible_lever_combinations_are_config_errors(assets: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    from fulltune.errors import ConfigError
    from fulltune.runtime.launch import validate_job

    job = make_job(assets, tmp_path / "run")
    for bad in (dict(optimizer_in_backward=True, offload_optimizer=True),
                dict(offload_optimizer=True, strategy="ddp", num_processes=2),
                dict(optimizer_in_backward=True, strategy="ddp", num_processes=2)):
        with pytest.raises(ConfigError):
            validate_job(job.replace(**bad))
