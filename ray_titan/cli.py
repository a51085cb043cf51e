"""The ``ray-titan`` command (also ``python -m ray_titan``).

``ray-titan train [--config X.toml] [--section.key=value ...]`` runs the driver
(:func:`ray_titan.driver.train`): on the cluster named by ``RAY_ADDRESS``, or on a local Ray
cluster it starts. Without ``--config`` the built-in defaults are used, which are
``configs/debug_llama.toml``. Exit status: 0 for a complete run, 2 for a config error (before
any worker starts), 1 for a failed run or one whose metrics have errors, 130 when interrupted
(Ctrl-C: the workers are stopped, the metrics flushed, and the last checkpoint named).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ray-titan", description="Distributed LLM training on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser(
        "train",
        help="run a training job",
        description="Run a training job. Any --section.key=value flag overrides the config "
        "(for example --training.steps=50 --parallelism.pipeline_schedule=GPipe).",
    )
    tr.add_argument("--config", help="TOML job config (default: the built-in debug_llama job)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ray-titan``; returns the exit status."""
    from ray_titan.config import ConfigError

    args, overrides = _parser().parse_known_args(argv)
    if args.command == "train":
        from ray_titan.driver import train

        try:
            result = train(args.config, overrides)
        except ConfigError as e:
            print(f"ray-titan: config error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        except Exception as e:  # Ray's error carries the failing worker's traceback
            print(f"ray-titan: training failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return 1 if result.errors else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
