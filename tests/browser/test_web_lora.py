"""The web page on a server with LoRA adapters: the picker lists each adapter with its base model (from
/v1/models' `parent`), the adapter scale shows only for an adapter, and a chat under an adapter answers
as the API does for that adapter at that scale."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from tests.api.conftest import Served, live, serve_config
from tests.browser.chrome import DESKTOP, DRIVER, catch_errors, options, require_browser, set_viewport, wait_until
from tests.distributed.tiny_dir import write_tiny_dir
from tests.lora.tiny_adapters import make_mlx_lm_adapter

require_browser()
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extras")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("web-lora")
    model = write_tiny_dir(root / "tiny-base")
    sql = make_mlx_lm_adapter(root / "sql", seed=1, rank=4, scale=4.0, num_hidden_layers=4)
    config = EngineConfig(
        model=str(model), kv_cache_memory=1 << 24, enable_lora=True, lora_modules=(("sql", str(sql)),)
    )
    with live(serve_config(config, ServerSettings(log_stats_interval=0))) as served:
        yield served


def api_answer(served: Served, model: str, **extra: Any) -> str:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra or None,
    )
    return words(str(reply.choices[0].message.content))


def words(text: str) -> str:
    """Text as the page shows it, whitespace aside (the DOM turns a \\r into a line break)."""
    return " ".join(text.split())


def test_the_page_picks_an_adapter_and_its_scale(server: Served) -> None:
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options())
    catch_errors(driver)
    by_id = lambda name: driver.find_element(By.ID, name)  # noqa: E731
    try:
        set_viewport(driver, DESKTOP)
        driver.get(server.url + "/")
        picker = Select(by_id("model-select"))
        wait_until(lambda: len(picker.options) == 2, what="the model list")
        labels = [o.text for o in picker.options]
        assert labels[0].startswith("tiny-base") and labels[1] == "sql (LoRA on tiny-base, loaded)"
        picker.select_by_value("tiny-base")
        assert not by_id("lora-scale-label").is_displayed()
        picker.select_by_value("sql")
        wait_until(lambda: by_id("lora-scale-label").is_displayed(), what="the adapter scale")
        assert by_id("model-state").text.startswith("LoRA adapter on tiny-base")

        def send(scale: str) -> str:
            by_id("new-chat").click()
            for field, value in (("max-tokens", str(MAX_TOKENS)), ("temperature", "0"), ("lora-scale", scale)):
                by_id(field).clear()
                by_id(field).send_keys(value)
            by_id("prompt").send_keys("Hi")
            by_id("send").click()
            box = wait_until(
                lambda: next(iter(driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")), None),
                what="an answer box",
            )
            wait_until(lambda: "streaming" not in (box.get_attribute("class") or ""), what="the answer")
            return words(box.find_element(By.CSS_SELECTOR, ".content").text)

        half = send("0.5")
        assert half == api_answer(server, "sql", lora_scale=0.5)
        assert half != api_answer(server, "sql")  # the scale reached the server
        assert send("1") == api_answer(server, "sql")
        assert api_answer(server, "sql") != api_answer(server, "tiny-base")
        # A scale out of range is refused on the page, before anything is sent.
        by_id("lora-scale").clear()
        by_id("lora-scale").send_keys("9")
        by_id("prompt").send_keys("Hi")
        by_id("send").click()
        wait_until(lambda: "Adapter scale must be between 0 and 8." in by_id("chat-error").text, what="the refusal")
    finally:
        driver.quit()
