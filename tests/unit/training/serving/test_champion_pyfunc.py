"""The served model's preprocessing (numpy, in training/serving/champion_pyfunc.py) against the
run's own (DuckDB SQL, ingestion/preprocess.py): the same features from the same rows."""

import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from ingestion.config import PreprocessConfig
from ingestion.preprocess import PreprocessState, apply_state, fit_state
from ingestion.schema import DENSE_COLUMNS, SPARSE_COLUMNS
from training.serving.champion_pyfunc import (
    BadInput,
    FeatureMap,
    dense_features,
    lines_to_columns,
    serving_device,
)
from training.serving.export import ServingModel, vocabulary_arrays


def _feature_map(state: PreprocessState, features_root: Path | None = None) -> FeatureMap:
    vocabularies = vocabulary_arrays(state, features_root) if state.mode == "vocab" else {}
    preprocessing = {"mode": state.mode, "buckets": state.buckets, "multi_hot": sorted(state.multi_hot)}
    return FeatureMap(preprocessing, vocabularies)


def _raw_lines(tiny_raw: Path, day: int) -> list[str]:
    with gzip.open(tiny_raw / f"day_{day}.tsv.gz", "rt") as lines:
        return lines.read().splitlines()


def _features_of(files: list[str]) -> pd.DataFrame:
    return pq.read_table(files, partitioning=None).to_pandas()


def _kjt_columns(kjt, stride: int) -> dict[str, np.ndarray]:
    """One id per example and feature (one-hot features only)."""
    return {name: kjt[name].values().numpy() for name in SPARSE_COLUMNS if len(kjt[name].values()) == stride}


def test_raw_lines_give_the_runs_hashed_features(tiny_raw: Path, tiny_features) -> None:
    state, files = tiny_features
    expected = _features_of(files[2])
    columns = lines_to_columns(pd.Series(_raw_lines(tiny_raw, 2)))
    assert len(columns) == len(expected) == 6000
    dense = dense_features(columns)
    np.testing.assert_allclose(dense, expected[list(DENSE_COLUMNS)].to_numpy(), rtol=1e-7, atol=0)
    kjt = _feature_map(state).kjt(columns)
    assert kjt.keys() == list(SPARSE_COLUMNS) and kjt.stride() == 6000
    ids = _kjt_columns(kjt, 6000)
    assert len(ids) == 26
    for name in SPARSE_COLUMNS:
        np.testing.assert_array_equal(ids[name], expected[name].to_numpy(), err_msg=name)


def test_vocabulary_state_maps_ids_as_the_run_did(tiny_raw: Path, tiny_warehouse: Path, tmp_path: Path) -> None:
    config = PreprocessConfig(hash_size=300, categorical_mode="vocab", min_count=2, duckdb_threads=1,
                              row_group_size=2048)  # fmt: skip
    state = fit_state(config, tiny_warehouse, tmp_path, (0, 1))
    expected = _features_of(sorted(str(p) for p in apply_state(config, state, tiny_warehouse, tmp_path, 2).glob("*.parquet")))
    ids = _kjt_columns(_feature_map(state, tmp_path).kjt(lines_to_columns(pd.Series(_raw_lines(tiny_raw, 2)))), 6000)
    out_of_vocabulary = 0
    for name in SPARSE_COLUMNS:
        np.testing.assert_array_equal(ids[name], expected[name].to_numpy(), err_msg=name)
        out_of_vocabulary += int((ids[name] == 1).sum())
    assert out_of_vocabulary > 0, "the day has values the training days did not (row 1)"


