"""The scratch folder the real agents work in: a file holding a secret word, and a module whose test fails
until its bug is fixed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.agents.agent_runs import SECRET

READ_TASK = "Read the file hello.txt and tell me the secret word in it."
# The fix task names the steps, and for Claude Code the tool of each, but not the bug: asked only to fix the
# bug (the first wording), the 1.5B called Edit on a file it had not read, with made-up text, and stopped
# (docs/agents.md#real-agents-in-the-tests).
FIX_TASK = (
    "calc.py has a bug that makes test_calc.py fail. First read calc.py. Then fix the bug in calc.py "
    "(do not change test_calc.py). Then run `python3 test_calc.py` and tell me what it printed."
)
CLAUDE_FIX_TASK = (
    "calc.py has a bug that makes test_calc.py fail. First read calc.py with the Read tool. Then fix the bug "
    "in calc.py with the Edit tool. Then run `python3 test_calc.py` with the Bash tool and tell me what it printed."
)
BUGGY = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n"


def scratch_repo(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text(f"The secret word is {SECRET}.\n")
    (work / "calc.py").write_text(BUGGY)
    (work / "test_calc.py").write_text(TEST)
    return work


def check_fixed(work: Path) -> None:
    """The bug is fixed on disk: the unchanged test passes."""
    assert (work / "test_calc.py").read_text() == TEST, "the agent changed the test"
    assert (work / "calc.py").read_text() != BUGGY, "calc.py is unchanged"
    done = subprocess.run([sys.executable, "test_calc.py"], cwd=work, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.stdout, done.stderr, (work / "calc.py").read_text())
