"""CUDA: the driver boundary, GPU backings, the staging buffer, the batch call, the SM kernel and the copy backend.

Nothing here imports ``cuda-bindings`` at import time: the host-only tier works without it.
"""
