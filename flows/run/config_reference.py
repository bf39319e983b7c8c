"""docs/configuration.md, written from the config classes: each key's meaning is the string
beside its field (an attribute docstring), its default is the field's own, so both are
written once. The page's prose lives in docs/configuration.in.md, where a line
`{{keys SECTION}}` stands for the rows of that section's keys (`{{keys SECTION FIRST..LAST}}`:
those fields only, in the order they are declared; the plain form takes the rest).

    .venv/bin/python -m flows.run.config_reference          # rewrite docs/configuration.md
    .venv/bin/python -m flows.run.config_reference --check  # exit 1 when it is stale

tests/unit/flows/test_config_reference.py fails when the page is stale or a key is undocumented.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from evaluation.config import EvaluationConfig
from flows.run.config import OrchestrationConfig, PipelineConfig, SlurmJobConfig, TrackingConfig
from ingestion.config import DataConfig, ManagedIdsConfig, PreprocessConfig, SyntheticConfig
from training.config import (
    ClusterConfig,
    CpuConfig,
    DeclaredTables,
    ModelConfig,
    ShardingConfig,
    TableSharding,
    TrainingConfig,
)
from training.tuning.config import TuningConfig

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "docs" / "configuration.in.md"
PAGE = ROOT / "docs" / "configuration.md"
# The TOML section of each config class ("": the top level; "cluster": a cluster file)
SECTIONS: dict[str, type] = {
    "": PipelineConfig,
    "data": DataConfig,
    "data.synthetic": SyntheticConfig,
    "preprocess": PreprocessConfig,
    "preprocess.managed": ManagedIdsConfig,
    "model": ModelConfig,
    "model.declared_tables": DeclaredTables,
    "sharding": ShardingConfig,
    "sharding.tables.<table>": TableSharding,
    "training": TrainingConfig,
    "training.cpu": CpuConfig,
    "evaluation": EvaluationConfig,
    "tracking": TrackingConfig,
    "orchestration": OrchestrationConfig,
    "orchestration.slurm": SlurmJobConfig,
    "tuning": TuningConfig,
    "cluster": ClusterConfig,
}
# Keys whose TOML default is decided when the config is read (`normalised`), not held as is
TOML_DEFAULTS = {("data", "day_format"): '"auto"'}
PLACEHOLDER = re.compile(r"^\{\{keys (?P<section>\S*?)(?: (?P<first>\w+)\.\.(?P<last>\w+))?\}\}$")


@dataclasses.dataclass(frozen=True)
class Key:
    name: str
    default: str  # as TOML writes it
    doc: str  # "" when the field has none


def keys_of(section: str) -> list[Key]:
    """The TOML keys of a section: its class's fields, less those that are sections of their own."""
    cls = SECTIONS[section]
    docs = field_docs(cls)
    sections = set(SECTIONS.values())
    keys = []
    for field in dataclasses.fields(cls):
        default = _default(field)
        if type(default) in sections or (isinstance(default, dict) and field.name == "tables"):
            continue  # a section ([data.synthetic], [sharding.tables.<table>]) with a table of its own
        shown = TOML_DEFAULTS.get((section, field.name)) or toml_value(default)
        keys.append(Key(field.name, shown, docs.get(field.name, "")))
    return keys


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string right after it), its lines joined."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def toml_value(value: Any) -> str:
    """A default as a config writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{name} = {toml_value(item)}" for name, item in value.items()) + "}"
    if value is None:
        return "(none)"
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m[1] == '-' else ''}{m[2]}", repr(value))  # 1e-08 → 1e-8
    return repr(value)


def rows(section: str, first: str | None, last: str | None, taken: set[str]) -> list[str]:
    """The table rows of a placeholder: `first..last` of the section's keys, or those no
    other placeholder of the section took."""
    keys = keys_of(section)
    names = [key.name for key in keys]
    if first is not None:
        if first not in names or last not in names:
            raise ValueError(f"{{{{keys {section} {first}..{last}}}}}: no such key in [{section}]")
        chosen = keys[names.index(first) : names.index(last) + 1]
    else:
        chosen = [key for key in keys if f"{section}.{key.name}" not in taken]
    return [f"| `{key.name}` | `{key.default}` | {key.doc} |" for key in chosen]


def render(template: str) -> str:
    """The page: the template with each placeholder replaced by its rows."""
    lines = template.splitlines()
    ranged: set[str] = set()  # `section.key` of the keys a FIRST..LAST placeholder lists
    for line in lines:
        if (match := PLACEHOLDER.match(line)) and match["first"]:
            picked = rows(match["section"], match["first"], match["last"], set())
            ranged.update(f"{match['section']}.{row.split('`')[1]}" for row in picked)
    out = []
    for line in lines:
        match = PLACEHOLDER.match(line)
        out.extend(rows(match["section"], match["first"], match["last"], ranged) if match else [line])
    return "\n".join(out) + "\n"


def undocumented() -> list[str]:
    """Every key whose field has no docstring, as `section.key`."""
    return [f"{section + '.' if section else ''}{key.name}" for section in SECTIONS
            for key in keys_of(section) if not key.doc]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/configuration.md from the config classes")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale, writing nothing")
    args = parser.parse_args(argv)
    page = render(TEMPLATE.read_text())
    if args.check:
        if PAGE.read_text() != page:
            print("docs/configuration.md is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
