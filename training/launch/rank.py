"""The process torchrun starts for each rank of a training job:

    python -m training.launch.agent --nproc-per-node=N ... -m training.launch.rank JOB.json

`training.worker`'s imports with the collector paused (training/launch/interpreter.py: 0.8 s of
a rank's 3.9 s start), then the worker's main; a finished rank leaves without the
interpreter's teardown (`training.worker.exit_skipping_teardown`). With a warm-rank server
named (`DLRM_WARM_RANKS`, a job across hosts in the tests), the server forks the rank instead
and this process stands in for it (training/launch/warm_ranks.py): no imports of its own.
"""

from __future__ import annotations

import sys

from training.launch.interpreter import imports_without_collection
from training.launch.warm_ranks import rank_client, server_socket  # the standard library's only


def main() -> None:
    server = server_socket()
    if server is not None:
        sys.exit(rank_client(server, sys.argv[1:]))
    with imports_without_collection():
        from training import worker  # the rank's imports: the measured reason they are here, not at the top
    worker.main()
    worker.exit_skipping_teardown()


if __name__ == "__main__":
    main()
