"""The documentation keeps up with the code: every key a config file takes is named in
docs/configuration.md (by its last part, in a `code` span), so a new setting cannot ship
undocumented; and the README stays a short guide that links the references."""

from __future__ import annotations

import re
from pathlib import Path

from flows.run.config import PipelineConfig, config_as_dict, flatten

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
README_MAX_LINES = 300


def names_in_code_spans(markdown: str) -> set[str]:
    """Identifiers inside the inline `code` spans of `markdown`, fenced blocks left out
    (an example config there is not a description of its keys)."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return {name for span in spans for name in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", span)}


def test_every_config_key_is_named_in_the_configuration_reference() -> None:
    named = names_in_code_spans(CONFIGURATION.read_text())
    keys = flatten(config_as_dict(PipelineConfig()))
    assert len(keys) > 50, "the walk over the config found its keys"
    missing = sorted(key for key in keys if key.rsplit(".", 1)[-1] not in named)
    assert not missing, f"config keys docs/configuration.md never names: {missing}"


def test_every_config_section_has_a_heading_in_the_configuration_reference() -> None:
    headings = set(re.findall(r"^#+ `\[([a-z_.]+)\]`", CONFIGURATION.read_text(), flags=re.MULTILINE))
    sections = {key.rsplit(".", 1)[0] for key in flatten(config_as_dict(PipelineConfig())) if "." in key}
    missing = sorted(sections - headings)
    assert not missing, f"config sections without a heading in docs/configuration.md: {missing}"


def test_the_readme_is_a_short_guide_that_links_the_references() -> None:
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES}"
    for reference in ("docs/configuration.md", "docs/performance.md"):
        assert f"]({reference})" in text, f"README.md does not link {reference}"
        assert (ROOT / reference).is_file(), f"{reference} is linked but missing"


def test_the_check_sees_a_key_only_in_a_code_span() -> None:
    text = "Set `training.seed` here.\n\n```toml\n[training]\nepochs = 2\n```\nand epochs in prose.\n"
    names = names_in_code_spans(text)
    assert {"training", "seed"} <= names
    assert "epochs" not in names
