import numpy as np
import pytest

from ingestion.raw_parse import parse_block

GOOD = (
    "1\t5\t-3\t\t0\t12\t\t1\t2\t3\t4\t5\t6\t7\t"
    + "\t".join(["0a1b2c3d", "FFFFFFFF", ""] + ["00000001"] * 23)
)


def _block(*lines: str | bytes) -> bytes:
    return b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines)


def test_a_real_format_row_parses_exactly() -> None:
    parsed = parse_block(_block(GOOD), first_line=1, source="s")
    assert parsed.quarantine.num_rows == 0
    row = parsed.rows.to_pylist()[0]
    assert row["label"] == 1
    assert [row[f"I{i}"] for i in range(1, 14)] == [5, -3, None, 0, 12, None, 1, 2, 3, 4, 5, 6, 7]
    assert row["C1"] == 0x0A1B2C3D
    assert row["C2"] == 0xFFFFFFFF, "uppercase hex is hex, and the full uint32 range fits"
    assert row["C3"] is None
    assert row["C26"] == 1


@pytest.mark.parametrize(
    "line, reason",
    [
        ("1\t2\t3", "wrong field count: 3 fields, expected 40"),
        (GOOD + "\textra", "wrong field count: 41 fields"),
        ("2" + GOOD[1:], "label: '2' is not 0 or 1"),
        ("\t" + GOOD[2:], "label: None is not 0 or 1"),
        (GOOD.replace("\t5\t", "\t5.5\t", 1), "I1: '5.5' is not an integer"),
        (GOOD.replace("\t5\t", "\tfive\t", 1), "I1: 'five' is not an integer"),
        (GOOD.replace("0a1b2c3d", "0a1b2c3"), "C1: '0a1b2c3' is not 8 hex characters"),
        (GOOD.replace("0a1b2c3d", "0a1b2c3g"), "C1: '0a1b2c3g' is not 8 hex characters"),
        (GOOD.replace("0a1b2c3d", "0a1b2c3d0"), "C1: '0a1b2c3d0' is not 8 hex characters"),
        ("", "wrong field count: 1 fields"),
    ],
)
def test_each_kind_of_bad_row_is_quarantined_with_its_reason(line: str, reason: str) -> None:
    parsed = parse_block(_block(GOOD, line, GOOD), first_line=10, source="day_0.gz")
    assert parsed.rows.num_rows == 2
    bad = parsed.quarantine.to_pylist()
    assert len(bad) == 1
    assert reason in bad[0]["reason"]
    assert bad[0]["line"] == 11
    assert bad[0]["source"] == "day_0.gz"
    assert bad[0]["raw"] == line.encode()


def test_undecodable_bytes_are_quarantined_raw() -> None:
    line = GOOD.encode().replace(b"0a1b2c3d", b"0a1b\xff\xfe3d")
    parsed = parse_block(_block(GOOD, line), first_line=1, source="s")
    bad = parsed.quarantine.to_pylist()
    assert [b["reason"] for b in bad] == ["undecodable bytes: not ASCII text"]
    assert bad[0]["raw"] == line


def test_counts_reconcile_on_a_mixed_block() -> None:
    lines = [GOOD, "x", GOOD, "2" + GOOD[1:], GOOD, GOOD.replace("\t5\t", "\t1e3\t", 1)] * 50
    parsed = parse_block(_block(*lines), first_line=1, source="s")
    assert parsed.lines == len(lines)
    assert parsed.rows.num_rows == 150
    assert parsed.quarantine.num_rows == 150
    assert parsed.rows.num_rows + parsed.quarantine.num_rows == parsed.lines
    assert sorted(parsed.quarantine["line"].to_pylist()) == [i + 1 for i, l in enumerate(lines) if l != GOOD]


def test_windows_line_endings_are_accepted() -> None:
    parsed = parse_block((GOOD + "\r\n" + GOOD + "\r\n").encode(), first_line=1, source="s")
    assert parsed.rows.num_rows == 2 and parsed.quarantine.num_rows == 0
    assert parsed.rows["C26"].to_pylist() == [1, 1]


def test_lengths_that_only_add_up_are_still_quarantined() -> None:
    """A 7- and a 9-character id in one column have the total length of two good ones."""
    short, long = GOOD.replace("0a1b2c3d", "0a1b2c3"), GOOD.replace("0a1b2c3d", "0a1b2c3d0")
    parsed = parse_block(_block(short, long), first_line=1, source="s")
    assert parsed.rows.num_rows == 0
    assert [r["line"] for r in parsed.quarantine.to_pylist()] == [1, 2]


def test_a_carriage_return_inside_a_line_is_quarantined() -> None:
    line = GOOD.replace("0a1b2c3d", "0a1b\r3d")
    parsed = parse_block(_block(GOOD, line, GOOD), first_line=1, source="s")
    assert parsed.lines == 3 and parsed.rows.num_rows == 2
    assert parsed.quarantine.to_pylist()[0]["reason"] == "carriage return inside the line"


def test_clean_blocks_parse_the_same_whole_and_line_by_line() -> None:
    """Clean text is parsed as one block; a carriage return sends it line by line instead.
    Both paths must give the same rows, nulls and extremes included."""
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(2_000):
        dense = ["" if rng.random() < 0.2 else str(rng.integers(-5, 10**12)) for _ in range(13)]
        ids = ["" if rng.random() < 0.2 else f"{rng.integers(0, 2**32):08x}" for _ in range(26)]
        lines.append("\t".join([str(rng.integers(0, 2)), *dense, *ids]))
    whole = parse_block(_block(*lines), first_line=1, source="s")
    by_line = parse_block(b"".join(line.encode() + b"\r\n" for line in lines), first_line=1, source="s")
    assert whole.quarantine.num_rows == by_line.quarantine.num_rows == 0
    assert whole.rows.equals(by_line.rows)
    expected_c1 = [int(line.split("\t")[14], 16) if line.split("\t")[14] else None for line in lines]
    assert whole.rows["C1"].to_pylist() == expected_c1
