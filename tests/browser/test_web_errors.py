"""The page is honest when things go wrong, at desktop and phone sizes, in a real headless Chromium against
the real server over a scripted engine core: a stopped server is said in the header and the chat, nothing
stays disabled; New chat aborts and drops a running reply; the settings are checked before sending; every
control is reachable at 360 px wide; and a reply cut off by Max tokens says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import live, make_served
from tests.browser.chrome import (
    DRIVER,
    SIZES,
    catch_errors,
    options,
    reachable,
    require_browser,
    screenshot,
    set_viewport,
    wait_until,
)

require_browser()
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extras")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402

CODE_REPLY = "Here is one:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nCall `add(1, 2)`."


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    browser = webdriver.Chrome(service=Service(str(DRIVER)), options=options())
    catch_errors(browser)
    try:
        yield browser
    finally:
        browser.quit()


def open_page(driver: WebDriver, url: str, size: str) -> None:
    set_viewport(driver, SIZES[size])
    driver.get(url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url + "/")
    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#model-select option"), what="the model list")


def by_id(driver: WebDriver, element_id: str) -> Any:
    return driver.find_element(By.ID, element_id)


def send(driver: WebDriver, text: str) -> None:
    by_id(driver, "prompt").send_keys(text)
    by_id(driver, "send").click()


def open_drawer(driver: WebDriver) -> None:
    """On a phone the settings live in a drawer behind the menu button."""
    if by_id(driver, "menu-button").is_displayed() and "drawer-open" not in (
        driver.find_element(By.TAG_NAME, "body").get_attribute("class") or ""
    ):
        by_id(driver, "menu-button").click()
        wait_until(lambda: reachable(driver, by_id(driver, "new-chat")), what="the drawer to open")


def close_drawer(driver: WebDriver) -> None:
    if "drawer-open" in (driver.find_element(By.TAG_NAME, "body").get_attribute("class") or ""):
        by_id(driver, "menu-button").click()
        wait_until(lambda: reachable(driver, by_id(driver, "prompt")), what="the drawer to close")


def set_field(driver: WebDriver, element_id: str, value: str) -> None:
    open_drawer(driver)
    box = by_id(driver, element_id)
    box.clear()
    if value:
        box.send_keys(value)
    close_drawer(driver)


def answers(driver: WebDriver) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def done(driver: WebDriver) -> bool:
    boxes = answers(driver)
    return bool(boxes) and "streaming" not in (boxes[-1].get_attribute("class") or "")


@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_a_stopped_server_is_said_and_nothing_stays_disabled(driver: WebDriver, size: str, tmp_path: Path) -> None:
    with live(make_served(reply=CODE_REPLY)) as served:
        open_page(driver, served.url, size)
        wait_until(lambda: by_id(driver, "conn").text == "connected", what="connected")
        send(driver, "Hello")
        wait_until(lambda: done(driver), what="the answer")
    # the server is gone: Send says so, in the chat and in the header, and both buttons are usable again
    send(driver, "Are you there?")
    wait_until(lambda: by_id(driver, "conn").text == "unreachable", what="the header")
    error = wait_until(lambda: by_id(driver, "chat-error").text, what="the chat error")
    assert "unreachable" in error and "Failed to fetch" not in error
    wait_until(lambda: by_id(driver, "send").is_enabled(), what="Send enabled again")
    assert not by_id(driver, "stop").is_enabled()
    assert answers(driver)[-1].find_element(By.CSS_SELECTOR, ".note").text == "error"
    screenshot(driver, f"server-down-{size}.png", tmp_path)
    uncaught = driver.execute_script("return window.__errors || []")
    assert uncaught == []


def test_new_chat_aborts_and_drops_the_running_reply(driver: WebDriver) -> None:
    with live(make_served(reply="word " * 200, step_delay=0.05)) as served:
        open_page(driver, served.url, "desktop")
        send(driver, "Tell me a long story")
        wait_until(lambda: len(answers(driver)[-1].find_element(By.CSS_SELECTOR, ".content").text) > 20, what="words")
        by_id(driver, "new-chat").click()
        wait_until(lambda: not answers(driver) and by_id(driver, "send").is_enabled(), what="an empty chat")
        wait_until(lambda: served.core.aborted, what="the request aborted on the server")
        assert json.loads(driver.execute_script("return localStorage.getItem('metalserve-conversation')")) == []
        served.core.reply = "Fresh."
        send(driver, "New question")
        wait_until(lambda: done(driver), what="the new answer")
        prompt = served.core.tokenizer.decode(served.core.added[-1].prompt_token_ids)
        assert "New question" in prompt and "long story" not in prompt and "word word" not in prompt
        assert len(answers(driver)) == 1


def test_settings_are_checked_before_sending(driver: WebDriver, tmp_path: Path) -> None:
    with live(make_served(reply="word " * 300)) as served:
        open_page(driver, served.url, "phone")
        for bad, says in (("0", "at least 1"), ("1000", "below the model's context"), ("2.5", "whole number")):
            set_field(driver, "max-tokens", bad)
            send(driver, "Hi")
            wait_until(lambda says=says: says in by_id(driver, "chat-error").text, what=f"the check of {bad!r}")
            assert by_id(driver, "prompt").get_attribute("value") == "Hi"  # kept for another try
            by_id(driver, "prompt").clear()
        assert not served.core.added and not answers(driver)
        # empty means the server's default (the rest of the context), not 0
        set_field(driver, "max-tokens", "")
        send(driver, "Hi")
        wait_until(lambda: done(driver), what="an answer with the default budget")
        request = served.core.added[-1]
        assert request.sampling_params.max_tokens == served.core.max_model_len - request.num_prompt_tokens
        # a reply cut off by Max tokens says that it was cut off (in a new chat: the first filled the context)
        set_field(driver, "max-tokens", "5")
        open_drawer(driver)
        by_id(driver, "new-chat").click()
        send(driver, "Again")
        wait_until(lambda: len(answers(driver)) == 1 and done(driver), what="the short answer")
        note = answers(driver)[-1].find_element(By.CSS_SELECTOR, ".note").text
        assert note.startswith("5 tokens") and "cut off: the Max tokens limit was reached" in note
        screenshot(driver, "length-phone.png", tmp_path)


@pytest.mark.parametrize("width", [360, 390])
def test_every_control_is_reachable_on_a_phone(driver: WebDriver, width: int, tmp_path: Path) -> None:
    with live(make_served(reply=CODE_REPLY)) as served:
        open_page(driver, served.url, "phone")
        set_viewport(driver, (width, 740))
        send(driver, "Code please")
        wait_until(lambda: done(driver), what="the answer")
        content = answers(driver)[-1].find_element(By.CSS_SELECTOR, ".content")
        assert content.size["width"] > width - 80  # the answer uses the screen, no fixed sidebar beside it
        for control in ("menu-button", "tab-chat", "tab-server", "key-button", "prompt", "send", "stop"):
            assert reachable(driver, by_id(driver, control)), control
        copy = content.find_element(By.CSS_SELECTOR, ".code-bar .copy")
        assert reachable(driver, copy)
        open_drawer(driver)
        for control in ("model-select", "system-prompt", "temperature", "max-tokens", "new-chat"):
            assert reachable(driver, by_id(driver, control)), control
        screenshot(driver, f"drawer-{width}.png", tmp_path)
        backdrop = by_id(driver, "drawer-backdrop")  # a tap beside the drawer closes it
        ActionChains(driver).move_to_element_with_offset(
            backdrop, backdrop.size["width"] // 2 - 10, 0
        ).click().perform()
        wait_until(lambda: reachable(driver, by_id(driver, "prompt")), what="the drawer closed")
        scroll = driver.execute_script("return document.documentElement.scrollWidth")
        assert scroll <= width, "the page scrolls sideways"
