"""Duration predictor: how long will a job run, learned from the jobs that came before it.

Used for backfill reservations and ordering only, never for killing: a prediction that turns
out short makes a reservation start later than planned (recomputed every pass), while the hard
bound (``max_runtime_s``) is the only thing the agent enforces.

The history is kept per key at several levels of detail; a prediction comes from the most
specific level with at least ``min_samples`` finished runs:

  1. (team, user, job name, GPU count)
  2. (team, user, job name)
  3. (team, user, GPU count)
  4. (team, GPU count)
  5. (team,)

The estimate is the ``quantile`` (default 0.8) of the last ``window`` durations at that level,
so most jobs end before it (a backfill reservation built on it is rarely late). Confidence is
in [0, 1]: the share of the window filled, scaled down for the coarser levels. This is the
history-based estimate of QSSF (Hu et al., "Characterization and Prediction of Deep Learning
Workloads in Large-Scale GPU Datacenters", SC 2021) and of Slurm users' habit of predicting
from their own past jobs, kept deliberately simple: quantiles need no model fitting and are
robust to the heavy tails of training-job durations.

Measured (``benchmarks/predictor_error.py``, Philly Oct-Nov 2017 replayed in time order with
only the runs finished before each submit known; median absolute log error, 0.69 = off by 2x):
the median at the chosen level (``quantiles().p50_s``) 0.39, the 0.8 quantile ``predict``
returns 0.54, the VC's ("user's") median 0.81, the global median 1.48. ``quantiles().p90_s``
covers 83% of runs (the history seen at submit under-represents long runs still going).

Pure: no I/O, no clock; the caller observes durations as runs finish (the simulator on each
attempt end, the live store from finished attempts).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["DurationPredictor", "JobKey", "Prediction", "Quantiles", "Spread"]

LEVELS: tuple[tuple[str, float], ...] = (
    ("team+user+name+gpus", 1.0),
    ("team+user+name", 0.8),
    ("team+user+gpus", 0.6),
    ("team+gpus", 0.4),
    ("team", 0.25),
)
"""Level name and its confidence factor, most specific first."""


@dataclass(frozen=True, slots=True)
class JobKey:
    """What a prediction is keyed on. ``user`` and ``name`` may be empty (traces without
    users, jobs without names): the levels that use them then collapse onto coarser ones."""

    team_id: str
    gpu_count: int
    user: str = ""
    name: str = ""

    def levels(self) -> tuple[tuple[object, ...], ...]:
        t, u, n, g = self.team_id, self.user, self.name, self.gpu_count
        return ((0, t, u, n, g), (1, t, u, n), (2, t, u, g), (3, t, g), (4, t))


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted duration.

    Attributes:
        seconds: predicted run time, seconds (float > 0).
        confidence: in [0, 1]; 0 never occurs (no prediction is returned instead).
        samples: finished runs behind it.
        basis: the history level used (a name from ``LEVELS``).
    """

    seconds: float
    confidence: float
    samples: int
    basis: str


@dataclass(frozen=True, slots=True)
class Spread:
    """A range of likely durations (what a start estimate is built on).

    Attributes:
        low_s / high_s: the ``low`` and ``high`` quantiles of the durations at the level
            used, seconds (0 < low_s <= high_s).
        samples: finished runs behind it.
        basis: the history level used (a name from ``LEVELS``).
    """

    low_s: float
    high_s: float
    samples: int
    basis: str


@dataclass(frozen=True, slots=True)
class Quantiles:
    """Quantile predictions of a run time (what ordering and start estimates build on).

    Attributes:
        p50_s: the median of the durations at the level used, seconds (the point estimate
            with the smallest median absolute log error on Philly: 0.39 against 0.54 for the
            ``quantile`` 0.8 that ``predict`` returns; ``benchmarks/predictor_error.py``).
        p90_s: the 0.9 quantile there, seconds (>= ``p50_s``).
        samples: finished runs behind them.
        basis: the history level used (a name from ``LEVELS``).
    """

    p50_s: float
    p90_s: float
    samples: int
    basis: str


def _quantile(s: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``s`` (nearest rank, as ``predict``)."""
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


class DurationPredictor:
    """Per-key rolling quantile of finished-run durations.

    Args:
        quantile: in (0, 1]; 0.8 means 80% of past runs at the chosen level ended earlier.
        window: durations kept per key (the most recent ones), int >= 1.
        min_samples: a level needs this many durations before it predicts, int >= 1.
    Raises ValueError on out-of-range arguments.
    """

    def __init__(self, quantile: float = 0.8, window: int = 64, min_samples: int = 3) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], not {quantile}")
        if window < 1 or min_samples < 1 or min_samples > window:
            raise ValueError("need 1 <= min_samples <= window")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self._hist: dict[tuple[object, ...], deque[float]] = {}
        self._cache: dict[tuple[object, ...], float] = {}

    def observe(self, key: JobKey, duration_s: float) -> None:
        """Record one finished run of ``duration_s`` seconds (ignored unless finite, > 0)."""
        if not (duration_s > 0.0 and math.isfinite(duration_s)):
            return
        for k in key.levels():
            h = self._hist.get(k)
            if h is None:
                h = self._hist[k] = deque(maxlen=self.window)
            h.append(duration_s)
            self._cache.pop(k, None)

    def predict(self, key: JobKey) -> Prediction | None:
        """The prediction for a job with ``key``, or None when no level has enough history."""
        for k, (basis, factor) in zip(key.levels(), LEVELS, strict=True):
            h = self._hist.get(k)
            if h is None or len(h) < self.min_samples:
                continue
            q = self._cache.get(k)
            if q is None:
                s = sorted(h)
                q = self._cache[k] = s[min(len(s) - 1, math.ceil(self.quantile * len(s)) - 1)]
            confidence = factor * len(h) / self.window
            return Prediction(q, confidence, len(h), basis)
        return None

    def quantiles(self, key: JobKey) -> Quantiles | None:
        """The p50 and p90 of past durations at the level ``predict`` uses, or None without
        enough history (sorts the level's window, <= ``window`` values, per call)."""
        for k, (basis, _) in zip(key.levels(), LEVELS, strict=True):
            h = self._hist.get(k)
            if h is None or len(h) < self.min_samples:
                continue
            s = sorted(h)
            return Quantiles(_quantile(s, 0.5), _quantile(s, 0.9), len(h), basis)
        return None

    def spread(self, key: JobKey, low: float = 0.1, high: float = 0.9) -> Spread | None:
        """The ``low``..``high`` quantiles (0 < low <= high <= 1) of past durations at the
        most specific level with ``min_samples`` runs (the level ``predict`` uses), or None
        without enough history. Sorts the level's window (<= ``window`` values) per call:
        callers that ask often memoize per key (``store.predictions``)."""
        for k, (basis, _) in zip(key.levels(), LEVELS, strict=True):
            h = self._hist.get(k)
            if h is None or len(h) < self.min_samples:
                continue
            s = sorted(h)
            return Spread(_quantile(s, low), _quantile(s, high), len(h), basis)
        return None
