"""numba's cache folder is keyed by the CPU kernels' sources, so an upgrade never loads a stale index."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from metalserve.numba_cache import sources_digest

ROOT = Path(__file__).resolve().parents[1]


def _numba_cache_dir_of_a_fresh_process(env: dict[str, str]) -> str:
    code = "import metalserve, numba; print(numba.config.CACHE_DIR)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return result.stdout.strip()


def test_a_fresh_process_caches_kernels_in_the_folder_of_these_sources(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    expected = tmp_path / "metalserve" / "numba" / sources_digest()
    assert _numba_cache_dir_of_a_fresh_process(env) == str(expected)


def test_a_users_own_cache_dir_is_kept(tmp_path: Path) -> None:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "mine"))
    assert _numba_cache_dir_of_a_fresh_process(env) == str(tmp_path / "mine")


def test_the_digest_changes_with_any_kernel_source(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    before = sources_digest(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    changed = sources_digest(tmp_path)
    (tmp_path / "b.py").write_text("")
    assert len({before, changed, sources_digest(tmp_path)}) == 3