def test_named_columns_with_bags_give_the_runs_multi_hot_features(multi_hot_warehouse: Path, multi_hot_features) -> None:
    state, files = multi_hot_features
    rows = pq.read_table(multi_hot_warehouse / "day=2", partitioning=None).to_pandas().drop(columns=["label"])
    expected = _features_of(files[2])
    kjt = _feature_map(state).kjt(rows)
    for name in ("C3", "C12"):  # bags: every id mapped, an empty bag as [0]
        lengths = kjt[name].lengths().numpy()
        values = np.split(kjt[name].values().numpy(), np.cumsum(lengths)[:-1])
        assert [list(v) for v in values] == [list(v) for v in expected[name]], name
    np.testing.assert_array_equal(kjt["C1"].values().numpy(), expected["C1"].to_numpy())


def test_lines_with_or_without_label_bom_and_crlf_split_alike() -> None:
    fields = ["7", "-3", "", *[str(i) for i in range(10)], "0a1b2c3d", "", *["ffffffff"] * 24]
    line = "\t".join(fields)
    columns = lines_to_columns(pd.Series(["\ufeff1\t" + line, line + "\r\n", "0\t" + line + "\n"]))
    assert list(columns.columns) == [*DENSE_COLUMNS, *SPARSE_COLUMNS]
    assert (columns.iloc[0] == columns.iloc[1]).all() and (columns.iloc[1] == columns.iloc[2]).all()
    dense = dense_features(columns)
    assert dense[0, 0] == pytest.approx(np.log(8.0)) and dense[0, 1] == 0.0 and dense[0, 2] == 0.0
    kjt = FeatureMap({"mode": "hash", "buckets": dict.fromkeys(SPARSE_COLUMNS, 10), "multi_hot": []}, {}).kjt(columns)
    assert kjt["C1"].values().tolist() == [1 + 0x0A1B2C3D % 10] * 3 and kjt["C2"].values().tolist() == [0] * 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1\t2\t3", "row 1: 3 tab-separated fields"),
        ("\t".join(["x", *["1"] * 12, *["0a1b2c3d"] * 26]), "row 1: I1 = 'x' is not a number"),
        ("\t".join([*["1"] * 13, "0a1b2c3", *["0a1b2c3d"] * 25]), "row 1: C1 = '0a1b2c3' is not 8 hex characters"),
    ],
)
def test_a_bad_row_is_named_with_its_reason(line: str, message: str) -> None:
    good = "\t".join([*["1"] * 13, *["0a1b2c3d"] * 26])
    feature_map = FeatureMap({"mode": "hash", "buckets": dict.fromkeys(SPARSE_COLUMNS, 10), "multi_hot": []}, {})
    with pytest.raises(BadInput, match=message):
        columns = lines_to_columns(pd.Series([good, line]))
        dense_features(columns)
        feature_map.kjt(columns)


def test_the_fbgemm_requirement_follows_the_serving_device_and_the_training_torch() -> None:
    from training.serving.export import serving_stack
    from training.torch_range import matched_set

    matched = matched_set(torch.__version__)
    cpu, cuda = ServingModel(Path("m"), "cpu").requirements, ServingModel(Path("m"), "cuda").requirements
    assert f"fbgemm-gpu-cpu=={matched.fbgemm}" in cpu and not any(r.startswith("fbgemm-gpu==") for r in cpu)
    assert f"fbgemm-gpu=={matched.fbgemm}" in cuda and not any(r.startswith("fbgemm-gpu-cpu") for r in cuda)
    assert {f"torch=={matched.torch}", f"torchrec=={matched.torchrec}"} <= set(cpu) & set(cuda)
    on_a_gpu_host = serving_stack("cuda", "2.11.0+cu130")
    assert {"torch==2.11.0", "torchrec==1.6.1", "fbgemm-gpu==1.6.0"} <= set(on_a_gpu_host)


def test_a_cuda_export_serves_on_cpu_where_there_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLRM_SERVING_DEVICE", raising=False)
    assert serving_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert serving_device("cuda") == expected
    monkeypatch.setenv("DLRM_SERVING_DEVICE", "cpu")
    assert serving_device("cuda") == torch.device("cpu"), "the variable overrides the export's choice"


