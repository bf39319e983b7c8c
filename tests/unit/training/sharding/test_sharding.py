"""Planning needs no processes: the planner plans for a topology this machine need not have."""

import pytest
import torch
from torchrec.distributed.planner import Topology

from training.config import ShardingConfig
from training.model.build import build_train_model, table_name
from training.sharding.plan import (
    ShardingError,
    check_supported,
    describe_plan,
    format_plan,
    plan_sharding,
)

SIZES = {f"C{i}": 1000 + 100 * i for i in range(1, 27)}


def _model():
    from training.config import ModelConfig

    return build_train_model(ModelConfig(embedding_dim=16, bottom_mlp=(32, 16), top_mlp=(32, 1)), SIZES, torch.device("meta"))


def _shapes():
    return {table_name(f): (rows, 16) for f, rows in SIZES.items()}


def test_table_wise_plan_balances_tables_over_two_ranks() -> None:
    plan, estimates = plan_sharding(_model(), ShardingConfig(), Topology(world_size=2, compute_device="cpu"), 1024)
    assert [e.rank for e in estimates] == [0, 1] and all(e.ddr_bytes > 0 for e in estimates)
    rows = describe_plan(plan, _shapes(), 2)
    assert len(rows) == 26
    assert {r.sharding_type for r in rows} == {"table_wise"}
    assert all(len(r.ranks) == 1 for r in rows)
    per_rank = [sum(r.bytes_per_rank.get(rank, 0) for r in rows) for rank in (0, 1)]
    assert sum(per_rank) == sum(rows_ * 16 * 4 for rows_ in SIZES.values())
    assert min(per_rank) > 0.3 * sum(per_rank), "both ranks hold a fair share"
    text = format_plan(rows)
    assert "t_C1" in text and "rank 0:" in text and "rank 1:" in text


def test_data_parallel_tables_are_on_every_rank() -> None:
    config = ShardingConfig(sharding_type="data_parallel", compute_kernel="dense")
    plan, _ = plan_sharding(_model(), config, Topology(world_size=2, compute_device="cpu"), 1024)
    rows = describe_plan(plan, _shapes(), 2)
    assert all(r.ranks == [0, 1] for r in rows)
    assert all(r.bytes_per_rank[0] == r.bytes_per_rank[1] > 0 for r in rows)


def test_row_wise_is_planned_for_a_gpu_cluster_that_is_not_here() -> None:
    config = ShardingConfig(sharding_type="row_wise")
    topology = Topology(world_size=8, compute_device="cuda", local_world_size=8, hbm_cap=80 * 2**30)
    rows = describe_plan(plan_sharding(_model(), config, topology, 4096)[0], _shapes(), 8)
    assert {r.sharding_type for r in rows} == {"row_wise"}
    assert all(len(r.ranks) > 1 for r in rows), "row-wise tables are spread over several GPUs"


@pytest.mark.parametrize(
    "config, needle",
    [
        (ShardingConfig(sharding_type="row_wise"), "sharding.sharding_type = 'row_wise' needs CUDA"),
        (ShardingConfig(sharding_type="table_row_wise"), "needs CUDA"),
        (ShardingConfig(compute_kernel="fused_uvm"), "sharding.compute_kernel = 'fused_uvm'"),
        (ShardingConfig(compute_kernel="fused_uvm_caching"), "needs CUDA"),
    ],
)
def test_cuda_only_choices_fail_clearly_on_cpu(config: ShardingConfig, needle: str) -> None:
    with pytest.raises(ShardingError, match=needle.replace("(", r"\(")):
        check_supported(config, "cpu")
    check_supported(config, "cuda")  # accepted where they can run


def test_tables_that_cannot_fit_name_the_table_and_the_missing_memory() -> None:
    # t_C26 is the largest table: 3,600 rows × 16 × 4 B + 3,600 × 4 B of optimizer state = 244,800 B.
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=200_000)
    with pytest.raises(ShardingError) as caught:
        plan_sharding(_model(), ShardingConfig(), topology, 1024)
    message = str(caught.value)
    assert "\n" not in message
    assert "no sharding plan fits" in message and "t_C26" in message and "GiB" in message


