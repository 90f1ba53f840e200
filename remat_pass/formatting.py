"""Bytes as text and text as bytes, and the tables every report prints.

One place for units: sizes are read with ``parse_bytes`` (binary and decimal units),
fractions with ``parse_fraction``, and printed with ``fmt_bytes`` / ``mib``; tables are
fixed-width text (``text_table``) or GitHub Markdown (``markdown_table``); node names
sort naturally (``natural_key``: ``_softmax_2`` before ``_softmax_10``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

MIB = 2**20

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 2**20, "mb": 10**6, "mib": 2**20,
    "g": 2**30, "gb": 10**9, "gib": 2**30,
    "t": 2**40, "tb": 10**12, "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """A size such as ``2GiB``, ``512 MiB``, ``1.5GB``, ``300000`` as an int of bytes.

    Binary units (KiB, MiB, GiB, TiB; K, M, G, T alone) are powers of 1024; decimal
    units (KB, MB, GB, TB) powers of 1000; case is ignored.

    Raises:
        ValueError: not a non-negative finite number followed by one of those units, or
            not a str / int (a float such as ``nan`` is refused: give an int or a string).

    Example:
        >>> parse_bytes("2GiB"), parse_bytes("1.5 MB"), parse_bytes("4096")
        (2147483648, 1500000, 4096)
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(
            f"size {text!r} ({type(text).__name__}) is not a number of bytes: give an int, or a "
            "string such as '2GiB', '512MiB', '1.5GB'"
        )
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size {text} is negative; a size is 0 or more bytes")
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"size {text!r} is not a number of bytes with an optional unit: use e.g. 2GiB, "
            "512MiB, 1.5GB or 300000 (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    return int(round(float(m.group(1)) * _UNITS[unit]))


def parse_fraction(text: str | float) -> float:
    """``5%`` or ``0.05`` as 0.05: a percentage carries ``%``; a bare number is a fraction
    and must be below 1 (``5`` is refused: it would be +500 %, where ``5%`` was meant).

    Raises:
        ValueError: not a non-negative finite number, with or without ``%``; or a bare
            number of 1 or more.

    Example:
        >>> parse_fraction("5%"), parse_fraction(0.25)
        (0.05, 0.25)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, percent = float(text), False
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(%?)\s*", str(text))
        if not m:
            raise ValueError(f"fraction {text!r} is not a number: use e.g. 5% or 0.05")
        value = float(m.group(1)) / (100 if m.group(2) else 1)
        percent = bool(m.group(2))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"fraction {text!r} is negative or not finite; use e.g. 5% or 0.05")
    if not percent and value >= 1:
        raise ValueError(f"fraction {text!r} is ambiguous: write a percentage with % ({text}% = "
                         f"{value / 100:g}) or a fraction below 1 (0.05 = 5%)")
    return value


def fmt_bytes(nbytes: int | None) -> str:
    """``512 B``, ``16.0 KiB``, ``4.00 MiB``, ``1.25 GiB`` (binary units); "" for None.

    Example:
        >>> fmt_bytes(512), fmt_bytes(16384), fmt_bytes(3 * 2**29)
        ('512 B', '16.0 KiB', '1.50 GiB')
    """
    if nbytes is None:
        return ""
    n = abs(nbytes)
    if n < 1024:
        return f"{nbytes} B"
    if n < MIB:
        return f"{nbytes / 1024:.1f} KiB"
    if n < 2**30:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


def fmt_flops(flops: int | float) -> str:
    """FLOPs in decimal units: ``512 FLOP``, ``1.50 GFLOP``, ``180.32 TFLOP``, ``1.20 PFLOP``.

    Example:
        >>> fmt_flops(512), fmt_flops(1.5e9), fmt_flops(180319906955264)
        ('512 FLOP', '1.50 GFLOP', '180.32 TFLOP')
    """
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f} FLOP"


def mib(nbytes: float) -> str:
    """Bytes as MiB with 2 decimals, no unit: ``mib(3 * 2**20) == '3.00'``."""
    return f"{nbytes / MIB:.2f}"


def signed_bytes(nbytes: int) -> str:
    """``+1.00 MiB`` / ``-512 B``."""
    return ("+" if nbytes >= 0 else "-") + fmt_bytes(abs(nbytes))


def natural_key(name: str) -> list[Any]:
    """Sort key that orders digit runs by value: ``_softmax_2`` before ``_softmax_10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A fixed-width text table.

    Args:
        header: the column titles.
        rows: the cells (anything with a ``str``).
        align: one character per column, ``l`` (left) or ``r`` (right); default: the
            first column left, the others right.
    """
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    align = align or "l" + "r" * (len(widths) - 1)

    def line(cells: Sequence[Any]) -> str:
        return "  ".join(
            (str(c).ljust(w) if a == "l" else str(c).rjust(w)) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
