"""Entry point for ``ray job submit --working-dir . -- python jobs/train.py --config configs/X.toml``.

The same driver as ``ray-titan train``: under ``ray job submit`` it joins the job's cluster.
"""

import sys

from ray_titan.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
