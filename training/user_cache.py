"""The project's folder in the user's cache: built native kernels, the empty tracking store,
the Prefect database a new home starts from, fitted references, the generated days'
calibrated biases. Each user of it keeps a subfolder of its own."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path


def user_cache() -> Path:
    """`$XDG_CACHE_HOME/dlrm-pipeline` (default `~/.cache/dlrm-pipeline`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlrm-pipeline"


def migrations_digest(folder: Path) -> str:
    """Names the migration scripts in `folder`: a library build with other migrations gets
    a template of its own."""
    names = sorted(path.name for path in folder.glob("*.py")) if folder.is_dir() else []
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:10]


def copy_if_missing(template: Path, path: Path) -> bool:
    """Copy `template` to `path` unless `path` exists; whether this call made `path`.

    The copy is published with a hard link, which creates `path` only if it is still missing:
    of concurrent creators, one copy wins and the others are dropped (they were the same file).
    A file system without hard links raises OSError: the caller falls back to making the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    try:
        shutil.copyfile(template, partial)
        os.link(partial, path)
        return True
    except FileExistsError:
        return False
    finally:
        partial.unlink(missing_ok=True)
