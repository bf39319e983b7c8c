"""Parse and validate blocks of raw Criteo lines into typed Arrow tables.

Every line ends up in exactly one of two tables: the typed rows, or the quarantine (source,
line number, reason, raw bytes). Line structure (field count, non-ASCII bytes) is checked
vectorised over the byte buffer; field syntax with Arrow compute kernels; only the rare bad
lines are touched one at a time, to word their reason.
"""

from __future__ import annotations

import functools
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
    """Byte → is a hex digit; two ASCII characters (as a little-endian uint16) → the byte
    they spell, or 0x100 when either is not a hex digit."""
    digit_value = {c: int(chr(c), 16) for c in b"0123456789abcdefABCDEF"}
    is_hex = np.zeros(256, dtype=bool)
    is_hex[list(digit_value)] = True
    pair_value = np.full(1 << 16, 0x100, dtype=np.uint16)
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
    lines = _LineBounds(buf)
    reasons: dict[int, str] = {}
    fields = _fields_if_every_line_is_well_shaped(block, buf)
    if fields is None:
        good_shape = _check_line_shapes(buf, lines, reasons)
        good = np.flatnonzero(good_shape)
        fields = _read_fields(buf, lines.starts[good], lines.content_ends[good])
    else:
        good = np.arange(fields.num_rows)
    valid, field_reasons, typed = _validate_fields(fields, frozenset(multi_hot))
    for local in np.flatnonzero(~valid):
        reasons[int(good[local])] = field_reasons(int(local))
    if not len(good):
        rows = schema.empty_table()
    elif valid.all():
        rows = _to_warehouse(fields, schema, typed)
    else:
        rows = _to_warehouse(fields.filter(pa.array(valid)), schema, {})
    quarantine = _quarantine_table(block, lines, reasons, first_line, source)
    return ParsedBlock(rows=rows, quarantine=quarantine, lines=block.count(b"\n"))


class _LineBounds:
    """Where each line starts and ends in the block; found only when a line needs them."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf

    @functools.cached_property
    def ends(self) -> np.ndarray:
        return np.flatnonzero(self.buf == 10)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        return np.concatenate(([0], self.ends[:-1] + 1))

    @functools.cached_property
    def content_ends(self) -> np.ndarray:
        """Line ends without a trailing carriage return."""
        ends, starts, buf = self.ends, self.starts, self.buf
        return ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))


def _fields_if_every_line_is_well_shaped(block: bytes, buf: np.ndarray) -> pa.Table | None:
    """The common case, decided without a per-line scan: pure ASCII, no carriage return, no
    empty line, and the CSV parser (strict about the column count) accepts every line."""
    if not block or block[0] == 10 or b"\n\n" in block or b"\r" in block or buf.max() >= 128:
        return None
    try:
        return _parse_csv(block)
    except pa.ArrowInvalid:
        return None  # a line with the wrong field count: the per-line path words why


def _check_line_shapes(buf: np.ndarray, lines: _LineBounds, reasons: dict[int, str]) -> np.ndarray:
    """Which lines have the right field count and only ASCII bytes; a reason for the others."""
    starts, content_ends = lines.starts, lines.content_ends
    tabs = _count_per_line(np.flatnonzero(buf == 9), starts, content_ends)
    high = _count_per_line(np.flatnonzero(buf >= 128), starts, content_ends)
    # The CSV parser would break a line at a carriage return that does not end it.
    stray_cr = _count_per_line(np.flatnonzero(buf == 13), starts, content_ends)
    good_shape = (tabs == NUM_FIELDS - 1) & (high == 0) & (stray_cr == 0)
    for i in np.flatnonzero(~good_shape):
        if high[i]:
            reasons[int(i)] = "undecodable bytes: not ASCII text"
        elif stray_cr[i]:
            reasons[int(i)] = "carriage return inside the line"
        else:
            reasons[int(i)] = f"wrong field count: {int(tabs[i]) + 1} fields, expected {NUM_FIELDS}"
    return good_shape


def _count_per_line(positions: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How many of the sorted byte `positions` fall in each line [start, end)."""
    return np.searchsorted(positions, ends) - np.searchsorted(positions, starts)


