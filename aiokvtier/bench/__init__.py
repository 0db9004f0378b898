"""Benchmark programs: ``python -m aiokvtier.bench host`` (and ``cuda`` on a GPU machine).

Each prints one JSON document with aiokvtier's figures beside a baseline
measured in the same run, and their ratio. They are programs, not tests.
"""
