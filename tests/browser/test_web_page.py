"""The web page in a real headless Chromium against a real `metalserve serve` (the embedded default model,
loaded on first use, beside a tiny random-weight one), at desktop (1280x800) and phone (390x844) sizes:
the loading state, a streamed answer with code rendered as Markdown, a stopped answer, the prefill's
progress in the chat and in the server view as it happens, a model switch, and server-view numbers that
add up. Screenshots go to the test's tmp folder (METALSERVE_SCREENSHOTS=docs/images refreshes the docs')."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser.chrome import (
    DESKTOP,
    DRIVER,
    PHONE,
    catch_errors,
    options,
    require_browser,
    screenshot,
    set_viewport,
    wait_until,
)
from tests.e2e.server import RunningServer, running_server
from tests.loader.tiny_models import write_mlx_dir

require_browser()
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extras")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

CHUNK = 128  # the default model's prefill step budget here: a long prompt is read in visible steps
LONG_PROMPT = "Summarise this list.\n" + "\n".join(f"Item {i}: a box of {i % 7} red apples." for i in range(90))


# Table and card cells whose text runs over more than one line (one snapshot: the view redraws every second).
WRAPPED_CELLS = """const cells = document.querySelectorAll("#recent-requests td, .model-card dd");
return Array.from(cells).filter((cell) => {
  const range = document.createRange();
  range.selectNodeContents(cell);
  return new Set(Array.from(range.getClientRects(), (r) => Math.round(r.top))).size > 1;
}).map((cell) => cell.textContent);"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("browser")
    models = [
        {
            "name": "smollm2",
            "aliases": ["default"],
            "kv_cache_memory": 256 * 2**20,
            "max_model_len": 2048,
            "max_num_batched_tokens": CHUNK,
        },
        {"model": str(write_mlx_dir(root / "tiny", "llama")), "name": "tiny-llama"},
    ]
    (root / "models.json").write_text(json.dumps(models))
    with running_server("--models", str(root / "models.json"), "--model-idle-timeout", "0") as running:
        yield running


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    browser = webdriver.Chrome(service=Service(str(DRIVER)), options=options())
    catch_errors(browser)
    set_viewport(browser, DESKTOP)
    try:
        yield browser
    finally:
        browser.quit()


def by_id(driver: WebDriver, name: str) -> Any:
    return driver.find_element(By.ID, name)


def answers(driver: WebDriver) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def send(driver: WebDriver, text: str, max_tokens: int) -> Any:
    count = len(answers(driver))
    for field, value in (("max-tokens", str(max_tokens)), ("temperature", "0")):
        box = by_id(driver, field)
        box.clear()
        box.send_keys(value)
    # typed text would send at its first newline (Enter sends): a pasted prompt is set as a whole
    driver.execute_script("arguments[0].value = arguments[1]", by_id(driver, "prompt"), text)
    by_id(driver, "send").click()
    return wait_until(lambda: answers(driver)[count] if len(answers(driver)) > count else None, what="an answer box")


def streaming(box: Any) -> bool:
    return "streaming" in (box.get_attribute("class") or "")


def both_sizes(driver: WebDriver, name: str, tmp_path: Path) -> None:
    """The same moment at desktop and at phone size."""
    screenshot(driver, f"{name}-desktop.png", tmp_path)
    set_viewport(driver, PHONE)
    time.sleep(0.3)  # one layout and paint at the new size
    screenshot(driver, f"{name}-phone.png", tmp_path)
    set_viewport(driver, DESKTOP)


def model_state(server: RunningServer, name: str) -> str:
    cards = httpx.get(f"{server.v1}/models", timeout=30).json()["data"]
    return str(next(c["state"] for c in cards if c["id"] == name))


