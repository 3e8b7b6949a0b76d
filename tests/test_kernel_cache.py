"""Numba's cache for the CPU kernels is keyed on all their sources (ktlite/kernels/cpu/numba_cache.py).

Numba alone keys a cached function on the file that defines it: after a helper it inlines from another file changed,
it loads the old machine code (the control test shows it). Each run here is a fresh process on a tiny package in a
temp dir: `user.py` holds a cached function that calls `prim.py`'s helper, as every kernel calls simd.py's
primitives and the row dots of rowdots.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ktlite.kernels.cpu.numba_cache import KERNELS, sources_hash

ROOT = Path(__file__).resolve().parents[1]

_PRIM = "from numba import njit\n\n\n@njit(inline='always')\ndef helper(x):\n    return x + {}\n"
_USER = "from numba import njit\n\nfrom pkg.prim import helper\n\n\n@njit(cache=True)\ndef f(x):\n    return helper(x) * 10\n"

# keyed: the package's sources registered before its modules are imported, as ktlite/kernels/cpu/__init__.py does
_RUN = """
import json, sys
from pathlib import Path
root, keyed = sys.argv[1], sys.argv[2] == "1"
sys.path.insert(0, root)
if keyed:
    from ktlite.kernels.cpu.numba_cache import key_cache_on_sources
    key_cache_on_sources(Path(root) / "pkg")
from pkg.user import f
value = f(1)
print(json.dumps({"value": int(value), "hits": sum(f.stats.cache_hits.values()),
                  "misses": sum(f.stats.cache_misses.values()), "path": f.stats.cache_path}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES")}
    # no .pyc: an edit within the same second and of the same size would otherwise run the old bytecode
    return env | {"PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"} | extra


def _package(tmp_path: Path, add: int) -> Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "prim.py").write_text(_PRIM.format(add))
    (pkg / "user.py").write_text(_USER)
    return pkg


def _run(tmp_path: Path, keyed: bool, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path), "1" if keyed else "0"], capture_output=True,
                         text=True, timeout=300, env=_env(**env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_plain_numba_cache_runs_a_stale_helper(tmp_path):
    """The control: numba's own cache keeps f's old code after the helper in another file changed (if a numba
    version ever tracks what a function inlines, this test can go)."""
    _package(tmp_path, 1)
    assert _run(tmp_path, keyed=False)["value"] == 20
    _package(tmp_path, 200)
    stale = _run(tmp_path, keyed=False)
    assert stale["hits"] == 1 and stale["value"] == 20  # loaded from the cache: helper's old body


def test_changing_any_kernel_source_recompiles_its_dependents(tmp_path):
    pkg = _package(tmp_path, 1)
    first = _run(tmp_path, keyed=True)
    old = pkg / "__pycache__" / f"numba-{sources_hash(pkg)}"
    assert first == {"value": 20, "hits": 0, "misses": 1, "path": str(old)}
    assert any(p.suffix == ".nbi" and p.name.startswith("user.f-") for p in old.iterdir())
    assert _run(tmp_path, keyed=True) | {"path": None} == {"value": 20, "hits": 1, "misses": 0, "path": None}
    _package(tmp_path, 200)  # only prim.py changes: user.py, which defines f, is the same file
    new = pkg / "__pycache__" / f"numba-{sources_hash(pkg)}"
    assert new != old
    fresh = _run(tmp_path, keyed=True)
    assert fresh == {"value": 2010, "hits": 0, "misses": 1, "path": str(new)}  # recompiled with the new helper
    assert not old.exists()  # the old sources' directory is pruned
    assert _run(tmp_path, keyed=True)["hits"] == 1  # and the new code is cached in turn


def test_user_cache_dir_is_respected(tmp_path):
    """NUMBA_CACHE_DIR set: the hash directory lives under it, at numba's per-directory subpath."""
    pkg = _package(tmp_path, 1)
    cache = tmp_path / "cache"
    got = _run(tmp_path, keyed=True, NUMBA_CACHE_DIR=str(cache))
    path = Path(got["path"])
    assert got["value"] == 20 and got["misses"] == 1
    assert path.name == f"numba-{sources_hash(pkg)}" and path.parent.parent == cache and path.is_dir()
    assert not (pkg / "__pycache__").exists()


_KERNEL = """
import json
from ktlite.kernels.cpu.amx_kernels import cache_line_bytes
cache_line_bytes(64)
print(json.dumps({"path": cache_line_bytes.stats.cache_path, "misses": sum(cache_line_bytes.stats.cache_misses.values())}))
"""


def test_ktlite_kernels_are_keyed_on_the_package_sources(tmp_path):
    out = subprocess.run([sys.executable, "-c", _KERNEL], capture_output=True, text=True, timeout=300,
                         env=_env(NUMBA_CACHE_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    path = Path(got["path"])
    assert path.name == f"numba-{sources_hash(KERNELS)}" and path.parent.parent == tmp_path
    assert any(p.name.startswith("amx_kernels.cache_line_bytes-") for p in path.iterdir())
