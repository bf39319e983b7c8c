"""The project's folder in the user's cache: built native kernels, the empty tracking store.
Each user of it keeps a subfolder of its own."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache() -> Path:
    """`$XDG_CACHE_HOME/dlrm-pipeline` (default `~/.cache/dlrm-pipeline`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlrm-pipeline"
