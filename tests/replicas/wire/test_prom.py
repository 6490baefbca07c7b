"""Prometheus text: the parser against ``prometheus_client``'s (table, round trips, mutated and
arbitrary pages), the histogram (PromQL quantiles, deltas, bucket rules), and exposition."""

from __future__ import annotations

import math
import re
from itertools import accumulate

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry, Histogram as ClientHistogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families

from tidal.replicas.wire.prom import (
    Histogram,
    LabelledHistogram,
    PromParseError,
    Sample,
    _parse_canonical,
    histogram_family,
    parse_samples,
    sum_histograms,
)

# -- the reference: prometheus_client's parser, flattened ------------------------------------------


def _key(name: str, labels: dict[str, str], value: float) -> tuple[str, tuple[tuple[str, str], ...], str]:
    return (name, tuple(sorted(labels.items())), repr(float(value) + 0.0))  # NaN equals NaN; -0.0 is 0.0


def _reference(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], str]] | None:
    """The samples prometheus_client reads, or None when it refuses the page."""
    try:
        return [_key(*s[:3]) for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, IndexError):  # IndexError: e.g. "# HELP \u2028"
        return None


def _ours(
    text: str, names: set[str] | None = None
) -> list[tuple[str, tuple[tuple[str, str], ...], str]] | None:
    try:
        return [_key(*s[:3]) for s in parse_samples(text, names)]
    except PromParseError:
        return None


def _render(*families: Metric) -> str:
    class _Fixed:
        def collect(self) -> list[Metric]:
            return list(families)

    registry = CollectorRegistry()
    registry.register(_Fixed())
    return generate_latest(registry).decode()


# -- parsing: the table --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x 1\n", [Sample("x", {}, 1.0)]),
        ('x{a="1",b="two"} 2.5\n', [Sample("x", {"a": "1", "b": "two"}, 2.5)]),
        # Escapes: \" \\ \n; a value may hold , } { = and spaces.
        (
            'x{a="q\\"uote,d",b="back\\\\slash",c="new\\nline",d="} {a=\\"1\\"}"} 7\n',
            [Sample("x", {"a": 'q"uote,d', "b": "back\\slash", "c": "new\nline", "d": '} {a="1"}'}, 7.0)],
        ),
        ('x{a="tab\\t"} 1\n', [Sample("x", {"a": "tab\\t"}, 1.0)]),  # not an escape: kept as written
        ("x +Inf\ny -Inf\n", [Sample("x", {}, math.inf), Sample("y", {}, -math.inf)]),
        ("x 1e+09\ny -0.5\nz 17\n", [Sample("x", {}, 1e9), Sample("y", {}, -0.5), Sample("z", {}, 17.0)]),
        ("y 3 1700000000\n", [Sample("y", {}, 3.0)]),  # the timestamp is dropped
        # Counters: typed under the _total name, typed under the bare name, untyped.
        ("# TYPE c_total counter\nc_total 3\n", [Sample("c_total", {}, 3.0)]),
        ("# TYPE c counter\nc 3\n", [Sample("c_total", {}, 3.0)]),
        ("c_total 3\nd 4\n", [Sample("c_total", {}, 3.0), Sample("d", {}, 4.0)]),
        # _created series are samples of the page (the snapshot ignores them).
        (
            "# HELP c_total Help.\n# TYPE c_total counter\nc_total 3.0\n"
            "# HELP c_created Help.\n# TYPE c_created gauge\nc_created 1.7e+09\n",
            [Sample("c_total", {}, 3.0), Sample("c_created", {}, 1.7e9)],
        ),
        (
            '# TYPE h histogram\nh_bucket{le="0.1"} 1.0\nh_bucket{le="+Inf"} 3.0\nh_count 3.0\nh_sum 0.7\n',
            [
                Sample("h_bucket", {"le": "0.1"}, 1.0),
                Sample("h_bucket", {"le": "+Inf"}, 3.0),
                Sample("h_count", {}, 3.0),
                Sample("h_sum", {}, 0.7),
            ],
        ),
        # Not the canonical layout, but valid: the reference parser reads these.
        ('x{a="1",} 2\n', [Sample("x", {"a": "1"}, 2.0)]),
        ("x\t2\n", [Sample("x", {}, 2.0)]),
        ('x{ a = "1" } 2\n', [Sample("x", {"a": "1"}, 2.0)]),
        ("#  TYPE  c  counter\nc 3\n", [Sample("c_total", {}, 3.0)]),
        ("\n\n# a comment\n   x 1   \r\n", [Sample("x", {}, 1.0)]),
        ("", []),
    ],
)
def test_reads_samples_like_prometheus_client(text: str, expected: list[Sample]) -> None:
    got = list(parse_samples(text))
    assert [_key(*s) for s in got] == [_key(*s) for s in expected]
    assert _ours(text) == _reference(text)


