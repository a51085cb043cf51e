"""Context parallelism (``parallelism.cp``) equal to one worker: Llama (GQA) and DeepSeek-V2 (MLA)
with the sequence split over 2 or 4 cp ranks, alone and composed with dp_shard, tp and pp; the
step losses the collector assembles and the gradient norms over 10 steps within the other parity
tests' 1e-4 relative of the same one-process runs (tests/integration/test_parallel_parity.py's),
with and without document masks.

A mutation that skips the key/value all-gather fails these (each rank would attend only to its
own chunks); one that skips the load balancing is caught by the unit test of the balancer
(tests/unit/test_context_parallel.py), since a contiguous split computes the same function.
"""

from __future__ import annotations

import pytest

from tests.integration.test_parallel_parity import _check_parity, _curve, _run, corpus, references  # noqa: F401

CP = {
    "llama_cp2": ("llama", 2, ["--parallelism.cp=2"]),
    "llama_cp2_dp_shard2": ("llama", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"]),
    "llama_cp2_tp2": ("llama", 4, ["--parallelism.cp=2", "--parallelism.tp=2"]),
    "llama_cp4": ("llama", 4, ["--parallelism.cp=4"]),
    "llama_cp2_pp2": ("llama", 4, ["--parallelism.cp=2", "--parallelism.pp=2", "--parallelism.microbatches=2"]),
    "deepseek_cp2_dp_shard2": ("deepseek_v2", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"]),
}


@pytest.mark.parametrize("name", list(CP))
def test_context_parallel_matches_one_worker(name, corpus, references):  # noqa: F811
    model, nproc, flags = CP[name]
    run = _run(corpus / name, model, nproc, flags)
    _check_parity(name, run, references(model))
    assert set(run[1]["cp"].to_pylist()) == set(range(run[2].cp))
