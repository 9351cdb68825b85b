"""Run the real uvicorn entry point (serve_app) over the fake core; the signal test starts this."""

from __future__ import annotations

import logging
import sys

from metalserve.api.server import serve_app
from metalserve.api.settings import ServerSettings
from tests.api.conftest import make_served

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    settings = ServerSettings(port=int(sys.argv[1]), log_stats_interval=0.2, graceful_shutdown_timeout=2)
    serve_app(make_served(settings, step_delay=0.01).app, settings)
