"""Activation offloading (``memory.activation_offload``, ``ray_titan.parallel.offload``): the hooks
see what each chosen block saves for backward (all of it without activation checkpointing, the
block input under full AC), leave the weights and the rotary tables alone, announce each block's
backward, and change neither the loss nor the gradients."""

from __future__ import annotations

import pytest
import torch

from ray_titan.config.schema import ConfigError, load_config
from ray_titan.models.registry import build_model
from ray_titan.parallel.ac import apply_ac
from ray_titan.parallel.offload import FORWARD_LAG, ActivationOffloader, apply_activation_offload, offloads
from ray_titan.preflight.checks import validate_job

CONFIG = "configs/debug_llama.toml"


def _model(ac: str = "none", offload: str | int = "none",
           copy: bool = False) -> tuple[torch.nn.Module, ActivationOffloader | None]:
    model = build_model("llama", "debug", vocab_size=258)
    model.init_weights(0)
    apply_ac(model, "selective" if ac == "op" else ac, "op")
    return model, apply_activation_offload(model, offload, min_bytes=1, copy_on_host=copy)


def _step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 258, (2, 32), generator=g)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _CountSaved:
    """The tensors autograd saves during a forward (its own hooks, outside the model's)."""

    def __init__(self) -> None:
        self.count = self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.bytes += t.numel() * t.element_size()
        return t


@pytest.mark.parametrize("ac", ["none", "full", "op"])
@pytest.mark.parametrize("copy", [False, True])
def test_loss_and_gradients_match_no_offloading(ac, copy):
    """On the CPU, and with every packed tensor copied away and back (``copy_on_host``: the
    handles, the prefetch one block ahead and the unpack run as on a GPU)."""
    ref_loss, ref_grads = _step(_model(ac)[0])
    model, off = _model(ac, "all", copy)
    assert off is not None
    loss, grads = _step(model)
    assert loss == ref_loss
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
    n_layers = len(model.layers)
    assert off.stats.backward_hooks == n_layers  # every block's backward announced, once
    assert off.stats.unpacked >= off.stats.packed > 0
    if copy:  # every handle came back through the prefetch (its block's, or the block after it's):
        # the last FORWARD_LAG + 1 blocks' still held on the device, the others' copied back
        assert off.stats.prefetched + off.stats.reused == off.stats.copies
        assert 0 < off.stats.reused < off.stats.copies and off.stats.held_blocks == FORWARD_LAG + 1
    if ac == "none":  # a tensor several ops save (a norm's output: q, k, v's input) is copied once
        assert off.stats.copies < off.stats.packed


def test_hooks_pack_what_the_blocks_save_but_the_weights():
    """Without checkpointing the hooks see everything a block saves: with them as the innermost
    hooks, an outer counter sees nothing of the blocks (a test that fails if they are missing);
    what they pack is the blocks' activations, no parameter, no rotary table."""
    model, off = _model("none", "all")
    assert off is not None
    outer = _CountSaved()
    tokens = torch.randint(0, 258, (2, 32))
    with torch.autograd.graph.saved_tensors_hooks(outer.pack, lambda t: t):
        h = model.tok_embeddings(tokens)
        outer_before = outer.count
        for layer in model.layers.values():
            h = layer(h, model.rope_cos, model.rope_sin)
    assert outer.count == outer_before  # the blocks' own hooks took every saved tensor
    stats = off.stats
    assert stats.packed > 0 and stats.kept > 0  # weights and rotary tables are seen but stay
    # The same forward without offloading: what the blocks save, weights and tables included.
    plain, _ = _model("none")
    count = _CountSaved()
    with torch.autograd.graph.saved_tensors_hooks(count.pack, lambda t: t):
        h = plain.tok_embeddings(tokens)
        before_count, before_bytes = count.count, count.bytes
        for layer in plain.layers.values():
            h = layer(h, plain.rope_cos, plain.rope_sin)
    assert stats.packed + stats.kept == count.count - before_count
    weights = sum(p.numel() * p.element_size() for p in plain.layers.parameters() if p.dim() == 2)
    assert stats.packed_bytes <= count.bytes - before_bytes - weights