def loading_a_code_answer_and_stop(server: RunningServer, driver: WebDriver, tmp_path: Path) -> None:
    driver.get(server.base_url + "/")
    model = Select(wait_until(lambda: by_id(driver, "model-select"), what="the model picker"))
    wait_until(lambda: len(model.options) == 2, what="both models listed")
    model.select_by_value("smollm2")
    assert model_state(server, "smollm2") == "unloaded"

    # 1. the first message loads the model: the answer says so while the load runs
    box = send(driver, "Write a Python function that checks whether a number is prime.", 60)
    progress = box.find_element(By.CSS_SELECTOR, ".progress")
    wait_until(lambda: "Loading model smollm2" in progress.text, what="the loading state")
    picked = "const s = document.getElementById('model-select'); return s.options[s.selectedIndex].text"
    wait_until(lambda: driver.execute_script(picked).endswith("(loading)"), what="the picker to say loading")
    both_sizes(driver, "loading", tmp_path)

    # 2. the answer streams in, its code rendered as a highlighted block with a Copy button
    content = box.find_element(By.CSS_SELECTOR, ".content")
    lengths = set()
    while streaming(box):
        lengths.add(len(content.text))
    error = by_id(driver, "chat-error").text
    assert len(lengths - {0}) >= 2, f"the answer did not stream: {lengths} {error!r}"
    code = wait_until(lambda: content.find_elements(By.CSS_SELECTOR, "pre code.hljs"), what="a code block")[0]
    assert "def " in code.text and code.find_elements(By.CSS_SELECTOR, "span[class^='hljs-']")
    assert "```" not in content.text  # the fences are rendered, not shown
    copy = content.find_element(By.CSS_SELECTOR, ".code-bar .copy")
    copy.click()
    wait_until(lambda: copy.text in ("Copied", "Copy failed"), what="the copy")
    both_sizes(driver, "chat", tmp_path)

    # 3. stop a long answer midway: the request is aborted, the text stops growing
    by_id(driver, "new-chat").click()
    box = send(driver, "Write a long story about a dragon who learns to cook.", 400)
    wait_until(lambda: len(box.find_element(By.CSS_SELECTOR, ".content").text) > 40, what="part of the story")
    by_id(driver, "stop").click()
    wait_until(lambda: not streaming(box), what="the stop")
    stopped_text = box.find_element(By.CSS_SELECTOR, ".content").text
    assert box.find_element(By.CSS_SELECTOR, ".note").text == "stopped"
    time.sleep(1.0)
    assert box.find_element(By.CSS_SELECTOR, ".content").text == stopped_text
    recent = httpx.get(f"{server.v1}/server/status", timeout=30).json()["recent_requests"]
    assert recent[0]["status"] == "aborted" and 0 < recent[0]["output_tokens"] < 400
    assert driver.execute_script("return window.__errors") == []


def prefill_progress_in_the_chat_and_the_server_view(server: RunningServer, driver: WebDriver, tmp_path: Path) -> None:
    if by_id(driver, "tab-chat").get_attribute("class") != "tab active":
        by_id(driver, "tab-chat").click()
    by_id(driver, "new-chat").click()
    counted_before = server.metric("vllm:prompt_tokens_total")
    box = send(driver, LONG_PROMPT, 8)
    progress = box.find_element(By.CSS_SELECTOR, ".progress")

    def chunks_read() -> tuple[int, int] | None:
        seen = re.search(r"Reading the prompt: ([\d,]+) / ([\d,]+) tokens", progress.text)
        done, total = (int(g.replace(",", "")) for g in seen.groups()) if seen else (0, 0)
        return (done, total) if done > 0 else None

    done, total = wait_until(chunks_read, what="a prefill chunk done")
    assert total > 3 * CHUNK and 0 < done < total  # (prefix-cache hits count with the first chunk)
    screenshot(driver, "prefill-chat-desktop.png", tmp_path)

    # the server view while the prompt is read: the running request's progress, and prompt throughput
    # and the /metrics counter already moving before the first token
    by_id(driver, "tab-server").click()
    row = wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#running-requests .running"), what="running")[0]
    assert re.search(r"smollm2 · prompt [\d,]+ / [\d,]+ tokens", row.text), row.text
    card = driver.find_element(By.CSS_SELECTOR, ".model-card[data-model='smollm2']")
    wait_until(lambda: float(card.find_element(By.CSS_SELECTOR, "[data-field='prompt_tps']").text) > 0, what="tok/s")
    running = httpx.get(f"{server.v1}/server/status", timeout=30).json()["running_requests"]
    if running and running[0]["output_tokens"] == 0:  # still in the prefill (a slow machine is not a failure)
        assert server.metric("vllm:prompt_tokens_total") > counted_before
    both_sizes(driver, "server-prefill", tmp_path)

    by_id(driver, "tab-chat").click()
    wait_until(lambda: not streaming(box), timeout=180, what="the answer after the long prompt")
    assert server.metric("vllm:prompt_tokens_total") - counted_before == total  # each prompt token counted once


