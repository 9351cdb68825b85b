"""The web page in a real headless Chromium against a real `metalserve serve` (the embedded default
model beside a tiny random-weight one): a streamed chat, a stopped answer, a model switch, and the
server view's numbers moving. Set METALSERVE_SCREENSHOTS=docs/images to refresh the docs' screenshots."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser.chrome import DRIVER, options, require_browser
from tests.e2e.server import RunningServer, running_server
from tests.loader.tiny_models import write_mlx_dir

require_browser()
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extras")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402


def wait_until(condition: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("browser")
    models = [
        {"name": "smollm2", "aliases": ["default"], "kv_cache_memory": 256 * 2**20, "max_model_len": 2048},
        {"model": str(write_mlx_dir(root / "tiny", "llama")), "name": "tiny-llama"},
    ]
    (root / "models.json").write_text(json.dumps(models))
    with running_server("--models", str(root / "models.json"), "--model-idle-timeout", "0") as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options("--window-size=1360,860"))
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: WebDriver, name: str, tmp_path: Path) -> None:
    directory = Path(os.environ.get("METALSERVE_SCREENSHOTS") or tmp_path)
    directory.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(directory / name))


def answers(driver: WebDriver) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def send(driver: WebDriver, text: str, max_tokens: int) -> Any:
    count = len(answers(driver))
    for field, value in (("max-tokens", str(max_tokens)), ("temperature", "0")):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
    return wait_until(lambda: answers(driver)[count] if len(answers(driver)) > count else None, what="an answer box")


def streaming(box: Any) -> bool:
    return "streaming" in (box.get_attribute("class") or "")


def test_chat_stop_switch_and_server_view(server: RunningServer, browser: WebDriver, tmp_path: Path) -> None:
    driver = browser
    driver.get(server.base_url + "/")
    model = Select(wait_until(lambda: driver.find_element(By.ID, "model-select"), what="the model picker"))
    wait_until(lambda: len(model.options) == 2, what="both models listed")
    model.select_by_value("smollm2")
    driver.find_element(By.ID, "system-prompt").send_keys("You are a helpful assistant.")

    # 1. a streamed answer: the text grows in several steps before the answer ends
    box = send(driver, "What is the capital of France?", 24)
    lengths = set()
    while streaming(box) or not lengths:
        lengths.add(len(box.find_element(By.CSS_SELECTOR, ".content").text))
    error = driver.find_element(By.ID, "chat-error").text
    assert len(lengths - {0}) >= 2, f"the answer did not stream: {lengths} {error!r}"
    assert "Paris" in box.find_element(By.CSS_SELECTOR, ".content").text

    # 2. stop a long answer midway: the request is aborted, the text stops growing
    box = send(driver, "Write a long story about a dragon who learns to cook.", 400)
    wait_until(lambda: len(box.find_element(By.CSS_SELECTOR, ".content").text) > 40, what="part of the story")
    driver.find_element(By.ID, "stop").click()
    wait_until(lambda: not streaming(box), what="the stop")
    stopped_text = box.find_element(By.CSS_SELECTOR, ".content").text
    assert box.find_element(By.CSS_SELECTOR, ".note").text == "stopped"
    time.sleep(1.0)
    assert box.find_element(By.CSS_SELECTOR, ".content").text == stopped_text
    recent = httpx.get(f"{server.v1}/server/status", timeout=30).json()["recent_requests"]
    assert recent[0]["status"] == "aborted" and 0 < recent[0]["output_tokens"] < 400

    screenshot(driver, "chat.png", tmp_path)

    # 3. switch models (in a new chat: the story would not fit the tiny model's 256 tokens of context):
    # the tiny model loads on first use and answers
    assert _state(server, "tiny-llama") == "unloaded"
    driver.find_element(By.ID, "new-chat").click()
    assert not answers(driver)
    model.select_by_value("tiny-llama")
    box = send(driver, "Hello!", 12)
    wait_until(lambda: not streaming(box), what="the tiny model's answer")
    assert box.find_element(By.CSS_SELECTOR, ".who").text == "tiny-llama"
    # random weights: the text may be invisible bytes, but the usage says 12 tokens came
    assert box.find_element(By.CSS_SELECTOR, ".note").text.startswith("12 tokens")
    assert _state(server, "tiny-llama") == "loaded"
    assert (
        json.loads(driver.execute_script("return localStorage.getItem('metalserve-conversation')"))[-1]["model"]
        == "tiny-llama"
    )

    # 4. the server view: its numbers follow what the server does
    driver.find_element(By.ID, "tab-server").click()
    card = wait_until(
        lambda: driver.find_elements(By.CSS_SELECTOR, ".model-card[data-model='tiny-llama']"), what="the model cards"
    )[0]
    wait_until(lambda: driver.find_element(By.ID, "requests-total").text == "3", what="three requests counted")
    assert card.find_element(By.CSS_SELECTOR, "[data-field='state']").text == "loaded"
    smol = driver.find_element(By.CSS_SELECTOR, ".model-card[data-model='smollm2']")
    assert smol.find_element(By.CSS_SELECTOR, "[data-field='ttft']").text.endswith("ms")
    rows = driver.find_elements(By.CSS_SELECTOR, "#recent-requests tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == ["length", "aborted", "stop"]
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Again"}], "max_tokens": 64}
    assert httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60).status_code == 200
    wait_until(lambda: driver.find_element(By.ID, "requests-total").text == "4", what="the view to refresh")
    tps = card.find_element(By.CSS_SELECTOR, "[data-field='generation_tps']").text
    assert float(tps) > 0
    screenshot(driver, "server.png", tmp_path)


def _state(server: RunningServer, name: str) -> str:
    cards = httpx.get(f"{server.v1}/models", timeout=30).json()["data"]
    return str(next(c["state"] for c in cards if c["id"] == name))
