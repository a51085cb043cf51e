"""Entry point for ``ray job submit --working-dir . -- python jobs/train.py --config configs/X.toml``.

The same driver as ``ray-titan train``; under ``ray job submit`` it joins the job's cluster. The
repository root (the job's working directory) goes on ``sys.path`` so the job runs from a
checkout even where ray_titan is not installed on the cluster; Ray puts the working directory on
the workers' path too.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_titan.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
