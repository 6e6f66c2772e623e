"""What every tokenline dashboard is made of: its variables and links, rows of time-series
panels, each declared as a `PanelSpec` of PromQL `Query`s, built with grafana-foundation-sdk."""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.builders import timeseries
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dash_models

from tokenline.monitoring import promql
from tokenline.monitoring.promql import by, mean, quantile, selector, summed_rate

DATASOURCE = dash_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "tokenline"
QUANTILES = (0.5, 0.9, 0.99)

# Every stage exports this gauge, so its label values list every namespace, service and pod.
VARIABLE_SOURCE_METRIC = "tokenline_live_uids"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    stacked: bool = False
    width: int = 12
    # Draw a red threshold line at this value (for counts that must stay at zero).
    red_above: float | None = None


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .min(0)
        .span(spec.width)
        .height(8)
        .fill_opacity(25 if spec.stacked else 10)
        .show_points(common_models.VisibilityMode.NEVER)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common_models.LegendDisplayMode.LIST)
            .placement(common_models.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common_models.TooltipDisplayMode.MULTI)
            .sort(common_models.SortOrder.DESCENDING)
        )
    )
    if spec.stacked:
        panel = panel.stacking(
            common_builders.StackingConfig().mode(common_models.StackingMode.NORMAL)
        )
    if spec.red_above is not None:
        panel = panel.thresholds(
            dash.ThresholdsConfig()
            .mode(dash_models.ThresholdsMode.ABSOLUTE)
            .steps(
                [
                    dash_models.Threshold(value=None, color="green"),
                    dash_models.Threshold(value=spec.red_above, color="red"),
                ]
            )
        ).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(
                common_models.GraphTresholdsStyleMode.LINE
            )
        )
    for ref, query in zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", spec.queries, strict=False):
        panel = panel.with_target(
            prom.Dataquery()
            .ref_id(ref)
            .datasource(DATASOURCE)
            .expr(query.expr)
            .legend_format(query.legend)
            .range()
        )
    return panel


def _filter_variable(label: str, title: str, narrower_than: tuple[str, ...]) -> dash.QueryVariable:
    """A multi-value filter on ``label``, its choices narrowed by the filters before it."""
    matchers = ", ".join(f'{other}=~"${other}"' for other in narrower_than)
    series = f"{VARIABLE_SOURCE_METRIC}{{{matchers}}}" if matchers else VARIABLE_SOURCE_METRIC
    query = f"label_values({series}, {label})"
    return (
        dash.QueryVariable(label)
        .label(title)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(dash_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_models.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(promql.ALL_VALUE)
        .current(dash_models.VariableOption(selected=True, text="All", value="$__all"))
    )


def dashboard(uid: str, title: str, description: str) -> dash.Dashboard:
    builder = (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .editable()
        .timezone("browser")
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(dash_models.DashboardCursorSync.CROSSHAIR)
        .link(
            dash.DashboardLink("tokenline")
            .type(dash_models.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(
            dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
    )
    titles = {
        promql.NAMESPACE: "Namespace",
        promql.INFERENCESERVICE: "InferenceService",
        promql.POD: "Pod",
    }
    for i, label in enumerate(promql.FILTERS):
        builder = builder.with_variable(_filter_variable(label, titles[label], promql.FILTERS[:i]))
    return builder


def with_rows(builder: dash.Dashboard, rows: list[tuple[str, list[PanelSpec]]]) -> dash.Dashboard:
    panel_id = 1
    for row_title, specs in rows:
        builder = builder.with_row(dash.Row(row_title).id(panel_id))
        panel_id += 1
        for spec in specs:
            builder = builder.with_panel(_panel(spec, panel_id))
            panel_id += 1
    return builder


def legend(*labels: str) -> str:
    """A legend that names each series by its values of ``labels``: ``{{stage}} {{buffer}}``."""
    return " ".join(f"{{{{{label}}}}}" for label in labels)


def rate_by(counter: str, *labels: str) -> tuple[Query, ...]:
    """One series per value of ``labels``: the counter's summed rate, named by them."""
    return (Query(summed_rate(counter, labels), legend(*labels)),)


def sum_by(gauge: str, *labels: str) -> tuple[Query, ...]:
    """One series per value of ``labels``: the gauge summed, named by them."""
    return (Query(f"sum {by(*labels)} ({gauge}{selector()})", legend(*labels)),)


def mean_by(histogram: str, label: str) -> tuple[Query, ...]:
    """One series per value of ``label``: the histogram's mean observation, named by it."""
    return (Query(mean(histogram, (label,)), legend(label)),)


def percentiles(histogram: str, group: str) -> tuple[Query, ...]:
    return tuple(
        Query(quantile(q, histogram, (group,)), f"{legend(group)} p{round(q * 100)}")
        for q in QUANTILES
    )


def latency_panel(title: str, histogram: str, description: str) -> PanelSpec:
    return PanelSpec(title, description, "s", percentiles(histogram, "model"), width=12)
