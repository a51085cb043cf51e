"""The GPU acceptance run's checks (``benchmarks/gpu_checks.py``) on CPU with gloo: every check's
logic, the rank launcher and the collectives staged through host memory (forced on CPU tensors,
as ranks sharing one GPU stage them), short of the CUDA calls themselves."""

from __future__ import annotations

from benchmarks import gpu_checks


def test_every_check_runs_on_cpu_and_says_why(tmp_path, corpus_cache, monkeypatch):
    monkeypatch.setattr(gpu_checks, "JOB_OVERRIDES", [f"--data.cache_dir={corpus_cache}"])
    oom, offload, resume, experts, verdict, flat, fields = gpu_checks.run_checks(tmp_path, "cpu", steps=16, stage=True)
    reasons = [c.reason for c in (oom, offload, resume, experts, verdict, flat, fields)]
    assert [c.passed for c in (oom, offload, resume, experts, verdict)] == [True] * 5, reasons
    assert oom.data["snapshot"].endswith("rank1-oom-step3.json")
    assert experts.data["idle_experts"] == 6
    # On CPU the device-memory checks have nothing to read: they fail, saying so.
    assert not flat.passed and "nothing to fit" in flat.reason
    assert not fields.passed and "device_allocated_bytes × 16" in fields.reason
    # The host-staged collectives carried the pipeline's P2P (the schedule's, the stages' warm-up
    # vote and shape inference) and FSDP2's all-gather and reduce-scatter.
    for name in ("batch_p2p", "send", "recv", "send_object_list", "recv_object_list"):
        assert oom.data["staged"].get(name, 0) > 0, (name, oom.data["staged"])
    assert offload.data["staged"].get("all_gather_single", 0) > 0
    assert offload.data["staged"].get("reduce_scatter_single", 0) > 0