def test_nan_is_a_value() -> None:
    [s] = parse_samples("x NaN\n")
    assert math.isnan(s.value)


@pytest.mark.parametrize(
    "text",
    [
        "not a metric line\n",
        'x{a="1"\n',
        "x{a=1} 2\n",
        "x 1_000\n",
        "x\n",
        'x{a="1",a="2"} 3\n',  # a label twice
        'x{__name__="y"} 1\n',  # the name twice
        "# TYPE x\n",
        "# TYPE x bogus\nx 1\n",
        "# HELP \u2028\xa0\r6\n",  # the reference parser fails with an IndexError
        'x 1\nnot a metric line\ny{a="2"} 3\n',  # refused whole, not read as a shorter page
    ],
)
def test_a_malformed_page_is_refused_whole(text: str) -> None:
    with pytest.raises(PromParseError):
        parse_samples(text)
    assert issubclass(PromParseError, ValueError)  # what the scraper already catches
    assert _reference(text) is None


# -- parsing: properties -------------------------------------------------------------------------

_metric_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
_label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: not n.startswith("__") and n not in ("le", "quantile")
)
_label_values = st.text(max_size=12)
_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**20), 10**20).map(float))


@st.composite
def _families(draw: st.DrawFn) -> list[Metric]:
    out: list[Metric] = []
    for _ in range(draw(st.integers(0, 5))):
        name = draw(_metric_names)
        doc = draw(st.text(max_size=20))
        names = draw(st.lists(_label_names, max_size=3, unique=True))
        rows = draw(st.lists(st.lists(_label_values, min_size=len(names), max_size=len(names)), max_size=3))
        kind = draw(st.sampled_from(["gauge", "counter", "histogram", "summary", "info"]))
        created = draw(st.none() | st.floats(0, 2e9))
        family: Metric
        if kind == "gauge":
            family = GaugeMetricFamily(name, doc, labels=names)
            for row in rows:
                family.add_metric(row, draw(_values))
        elif kind == "counter":
            family = CounterMetricFamily(name, doc, labels=names)
            for row in rows:
                family.add_metric(row, draw(_values), created=created)
        elif kind == "summary":
            family = SummaryMetricFamily(name, doc, labels=names)
            for row in rows:
                family.add_metric(row, draw(st.integers(0, 10**6)), draw(_values))
        elif kind == "info":
            family = InfoMetricFamily(name, doc, labels=names)
            for row in rows:
                family.add_metric(row, draw(st.dictionaries(_label_names, _label_values, max_size=2)))
        else:
            bounds = sorted(set(draw(st.lists(st.floats(0, 1e6), min_size=1, max_size=5))))
            family = HistogramMetricFamily(name, doc, labels=names)
            for row in rows:
                n = len(bounds) + 1
                cum = list(accumulate(draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))))
                les = [*(repr(b) for b in bounds), "+Inf"]
                family.add_metric(row, list(zip(les, map(float, cum), strict=True)), draw(st.floats(0, 1e6)))
        out.append(family)
    return out


@settings(max_examples=300, deadline=None)
@given(_families())
def test_any_page_prometheus_client_writes_reads_back(families: list[Metric]) -> None:
    text = _render(*families)
    written = sorted(_key(s.name, s.labels, s.value) for f in families for s in f.samples)
    fast = _parse_canonical(text)
    assert fast is not None, "generate_latest's layout is the canonical one"
    assert sorted(_key(*s) for s in fast) == written
    assert _ours(text) == _reference(text)


