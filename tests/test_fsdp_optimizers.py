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
The three one-process runs share one process and the three sharded runs one torchrun (the worker's `--then`:
each run builds its model from its seed and resets the Accelerator), hence one start of each for all three.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from test_sharding import STEPS, WORKER, _sharded_run, _torchrun, chained, result, run

pytestmark = pytest.mark.slow

# name: (the worker's options, the relative tolerance on the losses: see above)
OPTIMIZERS = {
    "adafactor": (("--optimizer", "adafactor"), 1e-5),
    "pure_bf16_kahan_adamw": (("--optimizer", "adamw", "--pure-bf16"), 2e-3),
    "muon": (("--optimizer", "muon"), 1e-4),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Each optimizer's one-process run (`one/<name>`) and two-process FSDP run (`two/<name>`) under one root."""
    root = tmp_path_factory.mktemp("optimizers")
    run([sys.executable, str(WORKER), *chained([[str(root / "one" / name), "--steps", str(STEPS), "--micro", "2",
                                                 *options] for name, (options, _) in OPTIMIZERS.items()])])
    run(_torchrun("--standalone", "--nproc_per_node", "2", str(WORKER),
                  *chained([_sharded_run(root / "two" / name, STEPS, *options, "--rewind-at", "3")
                            for name, (options, _) in OPTIMIZERS.items()])))
    return root


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_two_fsdp_processes_step_and_resume_the_optimizer_like_one_process(trained: Path, name: str) -> None:
    one, two = result(trained / "one" / name), result(trained / "two" / name)
    assert two["weights"]["sharded"] and not one["weights"]["sharded"]
    assert (trained / "two" / name / "rewind" / ".metadata").is_file()
    assert two["losses"][-1] < two["losses"][0]
    assert two["losses"] == pytest.approx(one["losses"], rel=OPTIMIZERS[name][1])
