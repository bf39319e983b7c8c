"""`dlrm` commands run beside a test's own work, on the session's Prefect server.

Their output goes to files, not pipes: a command blocked on a full pipe nobody reads yet
would hold what it holds (the trainer slot) and stall every other command waiting for it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import warm_commands

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Beside:
    process: subprocess.Popen
    out: Path
    err: Path

    def report(self, timeout: float) -> dict:
        """The command's `--json` report, once it has ended well."""
        return json.loads(self.text(timeout).strip().splitlines()[-1])

    def text(self, timeout: float) -> str:
        """What the command printed, once it has ended well (exit 0)."""
        self.process.wait(timeout=timeout)
        assert self.process.returncode == 0, self.err.read_text()[-3000:]
        return self.out.read_text()


def start(arguments: list[str], overrides: list[str], folder: Path, api_url: str, as_json: bool = True,
          name: str = "dlrm") -> Beside:  # fmt: skip
    """`dlrm ARGUMENTS --set O ... [--json]`, its output in `folder` (`name`.out, `name`.err)."""
    out, err = folder / f"{name}.out", folder / f"{name}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen([*warm_commands.dlrm(), *arguments,
                                    *[a for o in overrides for a in ("--set", o)], *(["--json"] if as_json else [])],
                                   cwd=ROOT,
                                   stdout=stdout, stderr=stderr, env={**os.environ, "PREFECT_API_URL": api_url})  # fmt: skip
    return Beside(process, out, err)


@contextlib.contextmanager
def ended_on_failure(commands: list[Beside]) -> Iterator[None]:
    """The block's commands are killed if it fails: none is left running after a test."""
    try:
        yield
    finally:
        for command in commands:
            if command.process.poll() is None:
                command.process.kill()
