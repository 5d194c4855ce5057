"""The brief number formatting used in the reasons of core decisions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.core._text import fmt_s


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0"),
        (0.8, "0.8"),
        (0.123456, "0.123"),
        (1.0, "1"),
        (27.96, "28"),
        (99.94, "99.9"),
        (99.96, "100"),
        (100.0, "100"),
        (100.4, "100"),
        (999.6, "1000"),
        (12345.6, "12346"),
        (-0.25, "-0.25"),
        (-1234.4, "-1234"),
    ],
)
def test_fmt_s_keeps_three_significant_digits_then_whole_seconds(seconds: float, text: str) -> None:
    assert fmt_s(seconds) == text


@given(st.floats(100.0, 1e12) | st.floats(-1e12, -100.0))
def test_fmt_s_never_uses_exponent_notation_from_100_s(seconds: float) -> None:
    text = fmt_s(seconds)
    assert "e" not in text and "." not in text
    assert int(text) == round(seconds)
