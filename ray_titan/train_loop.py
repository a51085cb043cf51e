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

if __name__ == "__main__":
    print("ray_titan: note: 'python -m ray_titan.train_loop' is now 'python -m ray_titan.launch'",
          file=sys.stderr, flush=True)
    main()
else:
    warnings.warn("ray_titan.train_loop is now ray_titan.launch (the launcher without Ray); the train loop is "
                  "ray_titan.trainer.train_loop", DeprecationWarning, stacklevel=2)