_DANGER = ' \t\n{}",=\\#_+-.eEInfNa01x:'
_TOKENS = [
    "HELP",
    "TYPE",
    "__",
    "le",
    "counter",
    "gauge",
    "histogram",
    "_total",
    "# ",
    "\r",
    "\x85",
    "\u2028",
]


def _garbled(text: str, data: st.DataObject, least: int) -> str:
    """``text`` with ``least`` to ``least + 3`` cuts and insertions of dangerous characters."""
    for _ in range(data.draw(st.integers(least, least + 3))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 3))
        insert = data.draw(st.text(alphabet=_DANGER, max_size=3) | st.sampled_from(_TOKENS))
        text = text[:at] + insert + text[at + cut :]
    return text


@settings(max_examples=400, deadline=None)
@given(_families(), st.data())
def test_a_garbled_page_reads_as_prometheus_client_reads_it(
    families: list[Metric], data: st.DataObject
) -> None:
    text = _garbled(_render(*families) or "x 1\n", data, 1)
    fast = _parse_canonical(text)
    if fast is not None:  # the fast path only answers what the reference answers the same way
        assert [_key(*s) for s in fast] == _reference(text)
    assert _ours(text) == _reference(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=_DANGER + "ab", max_size=60) | st.text(max_size=60))
def test_any_text_is_read_or_refused_with_a_parse_error(text: str) -> None:
    assert _ours(text) == _reference(text)  # _ours lets nothing but PromParseError through


@settings(max_examples=300, deadline=None)
@given(_families(), st.data())
def test_reading_some_names_reads_what_the_whole_page_gives_for_them(
    families: list[Metric], data: st.DataObject
) -> None:
    # Garbled or not: wherever the reference reads the page, asking for some names gives its
    # samples of those names, in order (counters renamed with _total included).
    text = _garbled(_render(*families) or "x 1\n", data, 0)
    whole = _reference(text)
    seen = sorted(
        {k[0] for k in whole or ()} | {f.name for f in families} | {f.name + "_total" for f in families}
    )
    names = set(data.draw(st.lists(st.sampled_from(seen), max_size=4))) if seen else set()
    if whole is not None:
        assert _ours(text, names) == [k for k in whole if k[0] in names]


def test_a_damaged_line_of_a_series_asked_for_refuses_the_page() -> None:
    page = '# TYPE a gauge\na 1\n# TYPE b gauge\nb{x="1"} 2\n'
    cut = page.replace('b{x="1"} 2', 'b{x="1')
    with pytest.raises(PromParseError):
        list(parse_samples(cut, {"b"}))
    assert [s.value for s in parse_samples(page, {"b"})] == [2.0]
    with pytest.raises(PromParseError):
        list(parse_samples(page.replace("a 1", "a"), {"b"}))  # a line without a value, skipped or not


def test_the_canonical_path_reads_the_simulators_page() -> None:
    from tidal.replicas.sim.engine import SimEngine

    e = SimEngine("llama-3.1-8b-h100", max_loras=2)
    e.add_request(e.make_request("r", prompt_token_ids=list(range(40)), max_tokens=4), now=0.0)
    t = 0.0
    while (out := e.begin_step(t)) is not None:
        t += out.duration
        e.end_step(out, t)
    text = e.render_metrics()
    fast = _parse_canonical(text)
    assert fast is not None and [_key(*s) for s in fast] == _reference(text)
    names = {s.name for s in fast}
    assert "vllm:prefix_cache_hits_total" in names and "vllm:prefix_cache_hits_created" in names
    assert "vllm:time_to_first_token_seconds_bucket" in names and "vllm:cache_config_info" in names


# -- the histogram -------------------------------------------------------------------------------


