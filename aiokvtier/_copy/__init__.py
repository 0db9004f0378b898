"""Copies: checking requests, planning them, and submitting them through a backend.

Host-only engines use this too: nothing here needs a GPU or imports ``cuda-bindings``.
"""
