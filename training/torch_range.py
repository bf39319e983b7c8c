"""The torch releases this project trains with, and the fbgemm and TorchRec built for each
(fbgemm's minor version pairs with torch's). The first is the default.

Standard library only: the Makefile runs it before any environment exists
(`python3 training/torch_range.py [TORCH]` prints "torch fbgemm torchrec"), `make bundle`
and the Dockerfile read it, and a registered model's requirements follow the torch that
trained it.
"""

from __future__ import annotations

import sys
from typing import NamedTuple


class MatchedSet(NamedTuple):
    torch: str
    fbgemm: str
    torchrec: str


TORCH_RANGE = (
    MatchedSet("2.13.0", "1.8.0", "1.8.0"),
    MatchedSet("2.11.0", "1.6.0", "1.6.1"),
    MatchedSet("2.12.0", "1.7.0", "1.7.0"),
    MatchedSet("2.14.1", "1.9.0", "1.9.2"),
)
DEFAULT = TORCH_RANGE[0]


class OutsideTheRange(ValueError):
    """A torch release without a matched fbgemm and TorchRec here."""


def matched_set(torch_version: str) -> MatchedSet:
    """The set for a torch version ("2.11.0+cu130" → 2.11.0's; a patch release takes its
    minor release's fbgemm and TorchRec)."""
    release = torch_version.split("+")[0]
    minor = release.rsplit(".", 1)[0] if release.count(".") == 2 else release
    for row in TORCH_RANGE:
        if row.torch == release or row.torch.rsplit(".", 1)[0] == minor:
            return MatchedSet(release if release.count(".") == 2 else row.torch, row.fbgemm, row.torchrec)
    raise OutsideTheRange(f"torch {torch_version} is outside this project's range "
                          f"({', '.join(row.torch for row in TORCH_RANGE)})")  # fmt: skip


def main(argv: list[str]) -> int:
    try:
        chosen = matched_set(argv[0]) if argv else DEFAULT
    except OutsideTheRange as error:
        print(f"{error}: choose one of them", file=sys.stderr)
        return 2
    print(" ".join(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
