"""The per-worker trainer, in three modules that read top to bottom:

- :mod:`~ray_titan.trainer.build`: mesh → model on meta → this rank's stages → each family's
  ``parallelize`` → materialise and initialise; optimizer, LR schedule, pipeline schedule.
- :mod:`~ray_titan.trainer.step`: one training step (pipeline schedule or gradient accumulation,
  clip, optimizer, LR).
- :mod:`~ray_titan.trainer.loop`: the loop itself (data → step → the non-finite decision → GC →
  memory sample → report → checkpoint).

and the worker-only helpers they use: :mod:`~ray_titan.trainer.nonfinite` (the non-finite policy:
a step's facts in, a decision out), :mod:`~ray_titan.trainer.backup` (the state before an update,
to undo it), :mod:`~ray_titan.trainer.fault_injection` (the ``[debug]`` faults) and
:mod:`~ray_titan.trainer.gc_schedule` (synchronized garbage collection);
:mod:`~ray_titan.trainer.ray_worker` is what Ray Train runs on each worker.
"""

from ray_titan.trainer.loop import train_loop

__all__ = ["train_loop"]