def test_quantile_interpolates_like_promql() -> None:
    h = Histogram.from_buckets([(0.1, 2.0), (0.5, 8.0), (math.inf, 10.0)], sum=3.0)
    assert h.count == 10.0 and h.mean == pytest.approx(0.3)
    assert h.quantile(0.2) == pytest.approx(0.1)
    assert h.quantile(0.1) == pytest.approx(0.05)  # the first bucket starts at 0
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5 - 2) / 6)
    assert h.quantile(0.99) == pytest.approx(0.5)  # falls in +Inf: the highest finite bound
    assert (h.quantile(-0.1), h.quantile(1.1)) == (-math.inf, math.inf)
    assert math.isnan(Histogram().quantile(0.5)) and math.isnan(Histogram((1.0,)).quantile(0.5))
    assert math.isnan(Histogram().mean)


def test_buckets_are_cumulative_and_le_is_inclusive() -> None:
    h = Histogram((0.1, 0.5, 1.0))
    for v in (0.1, 0.2, 0.5, 3.0):
        h.observe(v)
    h.observe(0.05, n=2)
    assert h.buckets == ((0.1, 3), (0.5, 5), (1.0, 5), (math.inf, 6))
    assert h.count == 6 and h.sum == pytest.approx(3.9)


def test_bounds_must_ascend_and_inf_is_implied() -> None:
    assert Histogram((1.0, 2.0, math.inf)).bounds == (1.0, 2.0)
    with pytest.raises(ValueError):
        Histogram((2.0, 1.0))
    with pytest.raises(ValueError):
        Histogram((1.0, 1.0))


def test_the_difference_of_snapshots_is_what_was_observed_between() -> None:
    h = Histogram((0.1, 0.5))
    h.observe(0.05)
    before = h.copy()
    h.observe(0.3)
    h.observe(0.7)
    delta = h - before
    assert delta.buckets == ((0.1, 0), (0.5, 1), (math.inf, 2)) and delta.sum == pytest.approx(1.0)
    assert before.count == 1  # a copy does not move with the original


def test_a_restarted_series_counts_from_zero() -> None:
    old = Histogram.from_buckets([(0.1, 5.0), (math.inf, 9.0)], sum=4.0)
    restarted = Histogram.from_buckets([(0.1, 1.0), (math.inf, 2.0)], sum=0.5)
    assert restarted - old == restarted
    assert restarted - Histogram() == restarted  # another layout: nothing to subtract


def test_from_buckets_keeps_counts_non_negative() -> None:
    h = Histogram.from_buckets([(math.inf, 4.0), (0.5, 3.0), (0.1, 5.0)])  # any order; 5 > 3 is garbled
    assert h.buckets == ((0.1, 5.0), (0.5, 5.0), (math.inf, 5.0))
    assert Histogram.from_buckets([(0.1, 1.0), (0.5, 2.0)]).buckets[-1] == (math.inf, 2.0)


@pytest.mark.parametrize(
    ("first", "step", "k", "w"), [(0.004, 0.0, 10, 3), (0.009, 0.0004, 50, 7), (0.3, 0.1, 40, 2)]
)
def test_arithmetic_runs_equal_single_observations(first: float, step: float, k: int, w: int) -> None:
    bulk, single = Histogram((0.01, 0.025, 0.05, 1.0, 2.5)), Histogram((0.01, 0.025, 0.05, 1.0, 2.5))
    bulk.observe_arithmetic(first, step, k, w)
    for j in range(k):
        single.observe(first + step * j, w)
    assert bulk.counts == single.counts and bulk.count == single.count
    assert math.isclose(bulk.sum, single.sum, rel_tol=1e-9)


_bounds = st.lists(st.floats(0.001, 1e4), min_size=1, max_size=8, unique=True).map(sorted)


@st.composite
def _histograms(draw: st.DrawFn, bounds: list[float] | None = None) -> Histogram:
    b = bounds if bounds is not None else draw(_bounds)
    h = Histogram(b)
    h.counts = [
        float(c) for c in draw(st.lists(st.integers(0, 1000), min_size=len(b) + 1, max_size=len(b) + 1))
    ]
    h.sum = draw(st.floats(0, 1e6))
    return h


