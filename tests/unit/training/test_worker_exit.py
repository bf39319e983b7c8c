"""A finished worker leaves without the interpreter's teardown, its output flushed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_finished_worker_flushes_its_output_and_skips_the_teardown(tmp_path: Path) -> None:
    marker = tmp_path / "teardown-ran"
    script = textwrap.dedent(f"""
        import atexit, sys
        from pathlib import Path
        from training.worker import exit_skipping_teardown
        atexit.register(lambda: Path({str(marker)!r}).write_text("ran"))
        sys.stdout.write("[train] done, unflushed")
        sys.stderr.write("last words")
        exit_skipping_teardown()
        print("not reached")
    """)
    # buffered, as stdout to a pipe is: only an explicit flush gets the text out before _exit
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "[train] done, unflushed"
    assert result.stderr.endswith("last words")
    assert not marker.exists(), "atexit handlers are part of the teardown that is skipped"
