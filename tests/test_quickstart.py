"""The README's quick start runs as written: examples/quickstart.py (4 CPU devices) passes its own numpy check, and
the README's code block is the example's quick-start section, line for line."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "quickstart.py"


def _example_block() -> str:
    text = EXAMPLE.read_text()
    return text.split("# --- quick start\n", 1)[1].split("# --- end of quick start\n", 1)[0]


def test_readme_quick_start_is_the_example():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == _example_block(), "README's quick start and examples/quickstart.py differ"


def test_quickstart_runs_on_four_cpu_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300,
                       cwd=str(REPO_ROOT), env=env)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "PASS quickstart" in p.stdout, p.stdout
