"""The README documents what a user can set: every key a config file takes is named there
(by its last part, in a `code` span), so a new setting cannot ship undocumented."""

from __future__ import annotations

import re
from pathlib import Path

from flows.config import PipelineConfig, config_as_dict, flatten

ROOT = Path(__file__).resolve().parents[3]


def names_in_code_spans(markdown: str) -> set[str]:
    """Identifiers inside the inline `code` spans of `markdown`, fenced blocks left out
    (an example config there is not a description of its keys)."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return {name for span in spans for name in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", span)}


def test_every_config_key_is_named_in_the_readme() -> None:
    named = names_in_code_spans((ROOT / "README.md").read_text())
    keys = flatten(config_as_dict(PipelineConfig()))
    assert len(keys) > 50, "the walk over the config found its keys"
    missing = sorted(key for key in keys if key.rsplit(".", 1)[-1] not in named)
    assert not missing, f"config keys the README never names: {missing}"


def test_the_check_sees_a_key_only_in_a_code_span() -> None:
    text = "Set `training.seed` here.\n\n```toml\n[training]\nepochs = 2\n```\nand epochs in prose.\n"
    names = names_in_code_spans(text)
    assert {"training", "seed"} <= names
    assert "epochs" not in names
