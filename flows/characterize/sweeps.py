"""`--sweep KEY=V1,V2,…`: the config keys a characterization varies, parsed before anything
heavy loads (a malformed sweep is one line at once)."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.run.config import ConfigError, PipelineConfig, build_config

BATCH_KEY = "training.batch_size"


@dataclass(frozen=True)
class Sweep:
    key: str
    values: tuple[str, ...]  # TOML values, as `--set` takes them


def parse_sweep(text: str) -> Sweep:
    """`KEY=V1,V2,…` (commas inside brackets or quotes belong to a value: `model.bottom_mlp=[64,16],[128,16]`)."""
    key, equals, values = text.partition("=")
    parts = _split_top_level(values)
    if not equals or not key.strip() or not parts or any(not part for part in parts):
        raise ConfigError(f"--sweep {text!r}: expected KEY=V1,V2,… "
                          "(e.g. --sweep sharding.compute_kernel=fused,fused_uvm_caching)")
    return Sweep(key.strip(), tuple(parts))


def _split_top_level(text: str) -> list[str]:
    parts, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += char
    parts.append(current.strip())
    return parts


@dataclass(frozen=True)
class Series:
    """One setting of the swept keys other than the batch, and its config."""

    values: dict[str, str]
    config: PipelineConfig

    @property
    def label(self) -> str:
        return ", ".join(f"{key.split('.')[-1]}={value}" for key, value in self.values.items()) or "as configured"


def series_of(raw: dict[str, Any], overrides: list[str], sweeps: list[Sweep], path: Path) -> list[Series]:
    """Every combination of the non-batch sweeps' values, each a validated config."""
    axes = [sweep for sweep in sweeps if sweep.key != BATCH_KEY]
    result = []
    for combination in itertools.product(*(sweep.values for sweep in axes)):
        values = {sweep.key: value for sweep, value in zip(axes, combination, strict=True)}
        config = build_config(copy.deepcopy(raw), [*overrides, *(f"{k}={v}" for k, v in values.items())], path)
        result.append(Series(values, config))
    return result
