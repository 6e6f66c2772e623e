"""PromQL building blocks shared by the dashboards and the alerts.

Label names are a contract with whoever scrapes tokenline. Besides the labels each metric carries
(``stage``, ``buffer``, ``model``, ...), every scrape target carries:

- ``namespace`` and ``pod``: the Kubernetes namespace and pod, as the Prometheus Operator sets
  them for a PodMonitor;
- ``inferenceservice``: the name of the ``InferenceService`` the pod belongs to, relabelled from
  the pod label ``app.kubernetes.io/instance``;
- ``container``: the container that serves the target, named after its stage.

A local ``tokenline serve`` scraped without those target labels still works with the dashboards:
their filters default to ``.*``, which also matches an absent label.
"""

from __future__ import annotations

NAMESPACE = "namespace"
INFERENCESERVICE = "inferenceservice"
POD = "pod"
CONTAINER = "container"

# Grafana template variables, one per filter label, in the order they appear on a dashboard.
FILTERS = (NAMESPACE, INFERENCESERVICE, POD)

# What a filter variable expands to when "All" is selected.
ALL_VALUE = ".*"

RATE_INTERVAL = "$__rate_interval"

# Labels that identify one deployment of one model; alerts aggregate by these.
SERVICE_LABELS = (NAMESPACE, INFERENCESERVICE)


def selector(*matchers: str) -> str:
    """The dashboard filter matchers followed by ``matchers``, as a ``{...}`` selector."""
    filters = [f'{label}=~"${label}"' for label in FILTERS]
    return "{" + ", ".join([*filters, *matchers]) + "}"


def by(*labels: str) -> str:
    return "by (" + ", ".join(labels) + ")"


def rate(metric: str, *matchers: str, window: str = RATE_INTERVAL, filtered: bool = True) -> str:
    sel = selector(*matchers) if filtered else "{" + ", ".join(matchers) + "}"
    return f"rate({metric}{sel}[{window}])"


def summed_rate(metric: str, labels: tuple[str, ...], *matchers: str, **kwargs: object) -> str:
    return f"sum {by(*labels)} ({rate(metric, *matchers, **kwargs)})"


def quantile(q: float, histogram: str, labels: tuple[str, ...], **kwargs: object) -> str:
    """``histogram_quantile`` over the rate of ``histogram``'s buckets, grouped by ``labels``."""
    buckets = summed_rate(f"{histogram}_bucket", ("le", *labels), **kwargs)
    return f"histogram_quantile({q}, {buckets})"


def mean(histogram: str, labels: tuple[str, ...], **kwargs: object) -> str:
    """Mean observation of ``histogram`` over the rate window, grouped by ``labels``."""
    total = summed_rate(f"{histogram}_sum", labels, **kwargs)
    count = summed_rate(f"{histogram}_count", labels, **kwargs)
    return f"{total} / {count}"
