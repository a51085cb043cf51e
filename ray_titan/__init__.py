"""ray_titan: a distributed LLM trainer on Ray (PP × FSDP2) with a metrics collector that reports
the real last-stage loss and every rank's memory."""

from ray_titan.config import ConfigError, JobConfig, load_config

__all__ = ["ConfigError", "JobConfig", "RunResult", "load_config", "train"]
__version__ = "0.1.0"


def __getattr__(name):
    # The driver imports Ray; keep `import ray_titan` light for workers and tools.
    if name in ("train", "RunResult"):
        from ray_titan import driver

        return getattr(driver, name)
    raise AttributeError(name)
