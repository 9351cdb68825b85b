"""Rank 0's watchdog: a local rank that exits, or a step whose result does not come back in time,
ends the server with an error instead of a hang.

A rank that dies closes its sockets, so a step in flight fails at once (MLX's ring raises "connection
to a peer was lost") and the engine's failure path ends open requests and exits 1. The watchdog covers
the rest: a local rank that dies while the server is idle, and a rank that stops answering.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("metalserve.distributed")

POLL_S = 0.2
# After the engine was told, how long the process gets to send the clients' errors before it exits.
EXIT_GRACE_S = 5.0


class Watchdog:
    def __init__(
        self,
        children: list[subprocess.Popen[bytes]],
        step_timeout_s: float,
        waiting_since: Callable[[], float | None],
        role: str = "pipeline",
    ) -> None:
        """`waiting_since`: when rank 0 began waiting for a step's result (None while not waiting); `role`
        names the ranks in messages ("pipeline", "tensor-parallel")."""
        self.role = role
        self.children = children
        self.step_timeout_s = step_timeout_s
        self.waiting_since = waiting_since
        self.on_failure: Callable[[str], None] = self._exit_now  # set once the engine serves
        self.stopping = False
        self.failed = False
        self._thread = threading.Thread(target=self._run, name="metalserve-pipeline-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping:
            problem = self.check()
            if problem is not None:
                logger.error("pipeline failure: %s", problem)
                self.failed = True
                self.on_failure(problem)
                self.kill_children()  # unblocks a step waiting on a dead pipe
                time.sleep(EXIT_GRACE_S)
                if not self.stopping:
                    logger.error("exiting: the pipeline failed (%s)", problem)
                    os._exit(1)
                return
            time.sleep(POLL_S)

    def check(self) -> str | None:
        """A sentence naming the failure, or None while the pipeline is healthy."""
        for rank, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is not None and not self.stopping:
                return f"{self.role} rank {rank} exited with status {code}"
        since = self.waiting_since()
        if since is not None and time.monotonic() - since > self.step_timeout_s:
            ranks = "the pipeline" if self.role == "pipeline" else f"the {self.role} ranks"
            return f"no result from {ranks} for {self.step_timeout_s:.0f} s (--pipeline-step-timeout)"
        return None

    def _exit_now(self, problem: str) -> None:
        logger.error("pipeline start-up failed: %s", problem)
        self.kill_children()
        os._exit(1)

    def kill_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()

    def stop_children(self, timeout_s: float = 10.0) -> None:
        """Orderly end: wait for the local ranks (they got STOP), then kill what is left."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
