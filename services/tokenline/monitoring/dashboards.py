"""The Grafana dashboards, built with grafana-foundation-sdk.

*Overview* answers "is the service healthy for its clients": traffic, latency the client sees,
engine occupancy, how requests end. *Pipeline* answers "where does the time go and what does
each stage hold": per-stage latency, buffers, live and leaked uids, aborts, malformed frames.
"""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.builders import timeseries
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dash_models

from tokenline.monitoring import promql
from tokenline.monitoring.promql import mean, quantile, selector, summed_rate

DATASOURCE = dash_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "tokenline"
QUANTILES = (0.5, 0.9, 0.99)
STAGES = ("api", "tokenizer", "scheduler", "detokenizer")

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


def _dashboard(uid: str, title: str, description: str) -> dash.Dashboard:
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


def _with_rows(builder: dash.Dashboard, rows: list[tuple[str, list[PanelSpec]]]) -> dash.Dashboard:
    panel_id = 1
    for row_title, specs in rows:
        builder = builder.with_row(dash.Row(row_title).id(panel_id))
        panel_id += 1
        for spec in specs:
            builder = builder.with_panel(_panel(spec, panel_id))
            panel_id += 1
    return builder


def _percentiles(histogram: str, group: str) -> tuple[Query, ...]:
    return tuple(
        Query(quantile(q, histogram, (group,)), f"{{{{{group}}}}} p{round(q * 100)}")
        for q in QUANTILES
    )


def _latency_panel(title: str, histogram: str, description: str) -> PanelSpec:
    return PanelSpec(title, description, "s", _percentiles(histogram, "model"), width=12)


def overview() -> dash.Dashboard:
    requests = "tokenline_requests_total"
    requests_by_model = summed_rate(requests, ("model",))
    errors_by_model = summed_rate(requests, ("model",), 'finish_reason="error"')
    traffic = [
        PanelSpec(
            "Requests/s",
            "Finished requests per second, by model.",
            "reqps",
            (Query(requests_by_model, "{{model}}"),),
            width=8,
        ),
        PanelSpec(
            "Tokens/s",
            "Generated (output) and prompt tokens per second, by model.",
            "short",
            (
                Query(
                    summed_rate("tokenline_generation_tokens_total", ("model",)), "{{model}} output"
                ),
                Query(summed_rate("tokenline_prompt_tokens_total", ("model",)), "{{model}} prompt"),
            ),
            width=8,
        ),
        PanelSpec(
            "Finish reasons",
            "How requests end: stop, length, abort, error.",
            "reqps",
            (Query(summed_rate(requests, ("finish_reason",)), "{{finish_reason}}"),),
            stacked=True,
            width=8,
        ),
    ]
    latency = [
        _latency_panel(
            "Time to first token",
            "tokenline_time_to_first_token_seconds",
            "From request arrival at the api to the first output token, p50 / p90 / p99.",
        ),
        _latency_panel(
            "Inter-token latency",
            "tokenline_inter_token_latency_seconds",
            "Time between consecutive output tokens of one request, p50 / p90 / p99.",
        ),
        _latency_panel(
            "End-to-end latency",
            "tokenline_e2e_request_latency_seconds",
            "From request arrival to its terminal reply, p50 / p90 / p99.",
        ),
        _latency_panel(
            "Queue time",
            "tokenline_request_queue_time_seconds",
            "Time a request waits in the scheduler before its first step, p50 / p90 / p99.",
        ),
    ]
    paused = ('stage="scheduler"', 'buffer="paused"')
    engine = [
        PanelSpec(
            "Running / waiting / paused",
            "Requests in the decode batch, waiting for admission, and paused because their "
            "client is not reading.",
            "short",
            (
                Query(
                    f"sum by (model) (tokenline_num_requests_running{selector()})",
                    "{{model}} running",
                ),
                Query(
                    f"sum by (model) (tokenline_num_requests_waiting{selector()})",
                    "{{model}} waiting",
                ),
                Query(
                    f"sum(tokenline_buffer_depth{selector(*paused)})",
                    "paused",
                ),
            ),
            width=8,
        ),
        PanelSpec(
            "KV cache usage",
            "Fraction of KV cache blocks referenced by requests, per scheduler pod (cached "
            "blocks no request holds count as free).",
            "percentunit",
            (
                Query(
                    f"max by (model, pod) (tokenline_kv_cache_usage_ratio{selector()})",
                    "{{pod}} {{model}}",
                ),
            ),
            width=8,
        ),
        PanelSpec(
            "Prefix cache hit rate",
            "Share of prompt tokens found in the prefix cache (computed by an earlier "
            "request), by model: hits / queries over the rate window. No data while no "
            "prompt arrives.",
            "percentunit",
            (
                Query(
                    f"{summed_rate('tokenline_prefix_cache_hits_total', ('model',))} / "
                    f"{summed_rate('tokenline_prefix_cache_queries_total', ('model',))}",
                    "{{model}}",
                ),
            ),
            width=8,
        ),
    ]
    errors = [
        PanelSpec(
            "Error ratio",
            "Share of finished requests that ended with finish_reason error, by model.",
            "percentunit",
            # "or ... * 0": a model with traffic but no error series shows 0, not "no data".
            (
                Query(
                    f"({errors_by_model} or {requests_by_model} * 0) / {requests_by_model}",
                    "{{model}}",
                ),
            ),
        ),
        PanelSpec(
            "Errors by code",
            "Requests per second that ended in an error, by error code.",
            "reqps",
            (Query(summed_rate("tokenline_request_errors_total", ("code",)), "{{code}}"),),
            stacked=True,
        ),
    ]
    builder = _dashboard(
        "tokenline-overview",
        "tokenline / Overview",
        "Traffic, client-visible latency, engine occupancy and how requests end.",
    )
    return _with_rows(
        builder,
        [("Traffic", traffic), ("Latency", latency), ("Engine", engine), ("Errors", errors)],
    )


