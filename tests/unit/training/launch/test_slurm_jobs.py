"""`dlrm submit`'s batch script and its reading of Slurm's answers (training/launch/slurm_jobs.py).
Slurm's commands are stood in for here by recorded answers (the tests say so in their names);
tests/integration/test_on_slurm.py runs them on a real Slurm."""

import subprocess
from pathlib import Path

import pytest

from training.launch.slurm_jobs import BatchRequest, JobState, SlurmJobError, cancel, follow, job_state, submit

REQUEST = BatchRequest("dlrm-tiny", ("/v/bin/python", "-m", "flows.cli", "train", "--config", "/p/configs/my run.toml",
                                     "--set", 'run_dir="/shared/runs"', "--json"), "/p", nodes=2, partition="gpu",
                       time_limit="01:00:00", gpus_per_node=8, extra=("--account=recsys",))  # fmt: skip


def test_the_batch_script_asks_for_one_task_a_node_and_runs_train_under_srun(tmp_path: Path):
    script = REQUEST.script(tmp_path)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=dlrm-tiny", "--nodes=2", "--ntasks-per-node=1", "--requeue", f"--output={tmp_path}/%j.out",
                      "--open-mode=append", "--partition=gpu", "--time=01:00:00", "--gpus-per-node=8",
                      "--account=recsys"]  # fmt: skip
    srun = lines[-1]
    assert srun.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append")
    assert f"--output={tmp_path}/%j-node%n.out" in srun
    assert "'/p/configs/my run.toml'" in srun and "'run_dir=\"/shared/runs\"'" in srun, "quoted for the shell"
    assert "cd /p" in lines
    plain = BatchRequest("j", ("dlrm", "train"), "/p").script(tmp_path)
    assert "--partition" not in plain and "--time" not in plain and "--gpus-per-node" not in plain


@pytest.mark.parametrize("restarts", [None, "0", "2"])
def test_each_run_of_a_requeued_script_trains_in_a_step_of_its_own_with_a_stand_in_srun(tmp_path: Path,
                                                                                         restarts: str | None):  # fmt: skip
    """Run N of the script (Slurm's SLURM_RESTART_COUNT) starts N empty steps before the
    training step, so a signal still owed to the last run's training step misses this one's;
    an empty step that fails stops nothing. `srun` is a stand-in that records its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n[ "${{@: -1}}" != true ]\n')
    (bin_dir / "srun").chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(BatchRequest("j", ("dlrm", "train"), str(tmp_path)).script(tmp_path))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **({"SLURM_RESTART_COUNT": restarts} if restarts else {})}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    steps = calls.read_text().splitlines()
    empty = int(restarts or 0)
    assert steps[:empty] == ["--nodes=1 --ntasks=1 --output=/dev/null true"] * empty
    assert len(steps) == empty + 1 and steps[-1].endswith("dlrm train"), steps


def _answers(*outputs: tuple[int, str, str]):
    """A stand-in for Slurm's commands: each call gets the next recorded answer."""
    calls, queue = [], list(outputs)

    def run(argv):
        calls.append(list(argv))
        code, out, err = queue.pop(0)
        return subprocess.CompletedProcess(argv, code, out, err)

    return run, calls


def test_submit_reads_the_job_id_and_a_refusal_is_one_line_with_recorded_answers(tmp_path: Path):
    run, calls = _answers((0, "4242;cluster\n", ""), (1, "", "sbatch: error: invalid partition specified: gpu\n"))
    assert submit(tmp_path / "s.sbatch", run) == "4242" and calls[0] == ["sbatch", "--parsable", str(tmp_path / "s.sbatch")]
    with pytest.raises(SlurmJobError, match="invalid partition specified: gpu"):
        submit(tmp_path / "s.sbatch", run)


SHOW = ("JobId=4242 JobName=dlrm-tiny UserId=root(0) JobState={state} Reason={reason} Dependency=(null) "
        "Requeue=1 Restarts={restarts} BatchFlag=1 ExitCode={exit} NodeList=n[1-2]\n")  # fmt: skip


NODES = ("NodeName=n1 Arch=x86_64 State=ALLOCATED Partitions=debug\n"
         "NodeName=n2 Arch=x86_64 State=DOWN+NOT_RESPONDING Partitions=debug Reason=Not responding [slurm@2026-11-27T11:31:10]\n")


def test_the_state_is_followed_to_its_end_each_change_told_once_with_recorded_answers():
    shown = [(0, SHOW.format(state=s, reason=r, restarts=n, exit=e), "") for s, r, n, e in (
        ("PENDING", "Resources", 0, "0:0"), ("PENDING", "Resources", 0, "0:0"), ("RUNNING", "None", 0, "0:0"),
        ("PENDING", "BeginTime", 1, "0:0"), ("RUNNING", "None", 1, "0:0"), ("COMPLETED", "None", 1, "0:0"))]  # fmt: skip
    run, calls = _answers(*shown[:4], (0, NODES, ""), *shown[4:])  # after the requeue: which of its nodes is lost
    told = []
    final = follow("4242", lambda state: told.append((state.state, state.restarts, state.lost_nodes)), poll_s=0, run=run)
    lost = ("node n2 DOWN+NOT_RESPONDING (Not responding)",)
    assert told == [("PENDING", 0, ()), ("RUNNING", 0, ()), ("PENDING", 1, lost), ("RUNNING", 1, ()), ("COMPLETED", 1, ())]
    assert final.ended and final.exit_code == "0:0" and final.fields["NodeList"] == "n[1-2]"
    assert calls[0] == ["scontrol", "show", "job", "--oneliner", "4242"]
    assert calls[4] == ["scontrol", "show", "node", "--oneliner", "n[1-2]"], "the nodes the job held before the requeue"
    requeued = JobState("4242", "PENDING", "0:0", "BeginTime", 1, lost_nodes=lost)
    assert requeued.said() == "PENDING (BeginTime), restart 1: node n2 DOWN+NOT_RESPONDING (Not responding)"


def test_a_failed_job_carries_slurms_reason_and_a_forgotten_one_is_one_line_with_recorded_answers():
    run, _ = _answers((0, SHOW.format(state="FAILED", reason="NonZeroExitCode", restarts=0, exit="1:0"), ""),
                      (1, "", "slurm_load_jobs error: Invalid job id specified\n"), (0, "", ""))  # fmt: skip
    failed = job_state("4242", run)
    assert (failed.state, failed.reason, failed.exit_code, failed.ended) == ("FAILED", "NonZeroExitCode", "1:0", True)
    with pytest.raises(SlurmJobError, match="Invalid job id specified.*MinJobAge"):
        job_state("4242", run)
    cancel("4242", run)


def test_slurm_commands_missing_is_one_line():
    from training.launch.slurm_jobs import run_slurm

    with pytest.raises(SlurmJobError, match="sbatch-that-is-not-here: not found; run this on a Slurm login node"):
        run_slurm(["sbatch-that-is-not-here", "--parsable"])
