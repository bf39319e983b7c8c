"""This project's C kernels (training/cpu/native/*.c): compiled on first use, loaded with ctypes.

Plain C with no Python or torch headers, so a build takes a fraction of a second with the
system's C compiler (`$CC`, else cc, gcc or clang) and needs nothing else installed. The
library is cached under `$DLRM_NATIVE_CACHE` (default `~/.cache/dlrm-pipeline/native`),
named by a hash of its source, compiler and flags: an edited kernel is rebuilt, and
processes that build at once each write a file of their own and rename it into place.
Kernels compile for the baseline of the machine's architecture; the hot loops carry
AVX2 variants that are picked at load time where the CPU has it (GCC's target clones).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from training.user_cache import user_cache

SOURCES = Path(__file__).resolve().parent / "native"
# fp-contract: a·b + c as one fused multiply-add (ISO C mode would round twice); no loop
# distribution: GCC would turn the kernels' short copy loops back into libc calls.
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast",
         "-fno-tree-loop-distribute-patterns")  # fmt: skip


class NativeUnavailable(RuntimeError):
    """No C compiler, or the kernel did not compile on this machine."""


def compiler() -> str | None:
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return next((found for name in candidates if (found := shutil.which(name))), None)


def cache_dir() -> Path:
    configured = os.environ.get("DLRM_NATIVE_CACHE")
    if configured:
        return Path(configured)
    return user_cache() / "native"


@functools.cache
def load(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled kernel library `training/cpu/native/<name>.c` (built here if not cached),
    compiled with `FLAGS` and `extra_flags`."""
    source = SOURCES / f"{name}.c"
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler on PATH (cc, gcc or clang; or set CC)")
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(source.read_bytes() + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    library = cache_dir() / f"{name}-{key}.so"
    if not library.is_file():
        _build(cc, flags, source, library)
    return ctypes.CDLL(str(library))


def _build(cc: str, flags: tuple[str, ...], source: Path, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    handle, staged = tempfile.mkstemp(prefix=library.stem, suffix=".so", dir=library.parent)
    os.close(handle)
    try:
        done = subprocess.run([cc, *flags, "-o", staged, str(source), "-lm"], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["(no output)"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise NativeUnavailable(f"{Path(cc).name} could not compile {source.name}: {first_error.strip()}")
        os.replace(staged, library)
    finally:
        Path(staged).unlink(missing_ok=True)
