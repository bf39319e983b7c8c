"""Parse and validate blocks of raw Criteo lines into typed Arrow tables.

Every line ends up in exactly one of two tables: the typed rows, or the quarantine (source,
line number, reason, raw bytes). Line structure (field count, non-ASCII bytes) is checked
vectorised over the byte buffer; field syntax with Arrow compute kernels; only the rare bad
lines are touched one at a time, to word their reason.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ingestion.schema import (
    DENSE_COLUMNS,
    MULTI_HOT_SEPARATOR,
    NUM_FIELDS,
    QUARANTINE_SCHEMA,
    RAW_COLUMNS,
    SPARSE_COLUMNS,
    warehouse_schema,
)

_INTEGER = r"^-?[0-9]{1,18}$"
_HEX8 = r"^[0-9a-fA-F]{8}$"
_HEX8_LIST = rf"^[0-9a-fA-F]{{8}}({MULTI_HOT_SEPARATOR}[0-9a-fA-F]{{8}})*$"
_ID_CHARS = 8 + len(MULTI_HOT_SEPARATOR)  # one id and its separator

def _hex_tables() -> tuple[np.ndarray, np.ndarray]:
    """Byte → is a hex digit; two ASCII hex digits (as a little-endian uint16) → their byte."""
    digit_value = {c: int(chr(c), 16) for c in b"0123456789abcdefABCDEF"}
    is_hex = np.zeros(256, dtype=bool)
    is_hex[list(digit_value)] = True
    pair_value = np.zeros(1 << 16, dtype=np.uint8)
    for hi, hi_value in digit_value.items():
        for lo, lo_value in digit_value.items():
            pair_value[hi | (lo << 8)] = (hi_value << 4) | lo_value
    return is_hex, pair_value


_IS_HEX, _HEX_PAIR_VALUE = _hex_tables()


@dataclass
class ParsedBlock:
    rows: pa.Table  # WAREHOUSE_SCHEMA
    quarantine: pa.Table  # QUARANTINE_SCHEMA
    lines: int


def parse_block(block: bytes, first_line: int, source: str, multi_hot: tuple[str, ...] = ()) -> ParsedBlock:
    """Parse whole lines (`block` ends with a newline); `first_line` is 1-based.

    `multi_hot`: the features whose field is a comma-separated list of ids.
    """
    schema = warehouse_schema(multi_hot)
    buf = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)
    starts = np.concatenate(([0], ends[:-1] + 1))
    content_ends = ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))  # drop \r
    tabs = _count_per_line(np.flatnonzero(buf == 9), starts, content_ends)
    high = _count_per_line(np.flatnonzero(buf >= 128), starts, content_ends)
    good_shape = (tabs == NUM_FIELDS - 1) & (high == 0)
    reasons: dict[int, str] = {}
    for i in np.flatnonzero(~good_shape):
        if high[i]:
            reasons[int(i)] = "undecodable bytes: not ASCII text"
        else:
            reasons[int(i)] = f"wrong field count: {int(tabs[i]) + 1} fields, expected {NUM_FIELDS}"
    good = np.flatnonzero(good_shape)
    fields = _read_fields(buf, starts[good], content_ends[good])
    valid, field_reasons = _validate_fields(fields, frozenset(multi_hot))
    for local in np.flatnonzero(~valid):
        reasons[int(good[local])] = field_reasons(int(local))
    rows = _to_warehouse(fields.filter(pa.array(valid)), schema) if len(good) else schema.empty_table()
    quarantine = _quarantine_table(block, starts, ends, reasons, first_line, source)
    return ParsedBlock(rows=rows, quarantine=quarantine, lines=len(ends))


def _count_per_line(positions: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How many of the sorted byte `positions` fall in each line [start, end)."""
    return np.searchsorted(positions, ends) - np.searchsorted(positions, starts)


def _read_fields(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> pa.Table:
    """The well-shaped lines as 40 string columns (empty fields become nulls)."""
    if len(starts) == 0:
        return pa.table({name: pa.array([], pa.string()) for name in RAW_COLUMNS})
    if len(starts) == np.count_nonzero(buf == 10) and np.all(ends > starts):
        text = buf.tobytes()  # the common case: every line is good, parse the block as is
    else:
        keep = np.zeros(len(buf) + 1, dtype=np.int8)
        np.add.at(keep, starts, 1)
        np.add.at(keep, ends + 1, -1)
        text = buf[np.cumsum(keep[:-1]) > 0].tobytes()
    return pacsv.read_csv(
        io.BytesIO(text),
        read_options=pacsv.ReadOptions(column_names=list(RAW_COLUMNS), block_size=1 << 24),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False),
        convert_options=pacsv.ConvertOptions(
            column_types={name: pa.string() for name in RAW_COLUMNS},
            strings_can_be_null=True,
            null_values=[""],
        ),
    )


