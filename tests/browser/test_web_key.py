"""With --api-key the page asks for the key, keeps it in the tab (sessionStorage) only, and sends it."""

from __future__ import annotations

import time

import pytest

from metalserve.api.settings import ServerSettings
from tests.api.conftest import live, make_served
from tests.browser.chrome import DRIVER, options, require_browser

require_browser()
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extras")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


def test_page_asks_for_the_key_and_keeps_it_in_the_tab() -> None:
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options())
    try:
        with live(make_served(ServerSettings(api_key="sekret", log_stats_interval=0))) as served:
            driver.get(served.url + "/")
            dialog = driver.find_element(By.ID, "key-dialog")
            _wait(lambda: dialog.get_attribute("open") is not None)
            driver.find_element(By.ID, "key-input").send_keys("sekret")
            driver.find_element(By.ID, "key-save").click()
            _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#model-select option")) == 1)
            assert driver.find_element(By.ID, "conn").text == "connected"
            assert driver.execute_script("return sessionStorage.getItem('metalserve-api-key')") == "sekret"
            stored = driver.execute_script("return JSON.stringify(localStorage)")
            assert "sekret" not in stored
    finally:
        driver.quit()


def _wait(condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
