"""Run the real uvicorn entry point (serve_app) over the fake core; the signal tests start this.

Arguments: PORT [GRACE_SECONDS] [STEP_DELAY] [FAIL_AFTER_STEPS]."""

from __future__ import annotations

import logging
import sys

from metalserve.api.server import serve_app
from metalserve.api.settings import ServerSettings
from tests.api.conftest import make_served

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    port, grace = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    step_delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
    fail_after = int(sys.argv[4]) if len(sys.argv) > 4 else None
    settings = ServerSettings(port=port, log_stats_interval=0.2, graceful_shutdown_timeout=grace)
    served = make_served(settings, step_delay=step_delay, fail_after_steps=fail_after, max_model_len=4096)
    serve_app(served.app, settings)