def test_per_table_overrides_and_auto() -> None:
    from training.config import TableSharding

    config = ShardingConfig(sharding_type="auto", compute_kernel="auto",
                            tables={"t_C3": TableSharding("column_wise", "fused")})  # fmt: skip
    plan, _ = plan_sharding(_model(), config, Topology(world_size=2, compute_device="cpu"), 1024)
    rows = {r.table: r for r in describe_plan(plan, _shapes(), 2)}
    assert rows["t_C3"].sharding_type == "column_wise"
    assert {r.sharding_type for r in rows.values()} <= {"table_wise", "column_wise", "data_parallel"}, "auto on CPU"
    with pytest.raises(ShardingError, match="sharding.tables.t_C5.sharding_type = 'row_wise' needs CUDA"):
        bad = ShardingConfig(tables={"t_C5": TableSharding("row_wise", "fused")})
        plan_sharding(_model(), bad, Topology(world_size=2, compute_device="cpu"), 1024)


def test_a_declared_cluster_puts_the_largest_tables_in_host_memory() -> None:
    from training.config import ClusterConfig, ModelConfig
    from training.sharding.plan import cluster_topology

    sizes = {f"f{i}": rows for i, rows in enumerate([4_000_000, 3_000_000] + [50_000] * 8)}
    model = build_train_model(ModelConfig(embedding_dim=64, bottom_mlp=(64,), top_mlp=(64, 1)), sizes, torch.device("meta"))
    cluster = ClusterConfig(hosts=1, devices_per_host=2, device_memory_gb=1.0, host_memory_gb=64)
    config = ShardingConfig(sharding_type="auto", compute_kernel="auto")
    plan, estimates = plan_sharding(model, config, cluster_topology(cluster), 512)
    shapes = {table_name(f): (rows, 64) for f, rows in sizes.items()}
    rows = {r.table: r for r in describe_plan(plan, shapes, 2)}
    # 4 M × 64 × 4 B = 0.95 GiB: no room on a 1 GiB device beside the rest; the planner uses host memory.
    assert rows["t_f0"].compute_kernel in ("fused_uvm", "fused_uvm_caching")
    assert all(rows[f"t_f{i}"].compute_kernel == "fused" for i in range(2, 10))
    assert sum(e.ddr_bytes for e in estimates) > 0


def test_multi_hot_pooling_factors_reach_the_planner_cost_model() -> None:
    from training.sharding.plan import constraints_for

    bags = {"t_C3": 20.0, "t_C12": 8.0}
    constraints = constraints_for(_model(), ShardingConfig(), "cpu", bags)
    assert constraints["t_C3"].pooling_factors == [20.0] and constraints["t_C12"].pooling_factors == [8.0]
    assert constraints["t_C1"].pooling_factors == [1.0], "one-hot tables keep one id per example"
    topology = Topology(world_size=2, compute_device="cpu")
    _, one_hot = plan_sharding(_model(), ShardingConfig(), topology, 1024)
    _, multi_hot = plan_sharding(_model(), ShardingConfig(), topology, 1024, pooling_factor=bags)
    # 26 extra lookups per example on two tables cost more than one lookup per table
    assert sum(e.perf_ms for e in multi_hot) > sum(e.perf_ms for e in one_hot)


def test_the_patient_search_finds_the_exhaustive_searchs_plan_with_fewer_proposals(monkeypatch) -> None:
    """24 tables of 1–20 M rows × 512 on 2 × 8 GPUs, planned with TorchRec's full greedy
    searches (patience 0) and with the default patience: the same estimated cost per rank."""
    from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner

    from training.config import ClusterConfig, DeclaredTables, ModelConfig
    from training.sharding.plan import cluster_topology

    sizes = DeclaredTables(count=24, max_rows=20_000_000, min_rows=1_000_000).table_sizes()
    model = build_train_model(ModelConfig(embedding_dim=512, bottom_mlp=(1024, 512), top_mlp=(1024, 1)), sizes,
                              torch.device("meta"))  # fmt: skip
    topology = cluster_topology(ClusterConfig(hosts=2, devices_per_host=8))
    partitioned = []
    partition = GreedyPerfPartitioner.partition

    def counting(self, *args, **kwargs):
        partitioned[-1] += 1
        return partition(self, *args, **kwargs)

    monkeypatch.setattr(GreedyPerfPartitioner, "partition", counting)
    costs = []
    for patience in (0, ShardingConfig().search_patience):
        partitioned.append(0)
        config = ShardingConfig(sharding_type="auto", compute_kernel="auto", search_patience=patience)
        _, estimates = plan_sharding(model, config, topology, 4096, pooling_factor=20.0)
        costs.append([round(e.perf_ms, 6) for e in estimates])
    assert costs[0] == costs[1]
    assert partitioned[1] < partitioned[0] / 2, partitioned


def test_a_negative_search_patience_is_refused() -> None:
    with pytest.raises(ValueError, match="search_patience: must be ≥ 0"):
        ShardingConfig(search_patience=-1)


