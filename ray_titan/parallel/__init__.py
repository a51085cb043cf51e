"""Parallelisms: the device mesh (dims.py), FSDP2 (fsdp.py), pipeline parallel (pipeline.py) and
gradient clipping across both (grad_norm.py). Each is applied by one ``apply_*``/``build_*``
function that takes the model and the mesh."""
