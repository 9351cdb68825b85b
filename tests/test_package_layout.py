"""What the wheel ships: the Metal kernels' sources, and no developer tools (the MSL emulator lives in tools/)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "metalserve"


def test_the_package_imports_nothing_from_tools_or_tests() -> None:
    outside = re.compile(r"^\s*(from|import) (tools|tests)\b", re.M)
    assert [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if outside.search(p.read_text())] == []


def test_package_data_is_the_metal_sources_and_the_web_page() -> None:
    with warnings.catch_warnings():  # setuptools calls its [tool.setuptools] table beta
        warnings.simplefilter("ignore")
        config = read_configuration(ROOT / "pyproject.toml")
    data = config["tool"]["setuptools"]["package-data"]["metalserve"]
    shipped = {p.relative_to(PACKAGE).as_posix() for pattern in data for p in PACKAGE.glob(pattern) if p.is_file()}
    metal = {p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "kernels" / "metal").glob("*.metal")}
    web = {p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "api" / "web").rglob("*") if p.is_file()}
    assert metal and {"api/web/index.html", "api/web/vendor/marked.umd.js", "api/web/vendor/marked.LICENSE"} <= web
    assert shipped == metal | web | {"py.typed"}
    assert not list(PACKAGE.rglob("*.h")) and not list(PACKAGE.rglob("*.cpp"))