@given(_histograms(), st.lists(st.floats(0, 1), min_size=2, max_size=10))
def test_quantile_is_monotone_and_within_the_buckets(h: Histogram, qs: list[float]) -> None:
    if h.count == 0:
        return
    estimates = [h.quantile(q) for q in sorted(qs)]
    assert estimates == sorted(estimates)
    # PromQL's first bucket starts at 0, so an estimate lies in [0, the highest finite bound].
    assert all(0.0 <= x <= h.bounds[-1] for x in estimates)


@given(st.data())
def test_differences_never_have_negative_buckets(data: st.DataObject) -> None:
    bounds = data.draw(_bounds)
    a, b = data.draw(_histograms(bounds)), data.draw(_histograms(bounds))
    assert all(c >= 0 for c in (a - b).counts)
    later = b.copy()
    extra = data.draw(st.lists(st.floats(0, 2e4), max_size=20))
    for v in extra:
        later.observe(v)
    assert (later - b).count == len(extra)


@given(st.lists(st.floats(-1e3, 2e4), max_size=40), _bounds)
def test_observe_counts_like_prometheus_client(values: list[float], bounds: list[float]) -> None:
    ours = Histogram(bounds)
    theirs = ClientHistogram("h", "H.", buckets=bounds, registry=CollectorRegistry())
    for v in values:
        ours.observe(v)
        theirs.observe(v)
    [family] = theirs.collect()
    buckets = [s.value for s in family.samples if s.name == "h_bucket"]
    assert [c for _, c in ours.buckets] == buckets
    assert ours.sum == pytest.approx(next(s.value for s in family.samples if s.name == "h_sum"))


@given(_histograms())
def test_exposed_histograms_read_back_equal(h: Histogram) -> None:
    text = _render(histogram_family("h", "H.", [({"engine": "0"}, h)], created=1.7e9))
    assert sum_histograms(parse_samples(text)) == {"h": h}
    assert Histogram.from_buckets(h.buckets, h.sum) == h


def test_series_sum_bucket_by_bucket() -> None:
    a = Histogram.from_buckets([(0.1, 1.0), (math.inf, 2.0)], sum=1.0)
    b = Histogram.from_buckets([(0.1, 3.0), (math.inf, 3.0)], sum=0.2)
    text = _render(histogram_family("h", "H.", [({"engine": "0"}, a), ({"engine": "1"}, b)]))
    [h] = sum_histograms(parse_samples(text)).values()
    assert h.buckets == ((0.1, 4.0), (math.inf, 5.0)) and h.sum == pytest.approx(1.2)
    no_inf = sum_histograms(parse_samples('h_bucket{le="1.0"} 2\nh_count 3\nh_sum 9\n'))["h"]
    assert no_inf.buckets == ((1.0, 2.0), (math.inf, 3.0))  # _count stands in for +Inf
    two = 'a_bucket{le="+Inf"} 1\nb_bucket{le="+Inf"} 2\n'
    assert list(sum_histograms(parse_samples(two), {"b", "c"})) == ["b"]


# -- exposition ----------------------------------------------------------------------------------


def test_labelled_histograms_are_exposed_like_prometheus_client_histograms() -> None:
    registry = CollectorRegistry()
    ours = LabelledHistogram("t_seconds", "Time.", ["kind"], (0.01, 1), registry)
    ours.labels("a").observe(0.5)
    ours.labels("a").observe(2.0)
    ours.labels("b").observe(0.001)
    theirs = ClientHistogram("t_seconds", "Time.", ["kind"], buckets=(0.01, 1), registry=CollectorRegistry())
    theirs.labels("a").observe(0.5)
    theirs.labels("a").observe(2.0)
    theirs.labels("b").observe(0.001)
    created = re.compile(r".*_created.*\n")
    assert generate_latest(registry).decode() == created.sub("", generate_latest(theirs).decode())
    with pytest.raises(ValueError):
        ours.labels("a", "b")


def test_an_empty_labelled_histogram_has_only_its_header() -> None:
    registry = CollectorRegistry()
    LabelledHistogram("t_seconds", "Time.", ["kind"], (0.01,), registry)
    assert generate_latest(registry).decode() == "# HELP t_seconds Time.\n# TYPE t_seconds histogram\n"