def test_a_warehouse_models_ids_are_read_as_their_type_and_text_hashed_as_at_ingestion() -> None:
    import pyarrow as pa

    from ingestion.id_hash import hash_strings
    from training.serving.champion_pyfunc import BadInput, categorical_ids

    texts = categorical_ids(["u1", None, "u2"], "user_id", multi_hot=False, id_type="string")
    assert texts == [hash_strings(pa.array(["u1"])).to_pylist(), [], hash_strings(pa.array(["u2"])).to_pylist()]
    assert categorical_ids([-5, 7.0, float("nan")], "item_id", multi_hot=False, id_type="int") == [[-5], [7], []]
    bags = categorical_ids([["a", None, "b"], None, []], "tags", multi_hot=True, id_type="string")
    assert bags == [hash_strings(pa.array(["a", "b"])).to_pylist(), [], []]
    with pytest.raises(BadInput, match="item_id = 'x': this feature's ids are integers"):
        categorical_ids(["x"], "item_id", multi_hot=False, id_type="int")
    with pytest.raises(BadInput, match="user_id = 3: this feature's ids are text"):
        categorical_ids([3], "user_id", multi_hot=False, id_type="string")
    with pytest.raises(BadInput, match="not a multi-hot feature"):
        categorical_ids([[1, 2]], "item_id", multi_hot=False, id_type="int")


def test_the_served_probabilities_go_through_the_runs_calibrator(tiny_raw: Path, tiny_features, tmp_path: Path) -> None:
    """model.json's calibrator is applied to the DLRM's probabilities; none logged (a model
    from before calibration) serves them as they are."""
    import json
    from types import SimpleNamespace

    from evaluation.calibration import Calibrator
    from training.config import ModelConfig
    from training.model.build import dlrm_spec
    from training.model.stock_dlrm import SERVING_FORMAT, build_stock_dlrm
    from training.serving.champion_pyfunc import ChampionModel

    state, _ = tiny_features
    spec = dlrm_spec(ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1)), state.table_sizes)
    torch.manual_seed(0)
    dlrm = build_stock_dlrm(spec, torch.device("cpu")).eval()
    torch.save(dlrm.state_dict(), tmp_path / "dlrm.pt")
    platt = Calibrator("platt", slope=0.7, intercept=-0.3, rows=1000)
    description = {"format": SERVING_FORMAT, "device": "cpu", "dlrm": spec, "calibration": platt.as_dict(),
                   "preprocessing": {"state_id": state.state_id, "mode": state.mode, "buckets": state.buckets,
                                     "multi_hot": [], "dense": list(DENSE_COLUMNS), "id_types": {}}}  # fmt: skip
    (tmp_path / "model.json").write_text(json.dumps(description))
    lines = pd.DataFrame({"line": _raw_lines(tiny_raw, 2)[:300]})
    served = ChampionModel()
    served.load_context(SimpleNamespace(artifacts={"model": str(tmp_path)}))
    columns = lines_to_columns(lines["line"])
    with torch.inference_mode():
        own = torch.sigmoid(dlrm(torch.from_numpy(dense_features(columns)), served.features.kjt(columns))).reshape(-1)
    own = own.numpy().astype(np.float64)
    np.testing.assert_allclose(served.predict(None, lines), platt.apply(own), rtol=0, atol=1e-12)
    assert np.abs(platt.apply(own) - own).max() > 0.01, "the calibrator moves the probabilities"
    del description["calibration"]
    (tmp_path / "model.json").write_text(json.dumps(description))
    served.load_context(SimpleNamespace(artifacts={"model": str(tmp_path)}))
    np.testing.assert_allclose(served.predict(None, lines), own, rtol=0, atol=1e-12)