def _read_fields(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> pa.Table:
    """The well-shaped lines as 40 string columns (empty fields become nulls)."""
    if len(starts) == 0:
        return pa.table({name: pa.array([], pa.string()) for name in RAW_COLUMNS})
    keep = np.zeros(len(buf) + 1, dtype=np.int8)
    np.add.at(keep, starts, 1)
    np.add.at(keep, ends + 1, -1)
    return _parse_csv(buf[np.cumsum(keep[:-1]) > 0].tobytes())


def _parse_csv(text: bytes) -> pa.Table:
    return pacsv.read_csv(
        pa.BufferReader(text),
        read_options=pacsv.ReadOptions(column_names=list(RAW_COLUMNS), block_size=1 << 24),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False, ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(
            column_types={name: pa.string() for name in RAW_COLUMNS},
            strings_can_be_null=True,
            null_values=[""],
        ),
    )


def _validate_fields(fields: pa.Table, multi_hot: frozenset[str] = frozenset()):
    """A validity mask per row, a function that words the first problem of a bad row, and
    the typed form of every column found clean as a whole (so it is converted only once)."""
    checks: list[tuple[str, pa.Array]] = []
    typed: dict[str, pa.Array | pa.ChunkedArray] = {}
    label = fields["label"]
    checks.append(("label", pc.fill_null(pc.is_in(label, pa.array(["0", "1"])), False)))
    for name in (*DENSE_COLUMNS, *SPARSE_COLUMNS):
        column = fields[name]
        converted = _typed_if_clean(column, name, multi_hot)
        if converted is not None:
            typed[name] = converted  # the common case: no per-row check needed
            continue
        if name in multi_hot:
            pattern = _HEX8_LIST
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

    return valid, reason, typed


def _typed_if_clean(
    column: pa.ChunkedArray, name: str, multi_hot: frozenset[str]
) -> pa.Array | pa.ChunkedArray | None:
    """The column in its warehouse type when every non-null value is valid, else None;
    decided without a per-row regex."""
    if name in multi_hot:
        return _hex_list_to_uint32(column) if _id_list_column_is_clean(column) else None
    if name in SPARSE_COLUMNS:
        return _hex_to_uint32_if_clean(column)
    # A whole-column cast succeeds only if every value is an integer; an exponent or
    # decimal point makes it fail and sends the column to the per-row check.
    try:
        return pc.cast(column, pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


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


def _to_warehouse(fields: pa.Table, schema: pa.Schema, typed: dict[str, pa.Array | pa.ChunkedArray]) -> pa.Table:
    """The validated rows in the warehouse schema; `typed` holds columns already converted."""

    def convert(name: str) -> pa.Array | pa.ChunkedArray:
        if name in typed:
            return typed[name]
        if name in DENSE_COLUMNS:
            return pc.cast(fields[name], pa.int64())
        if pa.types.is_list(schema.field(name).type):
            return _hex_list_to_uint32(fields[name])
        return _hex_to_uint32(fields[name])

    columns = [pc.cast(fields["label"], pa.int8())] + [convert(name) for name in (*DENSE_COLUMNS, *SPARSE_COLUMNS)]
    return pa.Table.from_arrays(columns, schema=schema)


def _hex_list_to_uint32(column: pa.ChunkedArray) -> pa.Array:
    """Validated separator-joined 8-hex-digit ids → list<uint32>; an empty field is null."""
    parts = pc.split_pattern(column, MULTI_HOT_SEPARATOR).combine_chunks()
    if len(parts) == 0:
        return pa.array([], pa.list_(pa.uint32()))
    ids = _hex_to_uint32(pa.chunked_array([parts.flatten()], pa.string())).combine_chunks()
    offsets = np.frombuffer(parts.buffers()[1], dtype=np.int32)[parts.offset : parts.offset + len(parts) + 1]
    offsets = pa.array(offsets - offsets[0], pa.int32())
    return pa.ListArray.from_arrays(offsets, ids, mask=parts.is_null())


def _hex_to_uint32(column: pa.ChunkedArray) -> pa.Array:
    """Validated 8-hex-digit strings → uint32, nulls kept."""
    converted = _hex_to_uint32_if_clean(column)
    assert converted is not None, "validated hex ids did not convert"
    return converted


def _hex_to_uint32_if_clean(column: pa.ChunkedArray) -> pa.ChunkedArray | None:
    """8-hex-digit strings → uint32 (nulls kept), or None if a value is anything else.

    Vectorised over the text buffer: every value 8 characters long, then each pair of
    characters looked up as one uint16 in a table that marks non-hex pairs.
    """
    chunks = []
    for chunk in column.chunks:
        present = len(chunk) - chunk.null_count
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32)[chunk.offset : chunk.offset + len(chunk) + 1]
        nulls = chunk.is_null().to_numpy(zero_copy_only=False) if chunk.null_count else None
        eight_long = np.diff(offsets) == 8
        if not (eight_long.all() if nulls is None else (eight_long | nulls).all()):
            return None
        text = np.ascontiguousarray(_string_bytes(chunk))  # [present * 8] ASCII, when clean
        pair_values = _HEX_PAIR_VALUE[text.view(np.uint16)]  # [present * 4], most significant first
        if present and pair_values.max() > 0xFF:
            return None
        values = pair_values.astype(np.uint8).view(">u4").astype(np.uint32)
        if nulls is not None:
            scattered = np.zeros(len(chunk), dtype=np.uint32)
            scattered[~nulls] = values
            values = scattered
        chunks.append(pa.array(values, type=pa.uint32(), mask=nulls))
    return pa.chunked_array(chunks, pa.uint32())


def _quarantine_table(
    block: bytes, lines: _LineBounds, reasons: dict[int, str], first_line: int, source: str
) -> pa.Table:
    if not reasons:
        return QUARANTINE_SCHEMA.empty_table()
    index = sorted(reasons)
    starts, ends = lines.starts, lines.ends
    return pa.Table.from_arrays(
        [
            pa.array([source] * len(index), pa.string()),
            pa.array([first_line + i for i in index], pa.int64()),
            pa.array([reasons[i] for i in index], pa.string()),
            pa.array([block[starts[i] : ends[i]] for i in index], pa.binary()),
        ],
        schema=QUARANTINE_SCHEMA,
    )