def _validate_fields(fields: pa.Table, multi_hot: frozenset[str] = frozenset()):
    """A validity mask per row, and a function that words the first problem of a bad row."""
    checks: list[tuple[str, pa.Array]] = []
    label = fields["label"]
    checks.append(("label", pc.fill_null(pc.is_in(label, pa.array(["0", "1"])), False)))
    for name in (*DENSE_COLUMNS, *SPARSE_COLUMNS):
        column = fields[name]
        if name in multi_hot:
            if _id_list_column_is_clean(column):
                continue
            pattern = _HEX8_LIST
        elif _column_is_clean(column, hex_column=name in SPARSE_COLUMNS):
            continue  # the common case: no per-row check needed
        else:
            pattern = _HEX8 if name in SPARSE_COLUMNS else _INTEGER
        ok = pc.match_substring_regex(column, pattern)
        checks.append((name, pc.or_kleene(pc.is_null(column), ok)))
    valid = np.ones(fields.num_rows, dtype=bool)
    for _name, ok in checks:
        valid &= ok.to_numpy(zero_copy_only=False)

    def reason(row: int) -> str:
        for name, ok in checks:
            if not ok[row].as_py():
                value = fields[name][row].as_py()
                if name == "label":
                    return f"label: {value!r} is not 0 or 1"
                if name in multi_hot:
                    kind = f"a '{MULTI_HOT_SEPARATOR}'-separated list of 8-hex-character ids"
                else:
                    kind = "an integer" if name.startswith("I") else "8 hex characters"
                return f"{name}: {value!r} is not {kind}"
        return "invalid row"

    return valid, reason


def _column_is_clean(column: pa.ChunkedArray, hex_column: bool) -> bool:
    """True when every non-null value is valid, decided without a per-row regex."""
    if column.null_count == len(column):
        return True
    if not hex_column:
        # A whole-column cast succeeds only if every value is an integer; an exponent or
        # decimal point makes it fail and sends the column to the per-row check.
        try:
            pc.cast(column, pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return False
        return True
    lengths = pc.min_max(pc.utf8_length(column))
    if lengths["min"].as_py() != 8 or lengths["max"].as_py() != 8:
        return False
    return all(bool(_IS_HEX[_string_bytes(chunk)].all()) for chunk in column.chunks)


def _id_list_column_is_clean(column: pa.ChunkedArray) -> bool:
    """True when every non-null value is ids of 8 hex digits joined by the separator: every
    9th character is the separator and every other one a hex digit (no per-row regex)."""
    if column.null_count == len(column):
        return True
    separator = ord(MULTI_HOT_SEPARATOR)
    for chunk in column.chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32)[chunk.offset : chunk.offset + len(chunk) + 1]
        lengths = np.diff(offsets)
        present = lengths[chunk.is_valid().to_numpy(zero_copy_only=False)] if chunk.null_count else lengths
        if np.any(present % _ID_CHARS != 8):
            return False
        text = _string_bytes(chunk)
        # position of each character inside its own value
        position = np.arange(len(text)) - np.repeat(offsets[:-1] - offsets[0], lengths)
        at_separator = position % _ID_CHARS == 8
        if not (np.all(text[at_separator] == separator) and _IS_HEX[text[~at_separator]].all()):
            return False
    return True


def _string_bytes(array: pa.Array) -> np.ndarray:
    """The character bytes of a string array's values (nulls contribute none)."""
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[array.offset : array.offset + len(array) + 1]
    return np.frombuffer(array.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]


def _to_warehouse(fields: pa.Table, schema: pa.Schema) -> pa.Table:
    columns = [pc.cast(fields["label"], pa.int8())]
    columns += [pc.cast(fields[name], pa.int64()) for name in DENSE_COLUMNS]
    columns += [
        _hex_list_to_uint32(fields[name]) if pa.types.is_list(schema.field(name).type) else _hex_to_uint32(fields[name])
        for name in SPARSE_COLUMNS
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _hex_list_to_uint32(column: pa.ChunkedArray) -> pa.Array:
    """Validated separator-joined 8-hex-digit ids → list<uint32>; an empty field is null."""
    parts = pc.split_pattern(column, MULTI_HOT_SEPARATOR).combine_chunks()
    if len(parts) == 0:
        return pa.array([], pa.list_(pa.uint32()))
    ids = _hex_to_uint32(pa.chunked_array([parts.flatten()], pa.string()))
    offsets = np.frombuffer(parts.buffers()[1], dtype=np.int32)[parts.offset : parts.offset + len(parts) + 1]
    offsets = pa.array(offsets - offsets[0], pa.int32())
    return pa.ListArray.from_arrays(offsets, ids, mask=parts.is_null())


def _hex_to_uint32(column: pa.ChunkedArray) -> pa.Array:
    """Validated 8-hex-digit strings → uint32, nulls kept; vectorised over the text buffer."""
    filled = pc.fill_null(column, "00000000").combine_chunks()
    text = np.ascontiguousarray(_string_bytes(filled))  # [rows * 8] ASCII hex digits
    big_endian = _HEX_PAIR_VALUE[text.view(np.uint16)]  # [rows * 4] bytes, most significant first
    values = big_endian.view(">u4").astype(np.uint32)
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    return pa.array(values, type=pa.uint32(), mask=nulls if nulls.any() else None)


def _quarantine_table(
    block: bytes, starts: np.ndarray, ends: np.ndarray, reasons: dict[int, str], first_line: int, source: str
) -> pa.Table:
    if not reasons:
        return QUARANTINE_SCHEMA.empty_table()
    index = sorted(reasons)
    return pa.Table.from_arrays(
        [
            pa.array([source] * len(index), pa.string()),
            pa.array([first_line + i for i in index], pa.int64()),
            pa.array([reasons[i] for i in index], pa.string()),
            pa.array([block[starts[i] : ends[i]] for i in index], pa.binary()),
        ],
        schema=QUARANTINE_SCHEMA,
    )
