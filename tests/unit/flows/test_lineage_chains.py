"""A kept delta checkpoint keeps its chain: `keep_checkpoint` hard-links the links not kept yet
(each naming its parent's kept copy), and `prune_lineage` never removes a link the champion's
chain needs (a real SQLite registry)."""

import json
from pathlib import Path

import pytest

from flows.run.config import load_config
from flows.tracking.lineage import TAG_CHECKPOINT, keep_checkpoint, prune_lineage
from flows.tracking.registry import CHAMPION_ALIAS
from flows.tracking.runs import tracking_client
from training.loop.checkpoint_chain import chain_of

ROOT = Path(__file__).resolve().parents[3]


def _link(folder: Path, name: str, parent: Path | None) -> Path:
    link = folder / name
    link.mkdir(parents=True)
    (link / "rows-rank-00000.pt").write_bytes(name.encode())
    meta = {"kind": "delta" if parent else "full", "files": {"rows-rank-00000.pt": len(name.encode())}}
    if parent:
        meta["parent"] = str(Path("..") / parent.parent.name / parent.name) if parent.parent != folder else parent.name
    (link / "meta.json").write_text(json.dumps(meta))
    return link


@pytest.mark.slow  # a real MLflow registry: about 12 s
def test_a_delta_is_kept_with_its_chain_and_the_champions_chain_survives_pruning(tmp_path: Path) -> None:
    config = load_config(ROOT / "configs" / "tiny.toml", [f'run_dir="{tmp_path}"'])
    run = tmp_path / "train" / "checkpoints" / "run-a"
    full = _link(run, "step-5", None)
    delta = _link(run, "step-10", full)
    kept = Path(keep_checkpoint(config, str(_link(run, "step-15", delta))))
    lineage = config.path("lineage")
    assert kept == lineage / "run-a-step-15"
    chain = chain_of(kept)
    assert [link.name for link in chain] == ["run-a-step-5", "run-a-step-10", "run-a-step-15"]
    assert all(link.parent == lineage for link in chain), "every link is kept, none read from the training folder"
    assert json.loads((run / "step-15" / "meta.json").read_text())["parent"] == "step-10", "the original is untouched"
    # the next night is a delta on the kept copy, from its own training folder
    night = _link(tmp_path / "train" / "checkpoints" / "run-b", "step-3", kept)
    (night / "meta.json").write_text(json.dumps({**json.loads((night / "meta.json").read_text()),
                                                 "parent": str(Path("..") / ".." / ".." / "lineage" / kept.name)}))  # fmt: skip
    kept_night = Path(keep_checkpoint(config, str(night)))
    assert [link.name for link in chain_of(kept_night)] == ["run-a-step-5", "run-a-step-10", "run-a-step-15",
                                                             "run-b-step-3"]  # fmt: skip
    (lineage / "old-step-1").mkdir()  # a checkpoint no version needs

    client = tracking_client(config.tracking_uri)  # a new store from the migrated template
    client.create_registered_model(config.tracking.registered_model)
    version = client.create_model_version(config.tracking.registered_model, source=str(tmp_path / "model"),
                                          tags={TAG_CHECKPOINT: str(kept_night)}).version  # fmt: skip
    client.set_registered_model_alias(config.tracking.registered_model, CHAMPION_ALIAS, version)
    removed = prune_lineage(config, client)
    assert removed == [str(lineage / "old-step-1")]
    assert chain_of(kept_night)[-1] == kept_night
