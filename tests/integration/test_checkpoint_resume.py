"""A resumed run continues the loss curve exactly: one-process references through the launcher."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_checkpoint import _cfg, _saved_run, _train


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus_cache):
    return _saved_run(tmp_path_factory, corpus_cache)


@pytest.mark.compat
def test_resume_continues_the_loss_curve_exactly(saved, tmp_path, corpus_cache):
    run_dir, _, losses = saved
    cfg = _cfg(tmp_path, corpus_cache, f"--checkpoint.load_path={run_dir / 'checkpoints' / 'step-00000002'}")
    resumed, *_ = _train(tmp_path, cfg, save=False)
    assert len(resumed) == 2
    np.testing.assert_allclose(resumed, losses[2:], rtol=1e-6)
