"""TEMPORARY stand-in (replaced by the real policies)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

Key = bytes | int


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def inserted(self, slot: int, key: Key) -> None: ...
    @abstractmethod
    def accessed(self, slots: npt.NDArray[np.int64]) -> None: ...
    @abstractmethod
    def removed(self, slot: int) -> None: ...
    @abstractmethod
    def victims(self) -> Iterator[int]: ...
    def resize(self, capacity: int) -> None:  # noqa: B027
        pass

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._od: OrderedDict[int, None] = OrderedDict()

    def inserted(self, slot: int, key: Key) -> None:
        self._od[slot] = None

    def accessed(self, slots: npt.NDArray[np.int64]) -> None:
        for s in slots.tolist():
            if s in self._od:
                self._od.move_to_end(s)

    def removed(self, slot: int) -> None:
        del self._od[slot]

    def victims(self) -> Iterator[int]:
        for s in list(self._od):
            if s in self._od:
                yield s

    def __len__(self) -> int:
        return len(self._od)


def make_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    if isinstance(policy, EvictionPolicy):
        policy.resize(capacity)
        return policy
    if policy == "lru":
        return LRUPolicy(capacity)
    raise ValueError(f"unknown policy {policy!r}; choose from ['lru', 's3fifo']")
