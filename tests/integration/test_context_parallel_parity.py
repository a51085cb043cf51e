"""Context parallelism (``parallelism.cp``) equal to one worker: Llama (GQA), DeepSeek-V2 (MLA),
DeepSeek-V3 (aux-loss-free routing) and GLM-4.5 with the sequence split over 2 or 4 cp ranks, composed
with dp_shard, tp and pp; the step losses the collector assembles and the gradient norms over 10
steps within the other parity tests' 1e-4 relative of the same one-process runs
(tests/integration/test_parallel_parity.py's), with and without document masks.

Below them, on 2 ranks without the trainer: the Llama (GQA), Qwen3 (q/k norms), DeepSeek-V2
(MLA, MoE balance loss), GLM-4.5 (partial rotary) and MiniMax-M2 (q/k norms over all heads)
models give the one-rank logits and gradients, causal (the mask-free
path: one attention per chunk) and with several documents packed across the chunk boundaries
(the masked path; the trainer's parity runs' 32-token windows rarely hold two),
while a gather that keeps each rank's own keys (the negative control: the mutation that skips the
key/value all-gather) does not. A mutation that skips the load balancing is caught by the unit
test of the balancer (tests/unit/test_context_parallel.py), since a contiguous split computes
the same function.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.integration.test_parallel_parity import RTOL, STEPS, _check_parity, _curve, _run, corpus, references  # noqa: F401
from tests.integration.test_validation import STEPS as SFT_STEPS
from tests.integration.test_validation import _by_step as by_step
from tests.integration.test_validation import _one_process_cfg as one_process_cfg
from tests.integration.test_validation import _overrides as sft_overrides
from tests.integration.test_validation import sft_data  # noqa: F401
from tests.support.ranks import forkserver, join_all, rendezvous_store
from tests.unit.test_context_parallel import BATCH, SEQ, positions

DOCS = ["--training.document_mask=true"]
# name: (model, ranks, flags, the one worker's flags too). Qwen3's q/k norms: in the two-rank
# model test below. cp = 4 over 8 ranks, with pp, with dp_shard (document masks: documents cross
# the chunk boundaries, and each rank's two chunks are far apart in the sequence) and with tp
# (MLA); cp = 2 with each of them.
CP = {
    "llama_cp2_dp_shard2": ("llama", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"], []),
    "llama_cp2_tp2": ("llama", 4, ["--parallelism.cp=2", "--parallelism.tp=2"], []),
    "llama_cp4_pp2": ("llama", 8, ["--parallelism.cp=4", "--parallelism.pp=2", "--parallelism.microbatches=2"], []),
    "llama_cp4_dp_shard2_document_mask": ("llama", 8, ["--parallelism.cp=4", "--parallelism.dp_shard=2"], DOCS),
    # MLA, MoE with the sequence-wise balance loss (its routing counts summed over cp).
    "deepseek_cp2_dp_shard2": ("deepseek_v2", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"], []),
    "deepseek_cp2_pp2": ("deepseek_v2", 4, ["--parallelism.cp=2", "--parallelism.pp=2",
                                            "--parallelism.microbatches=2"], []),
    "deepseek_cp4_tp2": ("deepseek_v2", 8, ["--parallelism.cp=4", "--parallelism.tp=2"], []),
    # DeepSeek-V3's aux-loss-free routing: the bias moves from the load summed over dp_shard × cp
    # (each cp rank routes other tokens; summed over dp_shard alone, the cp ranks' biases diverge).
    "deepseek_v3_cp2_dp_shard2": ("deepseek_v3", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"], []),
    # Expert parallel within each cp rank's tokens (the ep group at a fixed cp coordinate), the
    # routed experts FSDP-sharded over dp_shard / ep × cp.
    "deepseek_cp2_dp_shard2_ep2": ("deepseek_v2", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2",
                                                      "--parallelism.ep=2"], []),
    # GLM-4.5: partial rotary at whole-sequence positions, q/k norms, and its aux-loss-free bias
    # (DeepSeek-V3's router) moved by the load summed over dp_shard × cp. MiniMax-M2's attention
    # (q/k norms over all heads) is in the two-rank model test below.
    "glm4_moe_cp2_dp_shard2": ("glm4_moe", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"], []),
}


@pytest.fixture(scope="module")
def doc_reference(corpus):  # noqa: F811
    """The one worker with document masks (run once)."""
    return _run(corpus / "ref_llama_docs", "llama", 1, DOCS, steps=STEPS)


@pytest.mark.parametrize("name", list(CP))
def test_context_parallel_matches_one_worker(name, corpus, references, request):  # noqa: F811
    model, nproc, flags, ref_flags = CP[name]
    run = _run(corpus / name, model, nproc, [*flags, *ref_flags], save=name == "llama_cp2_dp_shard2")
    ref = request.getfixturevalue("doc_reference") if ref_flags else references(model)
    _check_parity(name, run, ref)
    assert set(run[1]["cp"].to_pylist()) == set(range(run[2].cp))


def test_checkpoint_reshards_from_cp2_to_cp1(corpus, references):  # noqa: F811
    """cp=2 × dp_shard=2 saves at step 10 (its parity case above); dp_shard=2 without context
    parallel resumes it and continues the one-worker curve (FSDP's shards over dp_shard × cp
    become shards over dp_shard: DCP keeps global shapes)."""
    ckpt = corpus / "llama_cp2_dp_shard2" / "run" / "checkpoints"
    if not (ckpt / f"step-{STEPS:08d}").is_dir():
        _run(corpus / "llama_cp2_dp_shard2", "llama", 4, CP["llama_cp2_dp_shard2"][2], save=True)
    summary, table, _ = _run(corpus / "cp_resharded", "llama", 2, [
        "--parallelism.dp_shard=2", f"--checkpoint.load_path={ckpt}"], steps=STEPS + 2)
    assert summary["errors"] == []
    assert sorted(set(table["step"].to_pylist())) == [STEPS + 1, STEPS + 2]
    np.testing.assert_allclose(_curve(table), _curve(references("llama")[1])[STEPS:], rtol=RTOL)


FAMILIES = ("llama", "qwen3", "deepseek_v2", "glm4_moe", "minimax_m2")
CONTROL = ("llama", "deepseek_v2")


def _rank_main(rank: int, out: str, env: dict[str, str], control: bool) -> None:
    """Each family on the full batch (the reference, on every rank) and context-parallel over 2
    ranks; writes the largest differences of the logits and the summed gradients."""
    from ray_titan.models.registry import build_model
    from ray_titan.parallel.context import ContextParallel, apply_context_parallel, shard_sequence

    os.environ.update(env)
    try:
        torch.manual_seed(0)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        if control:  # the negative control: each rank's own keys stand for the whole sequence's
            ContextParallel.gather = lambda self, t: t.repeat(1, 1, self.cp, 1)  # type: ignore[method-assign]
        tokens = torch.randint(0, 258, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        lines = []
        # The control mutates the gather every family shares: Llama's and DeepSeek-V2's show it.
        for family, pos in [(f, p) for f in (CONTROL if control else FAMILIES) for p in (positions(), None)]:
            models = []
            for _ in range(2):
                m = build_model(family, "debug", vocab_size=258)
                m.init_weights(7)
                models.append(m)
            ref, cpm = models
            ref_logits = ref(tokens, positions=pos)
            torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), tokens.flatten()).backward()
            apply_context_parallel(cpm, dist.group.WORLD, SEQ)
            mine = shard_sequence(tokens, 2, rank)
            logits = cpm(mine, positions=None if pos is None else shard_sequence(pos, 2, rank))
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine.flatten()).backward()
            d_logits = (logits - shard_sequence(ref_logits, 2, rank)).abs().max().item()
            d_grad = 0.0
            for p, q in zip(cpm.parameters(), ref.parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)  # FSDP's average over the cp ranks
                d_grad = max(d_grad, ((g / 2 - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item())
            lines.append(f"{family}{'' if pos is None else '_documents'} {d_logits} {d_grad}")
        Path(out).write_text("\n".join(lines))
        dist.destroy_process_group()
    except BaseException:
        Path(out).write_text("error\n" + traceback.format_exc())
        raise


def _run_ranks(tmp_path: Path, control: bool) -> dict[str, tuple[float, float]]:
    ctx = forkserver()
    tmp_path.mkdir(parents=True)
    outs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    with rendezvous_store() as env:
        procs = [ctx.Process(target=_rank_main, args=(r, str(outs[r]), env, control)) for r in range(2)]
        for p in procs:
            p.start()
        join_all(procs, 300)
    texts = [o.read_text() for o in outs]
    assert all(p.exitcode == 0 for p in procs), texts
    diffs: dict[str, tuple[float, float]] = {}
    for text in texts:
        for line in text.splitlines():
            family, d_logits, d_grad = line.split()
            old = diffs.get(family, (0.0, 0.0))
            diffs[family] = (max(old[0], float(d_logits)), max(old[1], float(d_grad)))
    return diffs


def test_two_cp_ranks_give_the_one_rank_logits_and_gradients(tmp_path):
    diffs = _run_ranks(tmp_path / "cp", control=False)
    assert set(diffs) == {f"{f}{d}" for f in FAMILIES for d in ("", "_documents")}
    for family, (d_logits, d_grad) in diffs.items():
        assert d_logits < 1e-5 and d_grad < 1e-4, (family, d_logits, d_grad)
    control = _run_ranks(tmp_path / "control", control=True)
    assert set(control) == {f"{f}{d}" for f in CONTROL for d in ("", "_documents")}
    for family, (d_logits, _) in control.items():
        assert d_logits > 1e-3, (family, d_logits)  # 100 times the tolerance above


def test_sft_loss_masks_and_validation_under_cp_equal_one_process(sft_data, tmp_path):  # noqa: F811
    """Prompt-response data (loss masks: counted labels uneven over ranks and the sequence's
    halves), document masks and validation every step, on cp=2 × dp_shard=2: the step losses and
    validation losses of one process taking the global batch in one piece."""
    from ray_titan.metrics.collector.collector import MetricsCollector
    from ray_titan.metrics.reading.steps import read_steps
    from ray_titan.metrics.worker.report import LocalReporter
    from ray_titan.trainer import train_loop
    from tests.conftest import REPO
    from tests.support.ranks import launch

    dump = tmp_path / "cp"
    out = launch(["--config", str(REPO / "configs" / "debug_llama.toml"), *sft_overrides(
        sft_data, dump, "--parallelism.pp=1", "--parallelism.dp_shard=2", "--parallelism.cp=2",
        "--validation.enable=true", "--training.threads_per_worker=1")], 4, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run_dir,) = dump.glob("debug_llama-*")
    table = read_steps(run_dir)
    one = tmp_path / "one"
    one.mkdir()
    cfg = one_process_cfg(sft_data, one, "--parallelism.microbatches=1")
    collector = MetricsCollector(str(one), 1, [0], SFT_STEPS, log_freq=1000, enable_tensorboard=False)
    train_loop(cfg, LocalReporter(collector), torch.device("cpu"), one)
    collector.finish()
    ref = read_steps(one)
    assert None not in by_step(table, "step_val_loss") and set(table["cp"].to_pylist()) == {0, 1}
    for column in ("step_loss", "step_val_loss"):
        np.testing.assert_allclose(by_step(table, column), by_step(ref, column), rtol=1e-5, err_msg=column)
