"""``training.mixed_precision`` (issue 30): FSDP2's ``MixedPrecisionPolicy`` on every FSDP unit,
built in this process on a one-rank gloo mesh (no worker processes), the fp32 default on CPU, the
autocast fallback without FSDP, and the removed ``training.autocast`` setting."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from ray_titan.config import ConfigError, load_config
from ray_titan.models.registry import build_model, get_spec
from ray_titan.parallel.dims import ParallelDims
from ray_titan.parallel.fsdp import autocast_dtype, materialize, resolve_mixed_precision
from ray_titan.trainer.build import cross_entropy_loss


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _parallelized(family: str, mixed_precision: str, mesh, *more: str) -> torch.nn.Module:
    """The family's debug model through its own ``parallelize`` (FSDP2 over the one-rank mesh,
    standing in for a data-parallel group: ``dims`` says dp_shard = 2 so FSDP applies)."""
    cfg = load_config(None, ["--parallelism.pp=1", f"--model.name={family}",
                             f"--training.mixed_precision={mixed_precision}", *more])
    with torch.device("meta"):
        model = build_model(family, "debug", vocab_size=258)
    get_spec(family).parallelize(model, ParallelDims(pp=1, dp_shard=2), {"fsdp": mesh}, cfg)
    materialize(model, torch.device("cpu"), cpu_offload=False)
    model.init_weights(0)
    return model


def _units(model: torch.nn.Module) -> dict[str, MixedPrecisionPolicy]:
    """Every FSDP unit's policy, by module name (the root is ``""``)."""
    return {name: m._get_fsdp_state()._mp_policy for name, m in model.named_modules() if isinstance(m, FSDPModule)}


@pytest.mark.parametrize("family", ["llama", "deepseek_v2", "qwen3_moe"])
def test_bf16_sets_the_policy_on_every_fsdp_unit_and_fp32_sets_none(one_rank_mesh, family):
    bf16 = _units(_parallelized(family, "bf16", one_rank_mesh))
    fp32 = _units(_parallelized(family, "fp32", one_rank_mesh))
    model = build_model(family, "debug", vocab_size=258)
    # The root, an untied embedding and every block are units (routed experts are inside their
    # block's unit here).
    embedding = [] if model.tied else ["tok_embeddings"]
    assert set(bf16) == set(fp32) == {"", *embedding, *(f"layers.{i}" for i in range(model.args.n_layers))}
    assert all(p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32 for p in bf16.values())
    assert all(p.param_dtype is None and p.reduce_dtype is None for p in fp32.values())


def test_bf16_computes_in_bf16_and_keeps_fp32_master_weights_gradients_and_loss(one_rank_mesh):
    model = _parallelized("llama", "bf16", one_rank_mesh)
    seen: dict[str, torch.dtype] = {}
    block = model.layers["0"]
    block.attention.wq.register_forward_hook(lambda m, a, out: seen.update(weight=m.weight.dtype, out=out.dtype))
    x = torch.randint(0, 258, (2, 16))
    logits = model(x)
    loss = cross_entropy_loss(logits, x)
    loss.backward()
    assert seen == {"weight": torch.bfloat16, "out": torch.bfloat16} and logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32  # the cross-entropy is computed in fp32
    # Master weights and the gradients the optimizer sees stay fp32.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    # The rotary tables (block inputs) were not cast to bf16 (cast_forward_inputs=False).
    assert model.rope_cos.dtype == torch.float32


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_bf16_moe_models_train_with_fp32_router_scores(one_rank_mesh, family):
    model = _parallelized(family, "bf16", one_rank_mesh)
    scores: list[torch.dtype] = []
    for m in model.modules():
        if type(m).__name__ == "Router":
            m.register_forward_hook(lambda m, a, out: scores.append(out[-1].dtype))
    x = torch.randint(0, 258, (2, 16))
    logits = model(x)
    cross_entropy_loss(logits, x).backward()
    assert logits.dtype == torch.bfloat16 and scores and set(scores) == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def test_bf16_ep_experts_get_a_unit_of_their_own_even_on_one_rank(one_rank_mesh):
    """Under EP with one rank left for FSDP over the experts, fp32 leaves them out of FSDP (their
    ranks hold disjoint experts), bf16 shards them over that one rank so the policy casts them."""
    from torch import nn

    from ray_titan.parallel.fsdp import apply_fsdp, fsdp_managed_names

    def stage(mp: str) -> nn.Module:
        with torch.device("meta"):
            model = build_model("deepseek_v2", "debug", vocab_size=258)
        apply_fsdp(model, one_rank_mesh, True, expert_mesh=one_rank_mesh, mixed_precision=mp)
        return model

    bf16, fp32 = stage("bf16"), stage("fp32")
    moe_layers = [name for name, m in bf16.named_modules() if name.endswith("moe.experts")]
    assert moe_layers and all(n in _units(bf16) for n in moe_layers)
    assert _units(bf16)[moe_layers[0]].param_dtype == torch.bfloat16
    assert not any(n.endswith("experts") for n in _units(fp32))
    assert not any(".moe.experts." in n for n in fsdp_managed_names(fp32))


def test_the_default_is_bf16_on_cuda_and_fp32_on_cpu_and_autocast_only_without_fsdp():
    assert load_config(None).training.mixed_precision is None
    assert resolve_mixed_precision(None, "cuda") == "bf16" and resolve_mixed_precision(None, "cpu") == "fp32"
    assert resolve_mixed_precision("fp32", "cuda") == "fp32" and resolve_mixed_precision("bf16", "cpu") == "bf16"
    assert autocast_dtype("bf16", fsdp=False) == torch.bfloat16
    assert autocast_dtype("bf16", fsdp=True) is None and autocast_dtype("fp32", fsdp=False) is None


@pytest.mark.parametrize("value", ["bfloat16", "none"])
def test_the_removed_autocast_setting_names_its_replacement(value, tmp_path):
    with pytest.raises(ConfigError, match=r"training\.autocast = .*replaced by training\.mixed_precision"):
        load_config(None, [f"--training.autocast={value}"])
    toml = tmp_path / "job.toml"
    toml.write_text(f'[training]\nautocast = "{value}"\n')
    with pytest.raises(ConfigError, match=r"training\.mixed_precision = \"bf16\" \| \"fp32\""):
        load_config(toml)
    with pytest.raises(ConfigError, match="training.mixed_precision"):
        load_config(None, ["--training.mixed_precision=bfloat16"])
