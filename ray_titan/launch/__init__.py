"""The launcher without Ray, beside the Ray driver (:mod:`ray_titan.driver`):
``python -m ray_titan.launch --config X.toml`` runs one process, ``torchrun --nproc-per-node=N -m
ray_titan.launch ...`` every rank of a mesh (:mod:`ray_titan.launch.torchrun`). Nothing here imports Ray.
"""
