"""docs/configuration.md is written from the config classes (flows/run/config_reference.py):
it is never stale, every key is documented beside its field, and each key is listed once."""

import re
from pathlib import Path

import pytest

from flows.run import config_reference
from flows.run.config_reference import PAGE, ROOT, SECTIONS, TEMPLATE, keys_of, render, toml_value, undocumented


def test_the_page_is_what_the_config_classes_write():
    assert PAGE.read_text() == render(TEMPLATE.read_text()), (
        "docs/configuration.md is stale: run `make docs`"
    )
    assert config_reference.main(["--check"]) == 0


def test_every_key_has_its_meaning_beside_its_field_and_is_listed_once():
    assert undocumented() == [], "a config field without a docstring beside it"
    listed = re.findall(r"^\| `(\w+)` \| `", PAGE.read_text(), flags=re.MULTILINE)
    for section in SECTIONS:
        for key in keys_of(section):
            assert key.name in listed, f"[{section}] {key.name} is not in docs/configuration.md"
    page = PAGE.read_text()
    tuning_part = page[page.index("## `[tuning]`") : page.index("## Cluster files")]
    in_tuning = re.findall(r"^\| `(\w+)` \| `", tuning_part, flags=re.MULTILINE)
    assert sorted(in_tuning) == sorted(key.name for key in keys_of("tuning")), "its two tables split its keys, none twice"


def test_a_default_is_written_as_toml_writes_it_and_the_held_form_is_not_shown():
    assert [toml_value(v) for v in (True, "a\"b", (1, 2), 1e-8, 0.25, {})] == ["true", '"a\\"b"', "[1, 2]", "1e-8", "0.25", "{}"]
    day_format = next(key for key in keys_of("data") if key.name == "day_format")
    assert day_format.default == '"auto"', "what a config writes, not the integer form it is held in"


def test_a_range_placeholder_naming_no_key_is_an_error(tmp_path: Path):
    with pytest.raises(ValueError, match="no such key"):
        render("{{keys tuning embedding_lr..no_such_key}}\n")
    assert render("{{keys data.synthetic seed..seed}}\n").startswith("| `seed` |")


def test_the_readmes_short_table_names_only_keys_that_exist():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| section | what it sets | keys most users set |") :].split("\n\n")[0]
    keys = {key.name for section in SECTIONS for key in keys_of(section)}
    named = [name for line in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", line.rsplit("|", 2)[-2])]
    assert len(named) > 15 and set(named) <= keys, sorted(set(named) - keys)
