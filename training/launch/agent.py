"""torchrun's agent for a training job, started as

    python -m training.launch.agent --standalone --nproc-per-node=N ... -m training.launch.rank JOB.json

It is `torch.distributed.run` with the same arguments, imported with the collector paused
(training/launch/interpreter.py): the agent's imports build about 250,000 objects, and the
collector's passes over them cost 0.4 s of its 1.8 s start (`bench/start_up.py`: CPU ×0.72), once
a launch: on each host of each training job, each night.
"""

from __future__ import annotations

from training.launch.interpreter import imports_without_collection


def main() -> None:
    with imports_without_collection():
        from torch.distributed import run  # the agent's imports: the measured reason they are here, not at the top
    run.main()  # torchrun's own argument parsing, of this process' arguments


if __name__ == "__main__":
    main()
