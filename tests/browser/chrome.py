"""Where the headless browser is: Debian's chromium + chromium-driver (`make browser`), or a runner's
preinstalled Google Chrome with its chromedriver (GitHub's Ubuntu images set CHROMEWEBDRIVER)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

BROWSER = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")) if p),
    None,
)
_RUNNER_DRIVER = Path(os.environ.get("CHROMEWEBDRIVER", "/nonexistent")) / "chromedriver"
DRIVER = shutil.which("chromedriver") or (str(_RUNNER_DRIVER) if _RUNNER_DRIVER.is_file() else None)


def require_browser() -> None:
    """Skip the calling test module, with the reason, where no headless browser and driver are present."""
    if BROWSER is None or DRIVER is None:
        pytest.skip(
            "no headless Chromium here: `make browser` installs Debian's chromium and chromium-driver",
            allow_module_level=True,
        )


def options(*extra: str) -> object:
    from selenium.webdriver.chrome.options import Options

    opts = Options()
    opts.binary_location = str(BROWSER)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", *extra):
        opts.add_argument(arg)
    return opts
