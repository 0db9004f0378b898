"""numpy's submodules that its functions import on their first call, imported at once.

``np.unique`` (and ``union1d`` and the other set functions) imports ``numpy.ma`` the first time it
runs, and ``np.ctypeslib`` is imported when first named. Done on a loop thread, that import spends
milliseconds and takes the import lock, which a thread importing the same module at that moment holds:
the loop waits on a thread. The modules that use numpy on a loop's path import this one at their own
import time.
"""

from __future__ import annotations

import numpy.ctypeslib
import numpy.ma

LOADED = (numpy.ctypeslib, numpy.ma)
"""What was imported (named, so that the imports are kept)."""
