"""The web page at / (shipped in the package, nothing fetched from elsewhere) and the JSON the server
view polls, GET /v1/server/status, guarded by --api-key like the API."""

from __future__ import annotations

import re
import time

import httpx
import openai

from metalserve.api.settings import ServerSettings
from metalserve.api.status import WEB_DIR
from tests.api.conftest import live, make_served
from tests.api.multi_fakes import MB, FakeModels, make_registry, serving, spec

HI = [{"role": "user", "content": "Hi"}]


def test_page_and_assets_are_served_and_offline() -> None:
    with live(make_served()) as served:
        page = httpx.get(f"{served.url}/", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="model-select"' in page.text and 'id="server-view"' in page.text
        assets = re.findall(r'(?:src|href)="/web/([^"]+)"', page.text)
        assert {"app.js", "style.css", "vendor/marked.umd.js", "vendor/purify.min.js"} <= set(assets)
        for asset in assets:  # every file the page names is there
            response = httpx.get(f"{served.url}/web/{asset}", timeout=10)
            assert response.status_code == 200, asset
    for path in WEB_DIR.rglob("*"):  # no CDN, no font or script from another host
        if path.suffix in (".html", ".js", ".css", ".svg"):
            text = path.read_text()
            assert not re.search(r"(src|href)=\"(https?:)?//", text), path.name
            assert "import(" not in text and (path.suffix != ".css" or "@import" not in text), path.name
    licenses = {p.name for p in (WEB_DIR / "vendor").glob("*.LICENSE")}  # each vendored library keeps its own
    assert licenses == {"marked.LICENSE", "dompurify.LICENSE", "highlight.LICENSE"}


def test_status_reports_models_speed_and_recent_requests() -> None:
    fakes = FakeModels({"alpha": 3 * MB, "beta": MB}, step_delay=0.01)
    with serving(make_registry(fakes, [spec("alpha", "a"), spec("beta")], budget=64 * MB)) as url:
        status = httpx.get(f"{url}/v1/server/status", timeout=10).json()
        assert [(m["id"], m["state"]) for m in status["models"]] == [("alpha", "unloaded"), ("beta", "unloaded")]
        assert status["memory"]["budget_bytes"] == 64 * MB and status["memory"]["process_rss_bytes"] > 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="a", messages=HI, max_tokens=20)  # type: ignore[arg-type]
        stream = client.chat.completions.create(
            model="alpha", messages=HI, stream=True, max_tokens=50, extra_body={"ignore_eos": True}
        )  # type: ignore[arg-type]
        next(iter(stream))
        next(iter(stream))
        stream.close()  # the page's stop button does this: the request is aborted
        time.sleep(0.2)
        status = httpx.get(f"{url}/v1/server/status", timeout=10).json()
        alpha = status["models"][0]
        assert alpha["state"] == "loaded" and alpha["memory_bytes"] == 3 * MB and alpha["aliases"] == ["a"]
        assert alpha["generation_tokens_per_s"] > 0 and alpha["prompt_tokens_per_s"] > 0
        assert alpha["ttft_ms"]["count"] == 2 and alpha["tpot_ms"]["p50"] > 0
        assert alpha["kv_cache_usage"] is not None and alpha["running"] == 0
        assert status["memory"]["models_bytes"] == 3 * MB and status["requests_total"] == 2
        aborted, finished = status["recent_requests"]
        assert finished["model"] == "alpha" and finished["status"] == "stop" and finished["output_tokens"] > 0
        assert finished["prompt_tokens"] > 0 and finished["ttft_s"] > 0 and finished["e2e_s"] >= finished["ttft_s"]
        assert aborted["status"] == "aborted" and 0 < aborted["output_tokens"] < 50


def test_api_key_guards_the_status_but_not_the_page() -> None:
    settings = ServerSettings(api_key="sekret", log_stats_interval=0)
    with live(make_served(settings)) as served:
        assert httpx.get(f"{served.url}/", timeout=10).status_code == 200
        assert httpx.get(f"{served.url}/web/app.js", timeout=10).status_code == 200
        assert httpx.get(f"{served.url}/v1/server/status", timeout=10).status_code == 401
        ok = httpx.get(f"{served.url}/v1/server/status", headers={"Authorization": "Bearer sekret"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["models"][0]["state"] == "loaded"
    scripts = "".join(p.read_text() for p in WEB_DIR.glob("*.js"))
    assert "sessionStorage.setItem(KEY_ITEM" in scripts  # the key stays in the tab
    assert "localStorage.setItem(KEY_ITEM" not in scripts
