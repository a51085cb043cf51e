"""Synchronized garbage collection (no Ray): schedule, generations, debug mode, state restored."""

from __future__ import annotations

import gc

import torch

from ray_titan.trainer.gc_schedule import GarbageCollection


def test_collects_at_gc_freq_with_a_full_collection_every_full_every():
    was = gc.isenabled()
    policy = GarbageCollection(gc_freq=3, full_every=2)
    try:
        assert not gc.isenabled()
        results = {step: policy.run(step) for step in range(1, 13)}
    finally:
        policy.close()
    assert gc.isenabled() == was
    assert {s: r.generation for s, r in results.items() if r.generation is not None} == {3: 1, 6: 2, 9: 1, 12: 2}
    assert all(r.pause_s == 0.0 for s, r in results.items() if s % 3)
    assert all(r.pause_s > 0.0 for s, r in results.items() if s % 3 == 0)


def test_checkpoint_boundary_is_a_full_collection():
    policy = GarbageCollection(gc_freq=100, full_every=0)
    try:
        assert [policy.run(s).generation for s in (100, 200)] == [1, 1]
        assert policy.at_checkpoint().generation == 2
    finally:
        policy.close()


def test_state_is_restored_even_when_gc_was_off():
    gc.disable()
    try:
        GarbageCollection(gc_freq=1).close()
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Node:
    pass


def test_debug_mode_collects_every_step_and_reports_cycles_holding_tensors(capsys):
    flags = gc.get_debug()
    policy = GarbageCollection(gc_freq=50, debug=True, rank=3)
    try:
        assert policy.run(1).generation == 1  # every step, not only at gc_freq
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a reference cycle ...
        a.activation = torch.zeros(64, 32)  # ... holding a tensor of 8 KiB
        del a, b
        res = policy.run(2)
    finally:
        policy.close()
    assert gc.get_debug() == flags and gc.garbage == []
    assert res.cycle_tensors == 1 and res.cycle_tensor_bytes == 64 * 32 * 4
    assert "tensor(64, 32) torch.float32 held by _Node" in res.description
    assert "gc debug: rank 3: reference cycles held 1 tensor(s), 8192 bytes" in capsys.readouterr().err


def test_startup_objects_are_frozen_and_a_later_cycle_is_still_freed():
    import weakref

    before = _Node()
    before.self = before  # a cycle alive at start: frozen, a full collection does not walk it
    policy = GarbageCollection(gc_freq=1)
    try:
        assert gc.get_freeze_count() > 0
        late = _Node()
        late.self = late
        freed = []
        weakref.finalize(late, freed.append, True)
        del late
        policy.at_checkpoint()  # a full collection still frees what the run made
        assert freed == [True]
    finally:
        policy.close()
    assert gc.get_freeze_count() == 0
    del before


def test_the_freeze_is_undone_even_when_the_interpreter_froze_objects_first():
    """Python 3.12 starts with objects of its own frozen (``gc.get_freeze_count() == 375``): the
    policy's freeze must still be undone at close, or a cycle alive when the run started stays
    uncollectable for the life of the process."""
    import weakref

    gc.freeze()  # what CPython 3.12 does at start-up, here with whatever this process holds
    assert gc.get_freeze_count() > 0
    try:
        before = _Node()
        before.self = before
        freed = []
        weakref.finalize(before, freed.append, True)
        policy = GarbageCollection(gc_freq=1)
        del before
        policy.at_checkpoint()
        assert freed == []  # frozen with the run's start: not walked during the run
        policy.close()
        assert gc.get_freeze_count() == 0  # (CPython 3.12's next collection re-freezes its immortals)
        gc.collect()
        assert freed == [True]
    finally:
        gc.unfreeze()
