"""``training.compile``: each block compiled with inductor, composed with pipeline parallel,
FSDP2, expert parallel and activation checkpointing in the parallelize order, trains the same
curve as eager: step losses and gradient norms over 10 steps within 1e-5 relative (fp32), on the
main job's mesh (pp=2 × dp_shard=2, 1F1B, full AC) and the MoE job's (the same with ep=2).

Both runs of a case use the torch.multiprocessing path of ``test_parallel_parity`` (no Ray). The
inductor cache is private to the test, so the compile is really done.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.test_parallel_parity import _curve, _run

RTOL = 1e-5
MESH = ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.microbatches=2"]
# Full activation checkpointing on the dense case: the compiled region is then the checkpointed block.
CASES = {"llama": [*MESH, "--activation_checkpoint.mode=full"], "deepseek_v2": [*MESH, "--parallelism.ep=2"]}


@pytest.mark.parametrize("model", sorted(CASES))
def test_compile_matches_eager(model, tmp_path, corpus_cache):
    (tmp_path / "corpus").symlink_to(corpus_cache)
    eager = _run(tmp_path / "eager", model, 4, CASES[model])
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    compiled = _run(tmp_path / "compiled", model, 4, [*CASES[model], "--training.compile=true"], env=env)
    for (summary, _, _) in (eager, compiled):
        assert summary["errors"] == [], summary["errors"]
    for column in ("step_loss", "grad_norm"):
        np.testing.assert_allclose(_curve(compiled[1], column), _curve(eager[1], column), rtol=RTOL,
                                   err_msg=f"{model}: {column}, compiled vs eager")
