"""Small formatting helpers shared by the reasons that core decisions return."""

from __future__ import annotations


def fmt_s(seconds: float) -> str:
    """Format seconds briefly: 3 significant digits, whole seconds from 100 s."""
    if abs(seconds) >= 100:
        return f"{seconds:.0f}"
    return f"{seconds:.3g}"
