"""Quantities written for people: byte counts in the units start-up lines and errors use."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """`1536` -> "1.5 KiB"; whole bytes below 1 KiB, GiB the largest unit."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