@pytest.mark.parametrize("setting", ["all", 2])
def test_the_forward_holds_the_device_tensors_of_the_last_blocks_only(setting):
    """Each block's forward (offloaded or not) lets go of the device tensors of the blocks more
    than FORWARD_LAG before it (on a GPU once their copies to the host are done): at the end of
    the forward only the last FORWARD_LAG + 1 blocks still hold theirs, whatever the copies'
    speed; with the first 2 of 4 blocks offloaded, none does. Holding every block until its copy
    ends (``record_stream``) kept all of them on an H100."""
    model, off = _model("none", setting, copy=True)
    assert off is not None
    tokens = torch.randint(0, 258, (2, 32))
    logits = model(tokens)
    groups = []
    group = off._last() if off._last is not None else None
    while group is not None:
        groups.append(group)
        group = group.prev() if group.prev is not None else None
    n = len(model.layers)
    chosen = n if setting == "all" else int(setting)
    assert [g.layer for g in groups] == list(range(chosen))[::-1]
    held = {g.layer: [h().held is not None for h in g.handles if h() is not None] for g in groups}
    last = n - 1 - FORWARD_LAG
    assert all(all(v) and v for k, v in held.items() if k >= last)
    assert not any(any(v) for k, v in held.items() if k < last)
    del logits


def test_full_ac_offloads_the_block_inputs_only():
    model, off = _model("full", "all")
    assert off is not None
    _step(model)
    n_layers, dim = len(model.layers), model.args.dim
    assert off.stats.packed == n_layers  # one input per block
    assert off.stats.packed_bytes == n_layers * 2 * 32 * dim * 4


def test_a_count_offloads_the_first_blocks():
    model, off = _model("full", 1)
    assert off is not None
    _step(model)
    assert off.stats.packed == 1 and off.stats.backward_hooks == 1
    assert [offloads(2, i) for i in range(3)] == [True, True, False]
    assert offloads("all", 99) and not offloads("none", 0)


def test_preflight_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="memory.activation_offload = 99"):
        validate_job(load_config(CONFIG, ["--memory.activation_offload=99"]), check_data=False)
    with pytest.raises(ConfigError, match="training.compile"):
        validate_job(load_config(CONFIG, ["--memory.activation_offload=all", "--training.compile=true"]),
                     check_data=False)
    with pytest.raises(ConfigError, match="zero-bubble"):
        validate_job(load_config(CONFIG, ["--memory.activation_offload=all", "--parallelism.stages_per_rank=2",
                                          "--parallelism.pipeline_schedule=ZBVZeroBubble"]), check_data=False)
    validate_job(load_config(CONFIG, ["--memory.activation_offload=2"]), check_data=False)
    from ray_titan.preflight.checks import job_warnings

    (warning,) = [w for w in job_warnings(load_config(CONFIG, ["--memory.activation_offload=all"]))
                  if "activation_offload" in w]
    assert "ray.use_gpu = false" in warning
    assert not [w for w in job_warnings(load_config(CONFIG, ["--memory.activation_offload=all", "--ray.use_gpu=true"]))
                if "activation_offload" in w]


# The memory plan: a 1B Llama (on the meta device) under full AC, where only block inputs move and
# their copies hide behind the forward; the debug Llama without AC, where they cannot.
LARGE = ["--model.flavor=3.2-1B", "--parallelism.pp=1", "--parallelism.dp_shard=8", "--parallelism.microbatches=1",
         "--training.global_batch_size=16", "--training.seq_len=4096", "--training.mixed_precision=bf16",
         "--activation_checkpoint.mode=full"]
SMALL = ["--parallelism.pp=1", "--parallelism.dp_shard=2", "--parallelism.microbatches=1",
         "--training.global_batch_size=4", "--training.seq_len=256", "--training.mixed_precision=bf16"]