def test_the_training_topology_has_this_hosts_memory() -> None:
    import os

    from training.sharding.plan import cluster_topology, this_job_cluster

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cluster = this_job_cluster(torch.device("cpu"), world_size=4, local_world_size=2)
    assert (cluster.hosts, cluster.devices_per_host, cluster.compute_device) == (2, 2, "cpu")
    topology = cluster_topology(cluster)
    assert topology.world_size == 4 and topology.local_world_size == 2
    # each process's share of the host's memory, not TorchRec's 128 GiB default
    assert all(abs(device.storage.ddr - host / 2) <= 1024 for device in topology.devices)


def test_tables_beyond_the_given_host_memory_do_not_plan_mocked_small_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from training.sharding import plan as sharding

    monkeypatch.setattr(sharding, "host_memory_bytes", lambda: 2**20)  # a 1 MiB host: the plan must not fit
    topology = sharding.cluster_topology(sharding.this_job_cluster(torch.device("cpu"), 2, 2))
    with pytest.raises(ShardingError):
        plan_sharding(_model(), ShardingConfig(), topology, 1024)
    monkeypatch.undo()
    fits = sharding.cluster_topology(sharding.this_job_cluster(torch.device("cpu"), 2, 2))
    assert plan_sharding(_model(), ShardingConfig(), fits, 1024)[0].plan, "the real host holds these tables"


def test_quantized_communication_is_refused_on_cpu_and_configured_for_gpus() -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from training.sharding.plan import sharders_for

    config = ShardingConfig(comm_forward_precision="fp16", comm_backward_precision="bf16")
    # TorchRec runs the sharded modules on CPU without the codecs: refused, not ignored
    with pytest.raises(ShardingError, match="quantized communication needs CUDA"):
        plan_sharding(_model(), config, Topology(world_size=2, compute_device="cpu"), 1024)
    (ebc,) = [s for s in sharders_for(config) if type(s) is EmbeddingBagCollectionSharder]
    codecs = ebc.qcomm_codecs_registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert codecs.forward is not None and codecs.backward is not None
    gpus = Topology(world_size=8, compute_device="cuda", local_world_size=8, hbm_cap=80 * 2**30)
    assert plan_sharding(_model(), config, gpus, 4096)[0].plan, "planned for GPUs with the codecs"
    plain = [s for s in sharders_for(ShardingConfig()) if type(s) is EmbeddingBagCollectionSharder]
    assert plain[0].qcomm_codecs_registry is None


def test_the_planner_counts_row_wise_adagrad_state_as_one_float_per_row_in_training_and_dlrm_plan() -> None:
    """Training attaches the embedding optimizer before planning, and `dlrm plan` does the
    same: the estimate is the tables plus one float per row, not a second copy of them."""
    from flows.run.config import ClusterConfig, PipelineConfig
    from flows.run.feature_files import TablesToPlan
    from flows.run.planning import plan_report
    from training.config import ModelConfig, TrainingConfig
    from training.loop.optimizers import attach_embedding_optimizer

    sizes = {f"f{i}": 200_000 for i in range(4)}
    dim = 64
    model_config = ModelConfig(embedding_dim=dim, bottom_mlp=(32, dim), top_mlp=(32, 1))
    tables = sum(sizes.values()) * dim * 4
    with_state = tables * (1 + 1 / dim)

    model = build_train_model(model_config, sizes, torch.device("meta"))
    attach_embedding_optimizer(model, TrainingConfig())
    _, estimates = plan_sharding(model, ShardingConfig("table_wise", "fused"), Topology(world_size=1, compute_device="cpu"), 512)
    training_bytes = sum(e.ddr_bytes for e in estimates)
    assert with_state <= training_bytes < 1.1 * with_state, (training_bytes, with_state)

    config = PipelineConfig(model=model_config, sharding=ShardingConfig("table_wise", "fused"),
                            training=TrainingConfig(nproc=1, batch_size=512))
    cpu = ClusterConfig(hosts=1, devices_per_host=1, compute_device="cpu")
    report = plan_report(config, cpu, TablesToPlan(sizes, "hash"))
    assert sum(rank["ddr_bytes"] for rank in report.per_rank) == training_bytes, "dlrm plan plans what trains"


