"""With --api-key the page asks for the key, says when the server rejected it, keeps it in the tab
(sessionStorage) only, and never leaves a button stuck when the dialog is dismissed."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalserve.api.settings import ServerSettings
from tests.api.conftest import live, make_served
from tests.browser.chrome import (
    DRIVER,
    SIZES,
    catch_errors,
    options,
    require_browser,
    screenshot,
    set_viewport,
    wait_until,
)

require_browser()
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extras")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402


@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_a_wrong_key_is_said_and_the_right_one_kept_in_the_tab(size: str, tmp_path: Path) -> None:
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options())
    catch_errors(driver)
    by_id = lambda name: driver.find_element(By.ID, name)  # noqa: E731
    try:
        set_viewport(driver, SIZES[size])
        with live(make_served(ServerSettings(api_key="sekret", log_stats_interval=0))) as served:
            driver.get(served.url + "/")
            dialog = by_id("key-dialog")
            wait_until(lambda: dialog.get_attribute("open") is not None, what="the key dialog")
            assert by_id("key-message").text == "This server needs an API key."
            assert by_id("conn").text == "key needed"
            # a wrong key: the dialog comes back and says the server rejected it
            by_id("key-input").send_keys("wrong")
            by_id("key-save").click()
            wait_until(lambda: "rejected" in by_id("key-message").text, what="the rejection")
            assert dialog.get_attribute("open") is not None and by_id("conn").text == "key rejected"
            screenshot(driver, f"key-rejected-{size}.png", tmp_path)
            # Escape: no key; the page says what is missing, and nothing stays disabled
            by_id("key-input").send_keys(Keys.ESCAPE)
            wait_until(lambda: dialog.get_attribute("open") is None, what="the dialog closed")
            wait_until(lambda: "API key" in by_id("model-state").get_attribute("textContent"), what="the hint")
            by_id("prompt").send_keys("Hello")
            by_id("send").click()
            wait_until(lambda: "API key" in by_id("chat-error").text, what="the chat error")
            assert by_id("send").is_enabled() and not by_id("stop").is_enabled()
            # the Key button: the right key, and everything loads
            by_id("key-button").click()
            wait_until(lambda: dialog.get_attribute("open") is not None, what="the dialog from the Key button")
            by_id("key-input").send_keys("sekret")
            by_id("key-save").click()
            wait_until(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#model-select option")) == 1, what="models")
            assert by_id("conn").text == "connected"
            assert driver.execute_script("return sessionStorage.getItem('metalserve-api-key')") == "sekret"
            assert "sekret" not in driver.execute_script("return JSON.stringify(localStorage)")
            assert driver.execute_script("return window.__errors") == []
    finally:
        driver.quit()