def test_the_plan_moves_the_offloaded_bytes_from_device_activations_to_the_host():
    from ray_titan.preflight.memory_plan import memory_plan

    cfg = load_config(CONFIG, LARGE)
    off = cfg.with_overrides(["--memory.activation_offload=all"])
    (before, after) = (memory_plan(c, None, "cuda", levers=False).ranks[0] for c in (cfg, off))
    assert after.peak < before.peak and before.activations_offloaded == 0
    # Full AC: the 16 block inputs go (bf16 FSDP2: the residual stream is bf16, 2·d per token;
    # plan_activations._with_residual_dtype, measured on the simulated GPU).
    tokens, dim, n_layers = 2 * 4096, 2048, 16
    assert after.activations_offloaded == after.offload_bytes_per_step == n_layers * tokens * 2 * dim
    kept = [sum(r.activations_per_microbatch.values()) for r in (before, after)]
    assert kept[0] - kept[1] == after.activations_offloaded
    assert "in pinned host memory" in memory_plan(off, None, "cuda", levers=False).format()
    # On a host device nothing moves.
    assert memory_plan(off, None, "cpu", levers=False).max_peak == memory_plan(cfg, None, "cpu", levers=False).max_peak


def test_offloading_is_ranked_by_whether_its_copies_hide_and_fit_auto_applies_it_so():
    """The lever's cost says whether the copies hide behind the forward's compute, which places it
    before or after the recomputation, for the plan's list and for memory.fit = "auto" alike."""
    from ray_titan.preflight.memory_plan import memory_plan
    from ray_titan.preflight.prepare import fit_memory

    cfg = load_config(CONFIG, [*LARGE, "--memory.fit=auto"])
    full = memory_plan(cfg, None, "cuda", levers=False).max_peak
    moved = memory_plan(cfg.with_overrides(["--memory.activation_offload=all"]), None, "cuda", levers=False).max_peak
    capacity = int((moved + full) / 2 / 0.92)  # the offloaded job fits with the margin, the given one not
    new, after, line = fit_memory(cfg, "cuda", capacity)  # only offloading fits: applied, and said why
    assert new.memory.activation_offload == "all" and after is not None and after.fits
    assert after.max_peak == moved and new.activation_checkpoint == cfg.activation_checkpoint
    assert "training with --memory.activation_offload=all" in line and "hidden behind compute" in line
    (lever,) = [lv for lv in memory_plan(cfg, capacity, "cuda").levers if "offload (all" in lv.name]
    assert "hidden behind compute" in lever.cost and "not hidden" not in lever.cost
    # The debug Llama: copies longer than its forward's compute, ranked after full AC.
    small = memory_plan(load_config(CONFIG, SMALL), "17MiB", "cuda")
    names = [lv.name for lv in small.levers]
    offload = names.index("activation offload (all blocks)")
    assert offload > names.index("activation checkpointing full")
    assert "not hidden" in small.levers[offload].cost
    assert small.recommendation is not None and "--memory.activation_offload=all" not in small.recommendation


def test_a_run_with_host_copies_keeps_its_losses(tmp_path, corpus_cache, monkeypatch):
    """The train loop of one worker (CPU, the debug Llama) with every block's saved tensors copied
    away and back each step (``copy_on_host``: handles, prefetch and unpack as on a GPU, through
    ``parallel.stack``): the losses and gradient norms of the run without offloading."""
    import ray_titan.parallel.stack as stack
    from tests.unit.test_memory_levers import _train

    made: list[ActivationOffloader] = []

    def with_copies(model, setting):
        off = apply_activation_offload(model, setting, copy_on_host=True)
        made.extend([off] if off is not None else [])
        return off

    _, _, plain = _train(tmp_path / "plain", corpus_cache)
    monkeypatch.setattr(stack, "apply_activation_offload", with_copies)
    _, _, steps = _train(tmp_path / "offload", corpus_cache, "--memory.activation_offload=all")
    stats = made[0].stats if made else None
    assert stats is not None and stats.copies > 0 and stats.prefetched + stats.reused == stats.copies
    assert steps["step_loss"].to_pylist() == plain["step_loss"].to_pylist()
    assert steps["grad_norm"].to_pylist() == plain["grad_norm"].to_pylist()


