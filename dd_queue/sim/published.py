"""The paper's published goodput points that ``ddq simulate`` is compared against.

Source: Douillard et al., *Decoupled DiLoCo for Resilient Distributed Pre-training*, arXiv
2604.21428, its goodput-vs-chips results under one interruption per chip-year. The 1.2M-chip
headline (27% plain DP, 58% elastic DP, 88% Decoupled DiLoCo with M = 8) is quoted in the
paper's text; the 150k-chip (M = 16, ~99%) and 2.4M-chip (~18% plain, ~40% elastic) values are
read off its figure, so they carry about ±2 points of reading error.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PUBLISHED", "SOURCE", "PublishedPoint"]

SOURCE = "Douillard et al., arXiv 2604.21428 (goodput vs chips, 1 interruption per chip-year)"


@dataclass(frozen=True, slots=True)
class PublishedPoint:
    """One published goodput.

    Attributes:
        chips: Chips in the job.
        label: ``plain_dp``, ``elastic_dp`` or ``decoupled_M<M>`` (``RegimeResult.label``).
        goodput: The published goodput, 0–1.
        how: ``text`` (quoted) or ``figure`` (read off a plot, ±0.02).
    """

    chips: int
    label: str
    goodput: float
    how: str


PUBLISHED: tuple[PublishedPoint, ...] = (
    PublishedPoint(150_000, "decoupled_M16", 0.99, "figure"),
    PublishedPoint(1_200_000, "plain_dp", 0.27, "text"),
    PublishedPoint(1_200_000, "elastic_dp", 0.58, "text"),
    PublishedPoint(1_200_000, "decoupled_M8", 0.88, "text"),
    PublishedPoint(2_400_000, "plain_dp", 0.18, "figure"),
    PublishedPoint(2_400_000, "elastic_dp", 0.40, "figure"),
)
