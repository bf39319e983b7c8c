"""The process torchrun starts for each rank of a training job:

    python -m training.launch.agent --nproc-per-node=N -m training.launch.rank JOB.json

`training.worker`'s imports with the collector paused (training/launch/interpreter.py: 0.8 s of
a rank's 3.9 s start), then the worker's main; a finished rank leaves without the
interpreter's teardown (`training.worker.exit_skipping_teardown`).
"""

from __future__ import annotations

from training.launch.interpreter import imports_without_collection


def main() -> None:
    with imports_without_collection():
        from training import worker  # the rank's imports: the measured reason they are here, not at the top
    worker.main()
    worker.exit_skipping_teardown()


if __name__ == "__main__":
    main()