def test_crossed_pairs_are_served_as_the_reader_crosses_them(tiny_raw: Path, tiny_features) -> None:
    """Raw lines through the served preprocessing, and the feature files through the served
    model's `feature_rows` (how a champion scores new days), give each cross the rows the
    training reader gives it."""
    from dataclasses import asdict

    from ingestion.cross_ids import Cross
    from ingestion.reader import build_reader

    state, files = tiny_features
    crosses = (Cross("C6", "C11", 69), Cross("C18", "C19", 60))
    served = FeatureMap({"mode": state.mode, "buckets": state.buckets, "multi_hot": [],
                         "crosses": [asdict(cross) for cross in crosses]}, {})  # fmt: skip
    kjt = served.kjt(lines_to_columns(pd.Series(_raw_lines(tiny_raw, 2))))
    assert kjt.keys() == [*SPARSE_COLUMNS, "C6_x_C11", "C18_x_C19"] and kjt.stride() == 6000
    trained = next(iter(build_reader(files[2], 6000, drop_remainder=False, crosses=crosses))).sparse_features
    scored = served.feature_rows(next(iter(build_reader(files[2], 6000, drop_remainder=False))).sparse_features)
    for name in [*SPARSE_COLUMNS, *(cross.name for cross in crosses)]:
        np.testing.assert_array_equal(kjt[name].values().numpy(), trained[name].values().numpy(), err_msg=name)
        np.testing.assert_array_equal(scored[name].values().numpy(), trained[name].values().numpy(), err_msg=name)
    assert len(np.unique(kjt["C6_x_C11"].values().numpy())) > 10


def test_counts_cut_into_bins_are_served_as_the_reader_cuts_them(tiny_raw: Path, tiny_features) -> None:
    """Raw lines through the served preprocessing (ln(1 + x) in float32, then the bins), and
    the feature files' batches through `feature_rows` and `with_count_bins` (how a champion
    scores new days), give each count's bins the rows the training reader gives them, keyed
    after the crosses'."""
    from dataclasses import asdict

    from ingestion.count_bins import CountBins, quantile_edges
    from ingestion.cross_ids import Cross
    from ingestion.reader import build_reader

    state, files = tiny_features
    first = next(iter(build_reader(files[0], 6000, drop_remainder=False)))
    count_bins = tuple(CountBins(name, quantile_edges(first.dense_features[:, j].numpy()))
                       for j, name in ((0, "I1"), (5, "I6"), (12, "I13")))  # fmt: skip
    assert [len(bins.edges) >= 4 for bins in count_bins] == [True] * 3
    crosses = (Cross("C6", "C11", 69),)
    served = FeatureMap({"mode": state.mode, "buckets": state.buckets, "multi_hot": [],
                         "crosses": [asdict(cross) for cross in crosses],
                         "count_bins": [asdict(bins) for bins in count_bins]}, {})  # fmt: skip
    kjt = served.kjt(lines_to_columns(pd.Series(_raw_lines(tiny_raw, 2))))
    names = ["C6_x_C11", "I1_bins", "I6_bins", "I13_bins"]
    assert kjt.keys() == [*SPARSE_COLUMNS, *names] and kjt.stride() == 6000
    trained = next(iter(build_reader(files[2], 6000, drop_remainder=False, crosses=crosses, count_bins=count_bins)))
    plain = next(iter(build_reader(files[2], 6000, drop_remainder=False)))
    scored = served.with_count_bins(served.feature_rows(plain.sparse_features), plain.dense_features.numpy())
    for name in [*SPARSE_COLUMNS, *names]:
        np.testing.assert_array_equal(kjt[name].values().numpy(), trained.sparse_features[name].values().numpy(), err_msg=name)
        np.testing.assert_array_equal(scored[name].values().numpy(), trained.sparse_features[name].values().numpy(), err_msg=name)
    for j, bins in zip((0, 5, 12), count_bins, strict=True):  # the bins, from the dense values the model sees
        values = trained.sparse_features[bins.name].values().numpy()
        assert values.max() == len(bins.edges) and values.min() == 0
        np.testing.assert_array_equal(values, np.searchsorted(bins.edges, trained.dense_features[:, j].double().numpy(),
                                                              side="right"))  # fmt: skip
