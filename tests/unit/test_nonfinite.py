"""The non-finite policy (a pure decision from a step's facts), the update backup that an undo
restores, the ``[debug]`` fault injection and the flag of non-finite weights: each alone, without
a train loop (the loop's acting on the decisions is tests/unit/test_checkpoint.py's, end to end)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import ray_titan.trainer.nonfinite as nonfinite_module
from ray_titan.config.schema import Debug
from ray_titan.parallel.finite import finite_each, nonfinite_flag
from ray_titan.trainer import fault_injection
from ray_titan.trainer.backup import UpdateBackup
from ray_titan.trainer.fault_injection import FaultInjection
from ray_titan.trainer.nonfinite import Action, Decision, NonFinitePolicy, StepHealth

NAN, INF = float("nan"), float("inf")
LOSS = "step {s}: the loss is not finite on the last stage (stage 3)"
GRADS = "the gradient norm is {n} (non-finite gradients in stage(s) {st})"
UPDATE = ("step {s}: the optimizer update made parameters non-finite from finite gradients "
          "(optimizer.lr = 1e+300 overflows the parameters' dtype?)")
STOP_DROP = ". training.on_nonfinite = 'stop' ends the run; 'skip' would drop such updates"
STOP_UNDO = ". training.on_nonfinite = 'stop' ends the run; 'skip' would undo such updates"
SKIPPED = ": update skipped (training.on_nonfinite = 'skip')"
UNDONE = ": update undone (training.on_nonfinite = 'skip')"

# (policy, facts, decision): every branch of NonFinitePolicy.decide, with the messages the run
# prints or raises (the same words as before the policy was its own unit).
CASES = [
    ("stop", StepHealth(7, False, 2.5), Decision(Action.APPLY)),
    ("skip", StepHealth(7, False, 2.5), Decision(Action.APPLY)),
    ("skip", StepHealth(7, False, 0.0), Decision(Action.APPLY)),  # a zero norm is finite
    # A non-finite loss, the gradients finite: the loss alone is named.
    ("stop", StepHealth(2, True, 1.0), Decision(Action.STOP, LOSS.format(s=2) + STOP_DROP)),
    ("skip", StepHealth(2, True, 1.0), Decision(Action.SKIP, LOSS.format(s=2) + SKIPPED)),
    # Both, as a NaN loss gives: loss first, then the norm and the stages holding the gradients.
    ("stop", StepHealth(3, True, NAN, grad_stages=(0,)),
     Decision(Action.STOP, LOSS.format(s=3) + "; " + GRADS.format(n="nan", st="[0]") + STOP_DROP)),
    ("skip", StepHealth(3, True, NAN, grad_stages=(2, 0, 1)),
     Decision(Action.SKIP, LOSS.format(s=3) + "; " + GRADS.format(n="nan", st="[0, 1, 2]") + SKIPPED)),
    # The gradients alone (an infinite norm); a finite loss is not named.
    ("stop", StepHealth(4, False, INF, grad_stages=(1,)),
     Decision(Action.STOP, "step 4: " + GRADS.format(n="inf", st="[1]") + STOP_DROP)),
    ("skip", StepHealth(4, False, -INF, grad_stages=(1,)),
     Decision(Action.SKIP, "step 4: " + GRADS.format(n="-inf", st="[1]") + SKIPPED)),
    # An update that overflowed from finite gradients: undone under skip.
    ("stop", StepHealth(1, False, 2.0, update_bad=True), Decision(Action.STOP, UPDATE.format(s=1) + STOP_UNDO)),
    ("skip", StepHealth(1, False, 2.0, update_bad=True), Decision(Action.UNDO, UPDATE.format(s=1) + UNDONE)),
    # A withheld update left the weights as they were: the loss and gradients decide, never an undo.
    ("skip", StepHealth(5, True, NAN, update_bad=True, grad_stages=(3,)),
     Decision(Action.SKIP, LOSS.format(s=5) + "; " + GRADS.format(n="nan", st="[3]") + SKIPPED)),
    ("stop", StepHealth(5, False, NAN, update_bad=True, grad_stages=(3,)),
     Decision(Action.STOP, "step 5: " + GRADS.format(n="nan", st="[3]") + STOP_DROP)),
]


@pytest.mark.parametrize("on_nonfinite, health, expected", CASES)
def test_each_fact_gets_its_decision_and_message(on_nonfinite, health, expected):
    policy = NonFinitePolicy(on_nonfinite, last_stage=3, lr=1e300)
    decision = policy.decide(health)
    assert decision == expected
    assert decision.skipped_update == (expected.action is not Action.APPLY)


def test_every_action_is_reachable():
    assert {d.action for _, _, d in CASES} == set(Action)


def test_the_decision_depends_on_the_facts_alone():
    """Pure: no state between steps (a bad step does not change the next one's decision), the
    same facts give the same decision, and the facts are not changed."""
    policy = NonFinitePolicy("skip", last_stage=0, lr=1e-3)
    bad, good = StepHealth(2, True, NAN, grad_stages=(0,)), StepHealth(3, False, 1.5)
    first = [policy.decide(bad), policy.decide(good)]
    again = [policy.decide(good), policy.decide(bad), policy.decide(bad)]
    assert first[1] == again[0] == Decision(Action.APPLY)
    assert first[0] == again[1] == again[2] and first[0].action is Action.SKIP
    assert bad.grad_stages == (0,) and bad.loss_bad
    with pytest.raises(AttributeError):
        policy.on_nonfinite = "stop"  # type: ignore[misc]  # frozen


def test_the_lr_and_last_stage_come_from_the_policy():
    policy = NonFinitePolicy("skip", last_stage=0, lr=0.25)
    assert "(optimizer.lr = 0.25 overflows" in policy.decide(StepHealth(9, False, 1.0, update_bad=True)).message
    assert "on the last stage (stage 0)" in policy.decide(StepHealth(9, True, 1.0)).message


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="on_nonfinite = 'ignore': 'stop' or 'skip'"):
        NonFinitePolicy("ignore", last_stage=0, lr=1.0)  # type: ignore[arg-type]


def test_the_policy_module_imports_no_tensor_or_process_group_code():
    tree = ast.parse(Path(nonfinite_module.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "math", "dataclasses", "enum", "typing"}, imported


# -- the update backup -----------------------------------------------------------------------------

def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return list(model.parameters()), torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)


def _step(params, optimizer):
    optimizer.zero_grad()
    (params[0].sum() * 2 + params[1].square().sum()).backward()
    optimizer.step()


def test_an_undone_first_update_leaves_no_optimizer_state():
    params, optimizer = _model_and_optimizer()
    before = [p.detach().clone() for p in params]
    backup = UpdateBackup()
    backup.save(params, optimizer)
    _step(params, optimizer)
    assert optimizer.state and not torch.equal(params[0], before[0])
    backup.restore(params, optimizer)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert not any(optimizer.state.get(p) for p in params)  # as if the update never ran


def test_an_undone_update_restores_parameters_and_optimizer_state_bit_for_bit():
    params, optimizer = _model_and_optimizer()
    backup = UpdateBackup()
    _step(params, optimizer)
    _step(params, optimizer)
    saved_params = [p.detach().clone() for p in params]
    saved_state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    backup.save(params, optimizer)
    _step(params, optimizer)
    backup.restore(params, optimizer)
    assert all(torch.equal(p, s) for p, s in zip(params, saved_params))
    for p in params:
        assert optimizer.state[p].keys() == saved_state[id(p)].keys()
        assert all(torch.equal(v, saved_state[id(p)][k]) for k, v in optimizer.state[p].items())
    # The same buffers serve the next step: restoring again gives the same state.
    _step(params, optimizer)
    backup.restore(params, optimizer)
    assert all(torch.equal(p, s) for p, s in zip(params, saved_params))


# -- fault injection -------------------------------------------------------------------------------

def test_the_loss_is_nan_at_the_configured_steps_only():
    def loss_fn(x):
        return x.sum()

    assert FaultInjection(Debug(), rank=0).wrap_loss(loss_fn) is loss_fn  # nothing injected: the loss itself
    injection = FaultInjection(Debug(nonfinite_loss_at_steps=[2, 4]), rank=0)
    loss = injection.wrap_loss(loss_fn)
    x = torch.ones(3)
    values = {}
    for step in range(1, 6):
        injection.begin_step(step)
        values[step] = loss(x).item()
    assert [s for s, v in values.items() if math.isnan(v)] == [2, 4]
    assert all(v == 3.0 for s, v in values.items() if s not in (2, 4))


@pytest.mark.parametrize("step, rank, restarted, killed", [
    (5, 1, False, True), (4, 1, False, False), (5, 0, False, False), (5, 1, True, False)])
def test_the_kill_hits_its_rank_at_its_step_in_the_first_group_only(monkeypatch, step, rank, restarted, killed):
    kills = []
    monkeypatch.setattr(fault_injection.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    FaultInjection(Debug(kill_at_step=5, kill_rank=1), rank=rank).kill_if_due(step, restarted)
    assert kills == ([(fault_injection.os.getpid(), fault_injection.signal.SIGKILL)] if killed else [])
    FaultInjection(Debug(), rank=rank).kill_if_due(step, restarted)  # no kill_at_step: never
    assert len(kills) == int(killed)


# Shapes of a few parameters of different sizes: shorter than a vector register, a vector's
# multiple, and a long one with a ragged tail, where a vectorised reduction has separate paths.
FLAG_SHAPES = [(3,), (16,), (64, 129)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_the_nonfinite_flag_finds_any_nonfinite_element_of_any_tensor(dtype, value):
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).to(dtype) for s in FLAG_SHAPES]
    assert nonfinite_flag(base, torch.device("cpu")).tolist() == [0.0]
    assert finite_each(base) == [True] * len(base)
    for i, t in enumerate(base):
        for pos in {0, t.numel() // 2, t.numel() - 1}:
            tensors = [x.clone() for x in base]
            flat = tensors[i].view(-1)
            flat[pos] = complex(0.0, value) if dtype.is_complex else value  # the imaginary part of a complex
            assert nonfinite_flag(tensors, torch.device("cpu")).tolist() == [1.0], (i, pos)
            # Per tensor (the HF export names the one): that one only.
            assert finite_each(tensors) == [j != i for j in range(len(tensors))], (i, pos)


def test_the_nonfinite_flag_takes_huge_finite_values_and_ignores_what_is_not_floating():
    # A sum or a norm of these overflows; each value is finite.
    huge = [torch.full((1000,), 3e38), torch.full((10,), -3e38), torch.full((4,), 1e300, dtype=torch.float64)]
    ignored = [torch.empty(0), torch.tensor([2**62, -(2**62)]), torch.tensor([True])]
    assert nonfinite_flag(huge + ignored, torch.device("cpu")).tolist() == [0.0]
    assert finite_each(huge) == [True] * len(huge)
    assert nonfinite_flag([], torch.device("cpu")).tolist() == [0.0]
