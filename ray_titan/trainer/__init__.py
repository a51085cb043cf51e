"""The per-worker trainer, in three modules that read top to bottom:

- :mod:`~ray_titan.trainer.build`: mesh → model on meta → this rank's stages → each family's
  ``parallelize`` → materialise and initialise; optimizer, LR schedule, pipeline schedule.
- :mod:`~ray_titan.trainer.step`: one training step (pipeline schedule or gradient accumulation,
  clip, optimizer, LR).
- :mod:`~ray_titan.trainer.loop`: the loop itself (data → step → GC → memory sample → report →
  checkpoint).
"""

from ray_titan.trainer.loop import train_loop

__all__ = ["train_loop"]
