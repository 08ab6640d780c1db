"""Reading the dashboard page back (tests/router/test_dashboard.py): the numbers it tags with their
``/metrics`` sample or histogram quantile, compared with a scrape; each panel's fill; a worker's
row; the page's JavaScript errors. ``page`` is a ``tests.support.chromium_cdp`` page."""

from __future__ import annotations

import json
import math


def histogram_quantile(q: float, m: dict, hist: str, labels: dict) -> float | None:
    """Prometheus' histogram_quantile over the cumulative ``hist``_bucket samples of ``labels``."""
    buckets = sorted(
        (float(dict(lab)["le"]), v)
        for (n, lab), v in m.items()
        if n == f"{hist}_bucket" and {k: x for k, x in lab if k != "le"} == labels
    )
    total = buckets[-1][1]
    if not total:
        return None
    rank, prev_edge, prev_count = q * total, 0.0, 0.0
    for edge, count in buckets:
        if count >= rank and count > prev_count:
            if math.isinf(edge):
                return prev_edge
            return prev_edge + (edge - prev_edge) * (rank - prev_count) / (count - prev_count)
        prev_edge, prev_count = edge, count
    return None


def dom_values(page) -> tuple[list, list]:
    """([(metric, labels, value)], [(hist, q, labels, value)]) of every number tagged in the page."""
    samples = page.evaluate(
        "JSON.stringify([...document.querySelectorAll('[data-metric]')]"
        ".map(e => [e.dataset.metric, e.dataset.labels, e.dataset.value]))"
    )
    quantiles = page.evaluate(
        "JSON.stringify([...document.querySelectorAll('[data-hist]')]"
        ".map(e => [e.dataset.hist, e.dataset.q, e.dataset.labels, e.dataset.value]))"
    )
    return json.loads(samples), json.loads(quantiles)


def mismatches(page, m: dict, required: set[str]) -> list[str]:
    """Tagged page numbers that differ from (or are missing in) the /metrics samples ``m``, and
    the ``required`` series the page does not show."""
    samples, quantiles = dom_values(page)
    bad = []
    for name, labels, value in samples:
        key = (name, tuple(sorted(json.loads(labels).items())))
        if key not in m:
            bad.append(f"{name}{labels}: on the page but not in /metrics")
        elif not math.isclose(float(value), m[key], rel_tol=1e-9, abs_tol=1e-9):
            bad.append(f"{name}{labels}: page {value} != /metrics {m[key]}")
    for hist, q, labels, value in quantiles:
        want = histogram_quantile(float(q), m, hist, json.loads(labels))
        got = float(value) if value else None
        if (want is None) != (got is None) or (want is not None and not math.isclose(got, want, rel_tol=1e-6)):
            bad.append(f"P{float(q) * 100:g} of {hist}{labels}: page {value} != /metrics {want}")
    missing = required - {s[0] for s in samples}
    bad += [f"{name}: not shown on the page" for name in sorted(missing)]
    return bad


def panel_fill(page) -> dict:
    """Per panel: (table rows, series paths with >= 2 points, largest value any of them plotted)."""
    return json.loads(
        page.evaluate("""JSON.stringify(Object.fromEntries([...document.querySelectorAll('.panel')]
        .map(p => { const s = [...p.querySelectorAll('path.series')].filter(e => +e.dataset.n >= 2);
                    return [p.dataset.panel, [p.querySelectorAll('tbody tr').length, s.length,
                                              Math.max(0, ...s.map(e => +e.dataset.max))]]; })))""")
    )


def worker_row(page, worker: str) -> dict:
    return page.evaluate(f"""(() => {{ const r = document.querySelector('#workers tr[data-worker="{worker}"]');
        return r && {{state: r.querySelector('.badge').textContent, cls: r.className,
                      color: getComputedStyle(r.querySelector('td')).backgroundColor,
                      reason: r.querySelector('.reason').textContent, text: r.innerText}}; }})()""")


def page_errors(page, allowed_401: bool = False) -> list[str]:
    def expected(e: str) -> bool:
        return allowed_401 and e.startswith("log (network)") and "401" in e and "/dashboard/data" in e

    return [e for e in page.errors() if not expected(e)]
