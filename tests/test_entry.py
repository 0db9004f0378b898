"""How every command and example starts and ends: at once, in one line, with the convention's exit code.

The convention (docs/operations.md): 0 done; 1 a failure while running; 2 a
usage error (a bad value, or something this machine cannot do, refused before
anything runs); Ctrl-C: what is open is closed, then the process ends by
SIGINT (the shell shows 130); a reader that closes stdout: the process ends by
SIGPIPE (the shell shows 141). Never a traceback.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import aiokvtier

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# -- the package imports nothing heavy until a name is used ---------------------------------------


def test_import_is_light_and_every_name_resolves() -> None:
    code = (
        "import sys, aiokvtier\n"
        "heavy = [m for m in ('numpy', 'pydantic', 'aiokvtier._host._tier') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from aiokvtier import *\n"
        "assert HostTier.__module__ == 'aiokvtier._host._tier'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_lazy_table_matches_all_and_the_type_checkers_imports() -> None:
    tree = ast.parse((ROOT / "aiokvtier" / "__init__.py").read_text())
    checked = {
        (f"{'.' * node.level}{node.module}", alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
        if alias.asname == alias.name
    }
    table = {(module, name) for module, names in aiokvtier._EXPORTS.items() for name in names}
    assert checked == table
    assert sorted(name for _, name in table) == sorted(aiokvtier.__all__)
