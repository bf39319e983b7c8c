"""A killed writer leaves its staging behind (no `finally` runs under SIGKILL); the next
writer on the host removes it, and nothing a live process or another host owns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ingestion.staging import OWNER_FILE, UNOWNED_STALE_S, new_staging, release, remove_stale
from ingestion.warehouse import ingest_day

ROOT = Path(__file__).resolve().parents[3]


def _killed_writer(parent: Path) -> Path:
    """A process that makes a staging folder, writes into it and is SIGKILLed."""
    code = ("import sys, time; from pathlib import Path; from ingestion.staging import new_staging; "
            "s = new_staging(Path(sys.argv[1]), 'day=0'); (s / 'part.parquet').write_bytes(b'x' * 1000); "
            "print(s, flush=True); time.sleep(60)")  # fmt: skip
    writer = subprocess.Popen([sys.executable, "-c", code, str(parent)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    folder = Path(writer.stdout.readline().strip())
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert folder.is_dir(), "SIGKILL left the staging behind"
    return folder


def test_a_killed_writers_staging_is_removed_and_live_or_foreign_staging_kept(tmp_path: Path) -> None:
    parent = tmp_path / "_tmp"
    killed = _killed_writer(parent)
    foreign = parent / "day=2-0123abcd"
    foreign.mkdir()
    (foreign / OWNER_FILE).write_text(json.dumps({"host": "another-host", "pid": 1, "started": 0}))
    unowned_old, unowned_new = parent / "day=3-89abcdef", parent / "day=4-fedcba98"
    unowned_old.mkdir()
    unowned_new.mkdir()
    past = time.time() - UNOWNED_STALE_S - 60
    os.utime(unowned_old, (past, past))
    assert remove_stale(parent) == [killed, unowned_old]
    assert foreign.is_dir() and unowned_new.is_dir()
    mine = new_staging(parent, "day=1")
    assert remove_stale(parent) == [] and mine.is_dir(), "a live process's staging is kept"
    assert not (release(mine) / OWNER_FILE).exists(), "what is renamed into place carries no owner file"


def test_the_next_ingest_removes_a_killed_ingests_staging(tmp_path: Path) -> None:
    warehouse = tmp_path / "warehouse"
    killed = _killed_writer(warehouse / "_tmp")
    raw = tmp_path / "day_1.tsv"
    raw.write_text("\t".join(["1", *["3"] * 13, *["0a1b2c3d"] * 26]) + "\n")
    report = ingest_day([str(raw)], 1, warehouse)
    assert report.rows_written == 1
    assert not killed.exists() and not (warehouse / "_tmp").exists(), "no staging left behind"