def pipeline() -> dash.Dashboard:
    stage_latency = "tokenline_stage_latency_seconds"
    where_time_goes = [
        PanelSpec(
            "Time in stage p50 / p90 / p99",
            "Time a request spends inside each stage.",
            "s",
            _percentiles(stage_latency, "stage"),
        ),
        PanelSpec(
            "Mean time in stage (stacked)",
            "Mean time per request in each stage, stacked: the stack's height is the mean "
            "end-to-end time the stages account for.",
            "s",
            (Query(mean(stage_latency, ("stage",)), "{{stage}}"),),
            stacked=True,
        ),
    ]
    stage_targets = f'{promql.CONTAINER}=~"{"|".join(STAGES)}"'
    held = [
        PanelSpec(
            "Buffer depth",
            "Items held in each stage's queues and buffers (api: reply items held for clients; "
            "scheduler: waiting, running, paused; every stage: inbox).",
            "short",
            (
                Query(
                    f"sum by (stage, buffer) (tokenline_buffer_depth{selector()})",
                    "{{stage}} {{buffer}}",
                ),
            ),
            width=8,
        ),
        PanelSpec(
            "Live uids",
            "Requests each stage currently holds state for.",
            "short",
            (Query(f"sum by (stage) (tokenline_live_uids{selector()})", "{{stage}}"),),
            width=8,
        ),
        PanelSpec(
            "Leaked uids",
            "Uids held past their terminal event or past deadline plus grace. Must stay 0.",
            "short",
            (Query(f"sum by (stage) (tokenline_leaked_uids{selector()})", "{{stage}}"),),
            width=8,
            red_above=1,
        ),
        PanelSpec(
            "Cache entries",
            "Entries in each bounded cache and history (grammars, tombstones, prefix blocks, "
            "...). Each has a limit: a line that climbs without levelling off is a leak.",
            "short",
            (
                Query(
                    f"sum by (stage, cache) (tokenline_cache_entries{selector()})",
                    "{{stage}} {{cache}}",
                ),
            ),
            width=12,
        ),
        PanelSpec(
            "Resident memory",
            "Each stage's resident set size. Flat under steady traffic once warm; growth "
            "that follows request count rather than load is a leak.",
            "bytes",
            (
                Query(
                    f"sum by (container) (process_resident_memory_bytes{selector(stage_targets)})",
                    "{{container}}",
                ),
            ),
            width=12,
        ),
    ]
    failures = [
        PanelSpec(
            "Aborts by reason",
            "Aborts started by the api, per second: client_disconnect, deadline, slow_client, "
            "stage_failure, shutdown.",
            "short",
            (Query(summed_rate("tokenline_aborts_total", ("reason",)), "{{reason}}"),),
            stacked=True,
            width=8,
        ),
        PanelSpec(
            "Malformed frames",
            "Frames per second that failed to decode and were dropped, by stage.",
            "short",
            (Query(summed_rate("tokenline_malformed_frames_total", ("stage",)), "{{stage}}"),),
            width=8,
        ),
        PanelSpec(
            "Stage targets up",
            "1 when Prometheus scrapes the stage's /metrics, 0 when it cannot.",
            "short",
            (
                Query(
                    f"up{selector(stage_targets)}",
                    "{{pod}} {{container}}",
                ),
            ),
            width=8,
        ),
    ]
    builder = _dashboard(
        "tokenline-pipeline",
        "tokenline / Pipeline",
        "Per-stage latency, what each stage holds, and how requests fail between stages.",
    )
    return _with_rows(
        builder,
        [("Where time goes", where_time_goes), ("What stages hold", held), ("Failures", failures)],
    )


DASHBOARDS = {"tokenline-overview": overview, "tokenline-pipeline": pipeline}
