"""Days as the pipeline counts them, and as warehouses name their partitions.

Inside the pipeline a day is a non-negative integer: the Criteo sources number their days
0, 1, 2, …; a warehouse partitioned by ISO dates (`ds=2026-11-24`) has its dates counted
as days since 1970-01-01, so consecutive dates are consecutive days and "the days before
N" means the same thing for both. Configs, the command line and summaries speak in the
warehouse's own partition values.
"""

from __future__ import annotations

import datetime as dt

EPOCH = dt.date(1970, 1, 1)


class DayError(ValueError):
    """A value that is neither a non-negative integer nor an ISO date."""


def parse_day(value: int | str) -> int:
    """An integer day, or an ISO date (`2026-11-24`) as days since 1970-01-01."""
    if isinstance(value, bool):
        raise DayError(f"{value!r} is not a day (an integer or an ISO date such as 2026-11-24)")
    if isinstance(value, int):
        if value < 0:
            raise DayError(f"days are non-negative integers, got {value}")
        return value
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    try:
        return (dt.date.fromisoformat(text) - EPOCH).days
    except ValueError:
        raise DayError(f"{value!r} is not a day (an integer or an ISO date such as 2026-11-24)") from None


def is_date(value: int | str) -> bool:
    return isinstance(value, str) and not value.strip().isdigit()


def day_value(day: int, dated: bool) -> int | str:
    """The partition value of `day`: the ISO date for a dated warehouse, else the integer."""
    return (EPOCH + dt.timedelta(days=day)).isoformat() if dated else day
