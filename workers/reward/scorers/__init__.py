"""Rule-based scorers: pure functions of (response text, ground truth); no I/O, no state."""

from workers.reward.scorers.gsm8k import gsm8k_extract, gsm8k_score
from workers.reward.scorers.math import math_extract, math_score

__all__ = ["gsm8k_extract", "gsm8k_score", "math_extract", "math_score"]
