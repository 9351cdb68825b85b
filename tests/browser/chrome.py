"""Where the headless browser is: Debian's chromium + chromium-driver (`make browser`), or a runner's
preinstalled Google Chrome with its chromedriver (GitHub's Ubuntu images set CHROMEWEBDRIVER)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


DESKTOP = (1280, 800)
PHONE = (390, 844)
SIZES = {"desktop": DESKTOP, "phone": PHONE}


def set_viewport(driver: Any, size: tuple[int, int]) -> None:
    """The page's viewport exactly `size` (CSS pixels), as a desktop window or a phone (touch, mobile)."""
    width, height = size
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 700},
    )


def screenshot(driver: Any, name: str, directory: Path) -> Path:
    """Save the viewport as `name` under METALSERVE_SCREENSHOTS (docs/images refreshes the docs' pictures)
    or else `directory` (the test's tmp folder: a test artifact)."""
    target = Path(os.environ.get("METALSERVE_SCREENSHOTS") or directory)
    target.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(target / name))
    return target / name


def wait_until(condition: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def reachable(driver: Any, element: Any) -> bool:
    """Inside the viewport and the topmost element at its centre (not covered, not off-screen)."""
    return bool(
        driver.execute_script(
            """const r = arguments[0].getBoundingClientRect();
            if (r.width === 0 || r.height === 0) return false;
            if (r.left < 0 || r.top < 0 || r.right > innerWidth + 0.5 || r.bottom > innerHeight + 0.5) return false;
            const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
            return hit === arguments[0] || arguments[0].contains(hit);""",
            element,
        )
    )


CATCH_ERRORS = """window.__errors = [];
addEventListener("error", (e) => window.__errors.push(String(e.message)));
addEventListener("unhandledrejection", (e) => window.__errors.push(String(e.reason)));"""


def catch_errors(driver: Any) -> None:
    """Every page this driver opens records its uncaught errors in window.__errors."""
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": CATCH_ERRORS})
