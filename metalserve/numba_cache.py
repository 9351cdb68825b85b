"""numba's on-disk cache, one folder per version of the CPU kernels' sources.

A kernel compiled with `cache=True` keeps an index pickled with the types it was compiled for. After an
upgrade that removed or renamed such a type, numba unpickles the stale index before it checks the
source's timestamp, and the first forward raises AttributeError instead of recompiling (seen when
`StackedLinear` left `kernels/cpu/decoder_weights.py`). Keying the folder by the sources' bytes means a
changed kernel never meets an index written for another version.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

KERNEL_SOURCES = Path(__file__).resolve().parent / "kernels" / "cpu"


def sources_digest(folder: Path = KERNEL_SOURCES) -> str:
    """A short hash of every kernel source file's name and bytes."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir_for(digest: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "metalserve" / "numba" / digest


def set_numba_cache_dir() -> None:
    """Point NUMBA_CACHE_DIR at this version's folder, unless the user chose one (read when numba is
    imported, so this runs before anything imports it)."""
    if "NUMBA_CACHE_DIR" not in os.environ:
        os.environ["NUMBA_CACHE_DIR"] = str(cache_dir_for(sources_digest()))