def test_managed_ids_memory_is_kept_from_the_tables_on_the_device_that_holds_the_remapper(monkeypatch) -> None:
    """The remapper lives beside each process's tables: GPU memory on a GPU cluster, host
    memory on a CPU one; `dlrm plan` of a managed config plans with that much less."""
    import flows.run.planning
    from flows.run.config import load_config
    from flows.run.feature_files import TablesToPlan
    from training.config import ClusterConfig
    from training.model.managed_ids import state_bytes
    from training.sharding.plan import cluster_topology

    gpus, cpus = ClusterConfig(hosts=1, devices_per_host=8), ClusterConfig(compute_device="cpu", devices_per_host=2)
    assert cluster_topology(gpus, 10**9).devices[0].storage.hbm == cluster_topology(gpus).devices[0].storage.hbm - 10**9
    assert cluster_topology(gpus, 10**9).devices[0].storage.ddr == cluster_topology(gpus).devices[0].storage.ddr
    assert cluster_topology(cpus, 10**9).devices[0].storage.ddr == cluster_topology(cpus).devices[0].storage.ddr - 10**9
    sizes = {"C1": 1_000, "C2": 500_000}
    assert state_bytes(sizes, "lru") == 501_000 * 24 + 2 * 8_208
    reserved = []
    monkeypatch.setattr(flows.run.planning, "cluster_topology",
                        lambda cluster, kept=0: reserved.append(kept) or cluster_topology(cluster, kept))  # fmt: skip
    config = load_config("configs/tiny.toml", ['preprocess.categorical_mode="hash"'])
    for mode in ("managed", "hash"):  # the fitted state's mode, whatever the config says: as training reads it
        assert flows.run.planning.plan_report(config, gpus, TablesToPlan(sizes, mode)).tables == 2
    assert reserved == [state_bytes(sizes, "lru"), 0]


def test_the_planner_reads_the_fitted_states_mode_not_the_configs(tmp_path) -> None:
    """A run folder whose fitted state is managed (a lineage that kept its champion's mode) is
    planned as managed, whatever the config says now: training reads the state too."""
    from flows.run.config import load_config
    from flows.run.feature_files import tables_to_plan
    from ingestion.preprocess import PreprocessState

    config = load_config("configs/tiny.toml", [f'run_dir="{tmp_path}"', 'preprocess.categorical_mode="hash"'])
    folder = config.path(config.preprocess.features_dir) / "s"
    folder.mkdir(parents=True)
    PreprocessState("s", {"C1": 10, "C2": 5}, (0,), 100, 0.25, mode="managed").save(folder / "state.json")
    tables = tables_to_plan(config)
    assert tables.categorical_mode == "managed" and tables.sizes == {"C1": 11, "C2": 6}


def test_the_dense_estimate_is_torchrecs_own_measure_of_the_dense_part() -> None:
    """The estimate handed to the planner is what TorchRec's heuristic measures (its private
    function, the oracle here): the plan stays the plan the heuristic gave."""
    from torchrec.distributed.planner.storage_reservations import _get_dense_tensor_size
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from training.sharding.plan import DENSE_PARAMETER_MULTIPLIER, dense_bytes_estimate, sharders_for

    model = _model()
    tables = {m for m in model.modules() if isinstance(m, EmbeddingBagCollection)}
    expected = _get_dense_tensor_size(model, tables, DENSE_PARAMETER_MULTIPLIER)
    estimate = dense_bytes_estimate(model, sharders_for(ShardingConfig()))
    assert len(tables) == 1 and estimate == expected > 0
    dense = sum(p.numel() * 4 for name, p in model.named_parameters() if "embedding_bag_collection" not in name)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # the interaction's pair indices
    assert estimate == 6 * dense + buffers > 6 * dense, "the dense parameters (fp32) six times, the buffers once"


def test_a_plan_over_a_declared_cluster_leaves_no_planner_notice(caplog: pytest.LogCaptureFixture) -> None:
    """Neither the topology (built by TorchRec's factory) nor the storage reservation (given the
    dense part's size) makes TorchRec's planner warn: `dlrm plan` and the ranks' logs stay clean."""
    import logging
    import warnings

    from training.config import ClusterConfig
    from training.sharding.plan import cluster_topology

    cluster = ClusterConfig(name="two hosts", hosts=2, devices_per_host=8, compute_device="cuda", device_memory_gb=80,
                            host_memory_gb=1024)  # fmt: skip
    with warnings.catch_warnings(record=True) as warned, caplog.at_level(logging.WARNING, logger="torchrec"):
        warnings.simplefilter("always")
        plan, estimates = plan_sharding(_model(), ShardingConfig(), cluster_topology(cluster), 1024)
    assert len(estimates) == 16 and plan.plan
    assert not [w for w in warned if "torchrec" in w.filename], [str(w.message) for w in warned]
    assert not [r for r in caplog.records if r.name.startswith("torchrec")], [r.getMessage() for r in caplog.records]