def switch_models_and_the_server_view_adds_up(server: RunningServer, driver: WebDriver, tmp_path: Path) -> None:
    # a new chat: the story would not fit the tiny model's 256 tokens of context
    by_id(driver, "new-chat").click()
    assert not answers(driver)
    Select(by_id(driver, "model-select")).select_by_value("tiny-llama")
    box = send(driver, "Hello!", 12)
    wait_until(lambda: not streaming(box), what="the tiny model's answer")
    assert box.find_element(By.CSS_SELECTOR, ".who").text == "tiny-llama"
    # random weights: the text may be invisible bytes, but the usage says 12 tokens came, and were cut off
    note = box.find_element(By.CSS_SELECTOR, ".note").text
    assert note.startswith("12 tokens") and "cut off" in note
    assert model_state(server, "tiny-llama") == "loaded"
    stored = json.loads(driver.execute_script("return localStorage.getItem('metalserve-conversation')"))
    assert stored[-1]["model"] == "tiny-llama"

    by_id(driver, "tab-server").click()
    card = wait_until(
        lambda: driver.find_elements(By.CSS_SELECTOR, ".model-card[data-model='tiny-llama']"), what="the cards"
    )[0]
    wait_until(lambda: by_id(driver, "requests-total").text == "4", what="four requests counted")
    assert card.find_element(By.CSS_SELECTOR, "[data-field='state']").text == "loaded"
    smol = driver.find_element(By.CSS_SELECTOR, ".model-card[data-model='smollm2']")
    ttft = smol.find_element(By.CSS_SELECTOR, "[data-field='ttft']").text
    assert re.fullmatch(r"[\d.]+ (ms|s) / [\d.]+ (ms|s)", ttft), ttft  # seconds above one second
    rows = driver.find_elements(By.CSS_SELECTOR, "#recent-requests tbody tr")
    statuses = [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows]
    assert len(statuses) == 4 and statuses[0] == "length" and "aborted" in statuses, statuses
    assert driver.execute_script(WRAPPED_CELLS) == []

    # the memory parts add up to the process's resident memory, each labelled
    memory = httpx.get(f"{server.v1}/server/status", timeout=30).json()["memory"]
    parts = ("weights_bytes", "kv_in_use_bytes", "kv_free_bytes", "other_bytes")
    assert memory["weights_bytes"] > 0 and memory["kv_reserved_bytes"] >= memory["kv_allocated_bytes"] > 0
    assert sum(memory[p] for p in parts) == max(memory["process_rss_bytes"], sum(memory[p] for p in parts[:3]))
    legend = [li.text for li in driver.find_elements(By.CSS_SELECTOR, "#mem-legend li")]
    assert [t.rsplit(" ", 2)[0] for t in legend] == [
        "Weights",
        "KV pool in use",
        "KV pool grown, free",
        "Other (Python, buffers)",
    ]
    assert "reserved" in by_id(driver, "mem-reserved").text
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Again"}], "max_tokens": 64}
    assert httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60).status_code == 200
    wait_until(lambda: by_id(driver, "requests-total").text == "5", what="the view to refresh")
    assert float(card.find_element(By.CSS_SELECTOR, "[data-field='generation_tps']").text) > 0
    both_sizes(driver, "server", tmp_path)
    assert httpx.get(f"{server.base_url}/favicon.ico", timeout=30).status_code == 200
    assert driver.execute_script("return window.__errors") == []


def test_the_page_as_a_person_uses_it(server: RunningServer, driver: WebDriver, tmp_path: Path) -> None:
    """One test, in the order a person goes (each step builds on the server's state after the last)."""
    loading_a_code_answer_and_stop(server, driver, tmp_path)
    prefill_progress_in_the_chat_and_the_server_view(server, driver, tmp_path)
    switch_models_and_the_server_view_adds_up(server, driver, tmp_path)
