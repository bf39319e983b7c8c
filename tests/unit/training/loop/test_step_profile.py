"""Where a profiled step's time goes: operators put into parts by name and enclosing region,
on a real CPU profile of a step with the training loop's labels."""

from __future__ import annotations

import torch
from torch.autograd.profiler import record_function

from training.loop.profile import DATA_LABEL, StepProfiler, _cpu_parts, classify


def test_an_operator_takes_its_own_names_part_else_the_nearest_labelled_regions() -> None:
    assert classify("fbgemm::split_embedding_codegen_lookup_rowwise_adagrad_function", ["## backward ##"]) == "embedding"
    assert classify("aten::copy_", ["## All2All_Pooled_fwd ##", "## forward ##"]) == "communication"
    assert classify("gloo:all_to_all", []) == "communication"
    assert classify("aten::empty", [DATA_LABEL]) == "data"
    assert classify("aten::to", ["## copy_batch_to_gpu 3 ##"]) == "data"
    assert classify("aten::add_", ["Optimizer.step#Adam.step"]) == "optimizer"
    assert classify("aten::mm", ["## forward ##"]) == "dense"  # the forward's label says nothing of the part
    assert classify("aten::bmm", []) == "dense"


def test_a_real_cpu_profile_puts_labelled_work_in_its_part() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.Adam(mlp.parameters())
    profiler = StepProfiler(steps=3, total_steps=4, device=torch.device("cpu"))
    batches = profiler.labelled(iter([torch.randn(512, 64) for _ in range(4)]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for inputs in batches:
            with record_function(DATA_LABEL):  # a labelled wait the reader would take
                inputs = inputs.clone() * 1.0
            loss = mlp(inputs).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    parts = _cpu_parts(profile.events())
    assert set(parts) <= {"data", "dense", "optimizer"}
    assert parts["dense"] > 0 and parts["optimizer"] > 0 and parts["data"] > 0
    # every operator is counted once: the parts add up to the operators' own time
    own = sum(e.self_cpu_time_total for e in profile.events() if e.self_cpu_time_total > 0)
    assert abs(sum(parts.values()) - own) < 1e-6 * own + 1e-3


def test_the_profiler_window_is_the_last_steps_and_never_the_first() -> None:
    profiler = StepProfiler(steps=5, total_steps=40, device=torch.device("cpu"))
    assert (profiler.first_step, profiler.last_step) == (35, 40)
    short = StepProfiler(steps=5, total_steps=3, device=torch.device("cpu"))
    assert short.steps == 2 and short.first_step == 1
    assert not StepProfiler(steps=0, total_steps=40, device=torch.device("cpu")).active
