"""The metric registry of evaluation.metrics: Metric (function, direction, unit, aggregation),
METRICS (name -> Metric, in registration order), register_metric, get_metric, list_metrics,
result_metrics and AGGREGATIONS. Part of evaluation.metrics, whose face registers
the metrics and exports every name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


# --------------------------------------------------------------------------- registry


AGGREGATIONS = ("median", "share", "mean")
"""How a metric's per-request values become one summary value: ``median`` (robust to the
few outlier requests of a small benchmark), ``share`` (mean of 0/1 flags: the share of
correct answers), ``mean``."""


@dataclass(frozen=True)
class Metric:
    """One registered metric: its compute function, direction and aggregation together.

    Attributes:
        name: registry name.
        fn: the scoring function.
        higher_is_better: True when a larger value means better quality.
        unit: human-readable unit of the value ("fraction 0-1", "nats", "%", ...).
        aggregation: one of :data:`AGGREGATIONS`; how summaries combine requests.
        column: key of the value in a run record's ``quality`` object (None: the metric
            is not written to results.json, e.g. raw perplexity).
        summary: key of the aggregated value in a summary row (default: ``column``).
        inputs: names of the arguments ``fn`` takes, from what a request provides:
            ``prediction`` (output text), ``answer`` (gold answer), ``answers`` (all
            accepted answers), ``reference`` (the lossless run's output text),
            ``tokens`` / ``tokens_ref`` (output / lossless output token ids). Empty for
            metrics computed by a separate pass (perplexity, KL).
        task: True for a task metric (scored only when the prompt names it as its metric).
    """

    name: str
    fn: Callable[..., Any]
    higher_is_better: bool
    unit: str
    aggregation: str = "median"
    column: str | None = None
    summary: str | None = None
    inputs: tuple[str, ...] = ()
    task: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def summary_key(self) -> str | None:
        """Key of the aggregated value in summaries (None when not in results.json)."""
        return self.summary or self.column


METRICS: dict[str, Metric] = {}
"""Registry: metric name -> :class:`Metric`. Filled by :func:`register_metric` at import."""


class UnknownMetricError(KeyError, ValueError):
    """Raised by :func:`get_metric` for a name that is not registered.

    Subclasses both KeyError (a failed lookup) and ValueError (bad user input), so
    callers that catch either see it. ``str(err)`` lists the available names and the
    closest match.
    """

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


def register_metric(name: str, *, higher_is_better: bool, unit: str, aggregation: str = "median",
                    column: str | None = None, summary: str | None = None,
                    inputs: tuple[str, ...] = (), task: bool = False) -> Callable:
    """Decorator registering ``fn`` in :data:`METRICS` under ``name`` (see :class:`Metric`).

    Raises:
        ValueError: ``name`` already registered, or an unknown ``aggregation``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")

    def decorator(fn: Callable) -> Callable:
        if name in METRICS:
            raise ValueError(f"metric {name!r} is already registered")
        METRICS[name] = Metric(name=name, fn=fn, higher_is_better=higher_is_better, unit=unit,
                               aggregation=aggregation, column=column, summary=summary,
                               inputs=tuple(inputs), task=task)
        return fn

    return decorator


def result_metrics() -> list[Metric]:
    """The registered metrics written to results.json (``column`` set), in registry order."""
    return [m for m in METRICS.values() if m.column is not None]


def list_metrics() -> list[str]:
    """Sorted names of the registered metrics."""
    return sorted(METRICS)


def get_metric(name: str) -> Metric:
    """Look up a registered metric by name.

    Raises:
        UnknownMetricError: with the list of available names and the closest match
            (difflib), e.g. ``unknown metric 'rougel'; did you mean 'rouge_l'? available: ...``.
    """
    try:
        return METRICS[name]
    except (KeyError, TypeError):
        pass
    close = difflib.get_close_matches(str(name), list(METRICS), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownMetricError(
        f"unknown metric {name!r}{hint} available: {', '.join(list_metrics())}"
    )