@pytest.mark.parametrize("name", ["glibc/rank0", "jemalloc/rank3"])
def test_the_pinned_pool_is_warm_up_for_the_host_verdict_and_a_growing_one_is_not(name):
    """On a GPU the offloaded tensors live in pinned host memory from torch's caching host
    allocator, which keeps each freed block for the next step's copy of the same size: the host
    series (sampled at each step's end) rises by the pool over the first steps (here 1 GiB at step
    1 and 64 MiB more at step 2, a prefetch timing that needed one more block) and then stays. On
    recorded healthy ranks with that pool added the verdict is never ``growing``; a pool that took
    one more 1 MiB block every step (buffers kept, not reused) is."""
    import numpy as np

    from tests.unit.test_leak import GROWING, STABLE, _host_verdicts, _recorded

    steps, base = _recorded(name)
    pool = np.where(steps >= 1, 1024, 0) + np.where(steps >= 2, 64, 0)
    verdicts = _host_verdicts(steps, base + pool * 2.0**20)
    assert GROWING not in {v.verdict for v in verdicts} and verdicts[-1].verdict == STABLE
    leaking = _host_verdicts(steps, base + (pool + steps) * 2.0**20)
    assert leaking[-1].verdict == GROWING


def test_a_prefetched_copy_nobody_took_makes_compute_wait_for_it_and_a_taken_one_does_not():
    """No ``record_stream`` on the copies back (it kept every freed one from reuse until the side
    stream caught up with the host: on an H200 the whole backward's copies were live at once).
    Instead the compute stream waits for a copy's event where its handle ends untaken; a taken
    copy was waited for by its unpack already."""
    from ray_titan.parallel.offload import _Handle

    waited: list[object] = []

    class Stream:
        def wait_event(self, event: object) -> None:
            waited.append(event)

    untaken = _Handle(torch.zeros(4), torch.device("cuda", 0), 16)
    untaken.on_device, untaken.event, untaken.stream = torch.zeros(4), "copy of untaken", Stream()
    taken = _Handle(torch.zeros(4), torch.device("cuda", 0), 16)
    taken.on_device, taken.event, taken.stream = torch.zeros(4), "copy of taken", Stream()
    assert taken.take() is not None
    del untaken, taken
    assert waited == ["copy of untaken"]


def test_autocasts_copies_of_the_weights_stay_and_the_activations_move():
    """Under autocast each matmul saves a bf16 copy of its weight (a cast of a parameter, its
    transpose): those stay, as the plan counts them (on an H200 they were 11 % of what offloading
    the 1B shape moved per step); the activations the block saves move. A leaf that is not a
    parameter (a pipeline stage's received input) is an activation."""
    from torch import nn

    block = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 48))
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": block})
    off = ActivationOffloader(min_bytes=1, copy_on_host=True)
    off.wrap(block, 0, model)
    moved: list[torch.Size] = []
    pack = off._pack

    def spy(group, skip, t):
        out = pack(group, skip, t)
        if out is not t:
            moved.append(t.shape)
        return out

    off._pack = spy  # type: ignore[method-assign]
    x = torch.randn(6, 48, requires_grad=True)  # a leaf, like a received stage input
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    y.float().sum().backward()
    weights = {(80, 48), (48, 80)}
    assert moved and not weights & set(moved), moved  # no weight copy, its transpose neither
    assert torch.Size([6, 48]) in moved and torch.Size([6, 80]) in moved  # the inputs of both matmuls
    assert off.stats.kept >= 2  # the two weights' copies
