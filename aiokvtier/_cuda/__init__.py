"""CUDA: the driver boundary, GPU backings, the staging buffer, the copy planner, the batch call and the engine.

Nothing here imports ``cuda-bindings`` at import time: the host-only tier works without it.
"""
