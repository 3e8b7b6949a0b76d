"""Numba's on-disk cache for the CPU kernels, keyed on all their sources.

Numba's `cache=True` keys a cached function on the content of the one file that defines it. A kernel inlines
helpers from other files (every kernel here is built from simd.py's primitives, the row dots of rowdots.py, ...),
so after such a helper changed numba would load the kernel's old machine code: a split of the kernels once ran
an old weight layout this way, and the kernels were kept in one file for it. Instead, `key_cache_on_sources()`
(run by ktlite/kernels/cpu/__init__.py before any kernel module is imported) puts the cache of every function
defined in this package under a directory named by a hash of all the package's sources, `numba-<hash>`, and makes
that hash the index's source stamp: any change to any of them starts from a fresh directory, whichever kernel it
reaches. (Python-side files such as moe.py are hashed too: editing one recompiles the kernels once, which is
cheaper than keeping a list of which files hold numba code.)

Where, as numba's own locators (numba.core.caching): with NUMBA_CACHE_DIR set, under it at numba's per-directory
subpath (`$NUMBA_CACHE_DIR/cpu_<sha1 of the package path>/numba-<hash>/`); else beside the sources
(`ktlite/kernels/cpu/__pycache__/numba-<hash>/`), or in numba's user-wide cache directory where the package's
directory is not writable. The first kernel cache a process opens removes the directories of other hashes beside
its own (old sources' machine code is never loaded again; a process still running older sources recreates its
directory on its next save, numba ensures the path before each). NUMBA_CACHE_LOCATOR_CLASSES, if set, replaces
numba's locator list and with it this one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from numba.core import caching, config
from numba.misc.appdirs import AppDirs

KERNELS = Path(__file__).resolve().parent  # the package whose functions are keyed by default
_HASH_DIR = re.compile(r"numba-[0-9a-f]{16}")


def sources_hash(directory: Path) -> str:
    """16 hex digits of sha256 over the names and contents of the directory's *.py files."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


class SourceTreeLocator(caching._CacheLocator):
    """Numba cache locator for the functions of registered source directories: `<base>/numba-<hash of the
    directory's sources>/`, base as numba's UserProvided / InTree / UserWide locators choose it."""

    # numba's locator registry is process-wide, and so is this: source directory -> hash of its sources
    trees: dict[str, str] = {}
    _pruned: set[str] = set()  # bases whose other hashes' directories were removed in this process

    def __init__(self, py_func, cache_path: str, digest: str):
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = cache_path
        self._digest = digest

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        return self._digest

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.exists(py_file):
            return None
        digest = cls.trees.get(os.path.dirname(os.path.realpath(py_file)))
        if digest is None:
            return None  # not a kernel source: numba's own locators take it
        for base in cls._bases(py_file):
            locator = cls(py_func, os.path.join(base, f"numba-{digest}"), digest)
            try:
                locator.ensure_cache_path()
            except OSError:
                continue
            if base not in cls._pruned:
                cls._pruned.add(base)
                _prune(base, keep=f"numba-{digest}")
            return locator
        return None

    @classmethod
    def _bases(cls, py_file: str) -> list[str]:
        subpath = cls.get_suitable_cache_subpath(py_file)
        if config.CACHE_DIR:
            return [os.path.join(config.CACHE_DIR, subpath)]
        return [os.path.join(os.path.dirname(py_file), "__pycache__"),
                os.path.join(AppDirs(appname="numba", appauthor=False).user_cache_dir, subpath)]


def _prune(base: str, keep: str) -> None:
    """Remove base's numba-<hash> directories other than `keep`."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if name != keep and _HASH_DIR.fullmatch(name):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def key_cache_on_sources(directory: Path = KERNELS) -> str:
    """Cache the numba functions defined in `directory`'s files under the hash of all its *.py files (from now on:
    call it before those modules are imported); returns the hash."""
    digest = sources_hash(directory)
    SourceTreeLocator.trees[os.path.realpath(directory)] = digest
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # older numba: _CacheImpl
    if SourceTreeLocator not in impl._locator_classes:
        impl._locator_classes.insert(0, SourceTreeLocator)
    return digest
