"""The old name of the launcher without Ray: ``python -m ray_titan.train_loop`` still runs it.

The launcher is ``ray_titan.launch`` (``python -m ray_titan.launch --config X.toml ...``) and the
train loop ``ray_titan.trainer.train_loop``; this module says so (on stderr when run, as a
``DeprecationWarning`` when imported) and runs the launcher.
"""

from __future__ import annotations

import sys
import warnings

from ray_titan.launch import main

__all__ = ["main"]



# What this module held before it became the launcher's old name, and where each is now.
_MOVED = {"train_loop": "ray_titan.trainer", "cross_entropy_loss": "ray_titan.trainer.build",
          "build_lr_lambda": "ray_titan.trainer.build", "parallel_dims": "ray_titan.parallel.dims",
          "local_cuda_device": "ray_titan.launch"}


def __getattr__(name: str):
    """A name that moved away: an ImportError naming its new home (``from ray_titan.train_loop
    import train_loop`` was a bare "cannot import name"). Any other: AttributeError, as usual."""
    if name not in _MOVED:
        raise AttributeError(f"module 'ray_titan.train_loop' has no attribute {name!r}")
    raise ImportError(f"ray_titan.train_loop.{name} is now {_MOVED[name]}.{name} (from {_MOVED[name]} import "
                      f"{name}); ray_titan.train_loop is only the old name of the launcher ray_titan.launch",
                      name="ray_titan.train_loop")


if __name__ == "__main__":
    print("ray_titan: note: 'python -m ray_titan.train_loop' is now 'python -m ray_titan.launch'",
          file=sys.stderr, flush=True)
    main()
else:
    warnings.warn("ray_titan.train_loop is now ray_titan.launch (the launcher without Ray); the train loop is "
                  "ray_titan.trainer.train_loop", DeprecationWarning, stacklevel=2)
