"""fulltune's optimizers on FSDP2 shards (DTensor parameters): two sharded processes train like one.

Runs are tests/sharding_worker.py (a 2-layer Llama, hidden 64, 4 fixed rows per step; see
tests/test_sharding.py): one process against two torchrun FSDP processes, each with fulltune's
`build_optimizer`. The sharded runs also save model and optimizer with `sharding.save_sharded_state`
before step 3, take it, load the state back and take it again (`--rewind-at 3`): a lost or partial
optimizer state would leave them a whole step (~1% of the loss) off the one-process run.

- adafactor (fp32): `GatheredOptimizer` gathers each parameter and its gradient and runs the unchanged
  transformers update, so only the order of the gradient reduce-scatter's sums differs: measured 1.3e-7
  relative on the losses over 6 steps; asserted at 1e-5.
- pure bf16 adamw (torch-optimi Kahan, per-parameter loop on shards): bf16 gradients reduced in another
  order round differently; measured 3.7e-4 relative at most over 6 steps; asserted at 2e-3.
- muon (torch Muon on each decoder matrix gathered whole with its momentum, AdamW on the other shards):
  the gradients' other summation order, rounded by the orthogonalisation's bf16 matmuls, measured 3.0e-5
  relative at most over 6 steps; asserted at 1e-4. The sharded run with the save/load round trip gives
  the losses of one without it to the bit.
Each pair costs ~25 s on 2 cores, hence `slow`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_sharding import one_process, two_sharded

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("options", "tolerance"), [
    (("--optimizer", "adafactor"), 1e-5),
    (("--optimizer", "adamw", "--pure-bf16"), 2e-3),
    (("--optimizer", "muon"), 1e-4),
], ids=["adafactor", "pure_bf16_kahan_adamw", "muon"])
def test_two_fsdp_processes_step_and_resume_the_optimizer_like_one_process(tmp_path: Path, options: tuple,
                                                                            tolerance: float) -> None:
    one = one_process(tmp_path / "one", *options)
    two = two_sharded(tmp_path / "two", *options, "--rewind-at", "3")
    assert two["weights"]["sharded"] and not one["weights"]["sharded"]
    assert (tmp_path / "two" / "rewind" / ".metadata").is_file()
    assert two["losses"][-1] < two["losses"][0]
    assert two["losses"] == pytest.approx(one["losses"], rel=tolerance)
