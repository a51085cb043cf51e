"""The GPU acceptance run's checks (``benchmarks/gpu_checks.py``) on CPU with gloo: every check's
logic, the rank launcher and the collectives staged through host memory (forced on CPU tensors,
as ranks sharing one GPU stage them), short of the CUDA calls themselves. The cpu_offload check
is left out: its launch is the others' (the ep check's FSDP2 collectives are staged too), its
judge is ``judge_parity`` (tests/unit/test_benchmarks.py) and its mesh's parity on CPU is
``tests/integration/test_train_loop.py``'s."""

from __future__ import annotations

import pytest

from benchmarks import gpu_checks


@pytest.mark.compat  # the flat collectives' names differ on torch 2.11: CI's compatibility job reruns it
def test_every_check_runs_on_cpu_and_says_why(tmp_path, corpus_cache, monkeypatch):
    monkeypatch.setattr(gpu_checks, "JOB_OVERRIDES", [f"--data.cache_dir={corpus_cache}"])
    checks = gpu_checks.run_checks(tmp_path, "cpu", steps=16, stage=True, skip=["cpu_offload parity"])
    oom, _, ep, experts, _, flat, fields = checks
    assert [c.passed for c in checks[:5]] == [True] * 5, [c.reason for c in checks]
    assert oom.data["snapshot"].endswith("rank1-oom-step3.json")
    assert experts.data["idle_experts"] == 6
    assert all(layer[:2] != [0, 0] and layer[2:] == [0] * 6 for layer in ep.data["expert_load"])
    # On CPU the device-memory checks have nothing to read: they fail, saying so.
    assert not flat.passed and "nothing to fit" in flat.reason
    assert not fields.passed and "device_allocated_bytes × 16" in fields.reason
    # The host-staged collectives carried the pipeline's P2P (the schedule's, the stages' warm-up
    # vote and shape inference), FSDP2's all-gather and reduce-scatter, and the experts' all-to-alls.
    # Which of them come as single sends and receives depends on the torch (2.13 sends the stages'
    # warm-up op by op; 2.11 and 2.15 batch it), so only the batched P2P and the object lists are
    # required of every torch.
    for name in ("batch_p2p", "send_object_list", "recv_object_list"):
        assert oom.data["staged"].get(name, 0) > 0, (name, oom.data["staged"])
    staged = ep.data["staged"]
    for names in (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor"),
                  ("all_to_all_single",), ("all_to_all_single_autograd",)):  # FSDP2's names vary by torch release
        assert any(staged.get(n, 0) > 0 for n in names), (names, staged)
