"""The load generator's pure parts: SSE decoding, percentiles, workload, round order."""

from __future__ import annotations

import random

import pytest

from tokenline.loadgen.config import TargetConfig, normalize_base_url
from tokenline.loadgen.load import round_order
from tokenline.loadgen.report import Dist, percentile, ratio
from tokenline.loadgen.sse import SSEDecoder, read_chunk
from tokenline.loadgen.workload import LengthDist, build_workload, poisson_arrivals


def feed_all(lines: list[str]) -> list[str]:
    decoder = SSEDecoder()
    events = [data for line in lines if (data := decoder.feed(line)) is not None]
    if (tail := decoder.flush()) is not None:
        events.append(tail)
    return events


def test_sse_decoder_dispatches_on_blank_line_and_joins_multiline_data() -> None:
    lines = [": keep-alive", 'data: {"a":', "data:1}", "", "event: x", "id: 7", "data: [DONE]", ""]
    assert feed_all(lines) == ['{"a":\n1}', "[DONE]"]


def test_sse_decoder_strips_crlf_and_delivers_an_unterminated_last_event() -> None:
    assert feed_all(["data: one\r", "\r", "data:  two"]) == ["one", " two"]


def test_read_chunk_reads_text_usage_and_errors() -> None:
    completion = read_chunk(
        '{"choices":[{"index":0,"text":"hi","finish_reason":null}]}', "completions"
    )
    assert completion.text == "hi" and completion.completion_tokens is None
    chat = read_chunk('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', "chat")
    assert chat.text == ""
    usage = read_chunk('{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}', "chat")
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, 9)
    assert read_chunk('{"error":{"message":"boom"}}', "chat").error == "boom"
    with pytest.raises(ValueError):
        read_chunk("not json", "chat")


def test_percentile_matches_numpy_linear_interpolation() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for size in (1, 2, 5, 100, 1001):
        values = [rng.expovariate(10) for _ in range(size)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(
                float(np.percentile(values, q)), abs=1e-12
            )


def test_percentiles_of_known_values() -> None:
    dist = Dist.of([float(v) for v in range(1, 101)])  # 1..100
    assert dist is not None
    assert (dist.mean, dist.p50, dist.p90, dist.p99) == pytest.approx((50.5, 50.5, 90.1, 99.01))
    assert Dist.of([]) is None
    assert ratio(1.0, 0.0) is None and ratio(3.0, 2.0) == 1.5


def test_length_dist_parses_fixed_and_uniform() -> None:
    assert LengthDist.parse("64") == LengthDist(64, 64)
    assert LengthDist.parse("8:16") == LengthDist(8, 16)
    for bad in ("0", "9:3", "x", "1:2:3"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)
    rng = random.Random(0)
    draws = {LengthDist(8, 10).sample(rng) for _ in range(200)}
    assert draws == {8, 9, 10}


def test_workload_is_reproducible_and_prompts_have_the_asked_word_count() -> None:
    a = build_workload(20, LengthDist(5, 50), LengthDist(1, 64), seed=7)
    b = build_workload(20, LengthDist(5, 50), LengthDist(1, 64), seed=7)
    assert a == b
    assert all(len(spec.prompt.split()) == spec.prompt_words for spec in a)
    assert len({spec.prompt for spec in a}) == 20


def test_poisson_arrivals_have_the_asked_mean_rate() -> None:
    arrivals = poisson_arrivals(20000, rate=50.0, seed=1)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] / (len(arrivals) - 1) == pytest.approx(1 / 50, rel=0.03)


def test_rounds_alternate_target_order() -> None:
    a, b = TargetConfig("a", "http://a"), TargetConfig("b", "http://b")
    order = [t.label for r in range(4) for t in round_order([a, b], r)]
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_base_urls_with_or_without_v1_are_one_server() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert normalize_base_url(url) == "http://h:8000"
