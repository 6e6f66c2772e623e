"""The Grafana dashboards, one module each, built with grafana-foundation-sdk: *Overview* (is the
service healthy for its clients) and *Pipeline* (where the time goes, what each stage holds);
`panels` holds what they are made of."""

from tokenline.monitoring.dashboards.overview import overview
from tokenline.monitoring.dashboards.pipeline import pipeline

DASHBOARDS = {"tokenline-overview": overview, "tokenline-pipeline": pipeline}

__all__ = ["DASHBOARDS", "overview", "pipeline"]
