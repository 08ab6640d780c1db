"use strict";
/* pdserve dashboard: polls dashboard/data every second, keeps the last ten minutes in memory and
 * draws the panels. Every number that is also a /metrics sample carries data-metric (sample name),
 * data-labels (JSON, sorted keys) and data-value (raw); percentiles carry data-hist and data-q. */
(() => {
  const { TimeChart, fmt, htmlEl } = PdChart;
  const SPAN = 600, POLL_MS = 1000, WINDOW_S = 30, RATE_S = 5, KEY = "pdserve.apiKey", MAX_EVENTS = 6;
  const POOL = { used: "#d9534f", cached: "#f0ad4e", free: "#9fd39b" };
  const QUEUES = { waiting: "#4e79a7", prefilling: "#b07aa1", bootstrap: "#9c755f", prealloc: "#f28e2b", transfer: "#76b7b2",
                   running: "#59a14f", retracted: "#e15759" };
  const LINES = ["#4e79a7", "#e15759", "#59a14f", "#b07aa1", "#f28e2b", "#76b7b2", "#9c755f", "#edc948"];

  const history = new Map();     // series key -> [[t, v], ...] (router monotonic seconds)
  const prevWorker = new Map();  // worker id -> last stats seen (for counter deltas)
  const windows = new Map();     // histogram key -> [[t, histogram], ...] for windowed percentiles
  const charts = new Map();      // chart key -> TimeChart
  const events = [];             // retract / OOM / migration events, oldest first
  const view = { span: SPAN, last: null };  // shown time span (s) and the latest snapshot
  const routerRing = [];          // router request counters over the last RATE_S seconds
  const failovers = { prev: null, events: [] };  // the router's failover counters last seen; their markers
  const FAILOVER_TEXT = {
    continued: "stream(s) continued on a live worker", limit: "stream(s) ended: --max-failovers reached",
    no_route: "stream(s) ended: no live route", unfit: "stream(s) ended: the continuation fits nowhere",
    unreachable: "stream(s) ended: the live route was unreachable" };

  // ---- history, rates, percentiles -------------------------------------------------------------
  function record(key, t, v) {
    let a = history.get(key);
    if (!a) history.set(key, (a = []));
    a.push([t, v === undefined ? null : v]);
    while (a.length && a[0][0] < t - SPAN - 5) a.shift();
  }
  const points = (key) => history.get(key) || [];

  /** Prometheus-style histogram_quantile over non-cumulative counts (last count is +Inf). */
  function quantile(q, h) {
    const total = h.counts.reduce((a, b) => a + b, 0);
    if (!total) return null;
    const rank = q * total;
    let cum = 0;
    for (let i = 0; i < h.counts.length; i++) {
      const before = cum;
      cum += h.counts[i];
      if (cum >= rank && h.counts[i] > 0) {
        if (i >= h.buckets.length) return h.buckets[h.buckets.length - 1];
        const lo = i === 0 ? 0 : h.buckets[i - 1];
        return lo + (h.buckets[i] - lo) * (rank - before) / h.counts[i];
      }
    }
    return null;
  }

  /** [P50, P99] of what `h` gained over the last WINDOW_S seconds (nulls when nothing was observed). */
  function windowQuantiles(key, t, h) {
    let a = windows.get(key);
    if (!a || a[0][1].counts.length !== h.counts.length || h.counts.some((c, i) => c < a[a.length - 1][1].counts[i])) {
      windows.set(key, (a = []));  // first sight, or the worker restarted (counts went back)
    }
    a.push([t, h]);
    while (a.length > 1 && a[1][0] <= t - WINDOW_S) a.shift();
    const base = a[0][1];
    const delta = { buckets: h.buckets, counts: h.counts.map((c, i) => c - base.counts[i]) };
    return [quantile(0.5, delta), quantile(0.99, delta)];
  }

  /** Counter deltas as per-second rates over the last RATE_S seconds of a ring of samples. */
  function windowRates(ring, t, counters) {
    const last = ring[ring.length - 1];
    const delta = last && t > last.t ? diff(counters, last.counters) : null;
    if (!last || t > last.t) ring.push({ t, counters });
    while (ring.length > 2 && ring[1].t <= t - RATE_S) ring.shift();
    const first = ring[0], rates = {};
    if (ring.length >= 2) for (const [k, d] of Object.entries(diff(counters, first.counters))) rates[k] = d / (t - first.t);
    return { rates, delta };
  }
  const diff = (a, b) => Object.fromEntries(Object.keys(a).map((k) => [k, a[k] - (b[k] || 0)]));

  /** A worker's counter rates (null when its stats are stale) and what changed since its last heartbeat. */
  function workerRates(w, heartbeat) {
    const p = prevWorker.get(w.id);
    if (w.stats_t === null) return { rates: {}, delta: null };
    if (!p || p.instance !== w.instance) {
      prevWorker.set(w.id, { instance: w.instance, gauges: w.gauges, ring: [] });  // new process: counters restart
    }
    const state = prevWorker.get(w.id), before = { gauges: state.gauges };
    const { rates, delta } = windowRates(state.ring, w.stats_t, w.counters);
    if (delta) state.gauges = w.gauges;
    const stale = w.stats_age_s === null || w.stats_age_s > 3 * heartbeat + 1;
    return { rates: stale ? {} : rates, delta, before };
  }

  function noteEvents(w, delta, before) {
    const n = delta.retractions || 0, t = w.stats_t;
    if (n > 0) {
      const recompute = w.role === "colocated" ? n : delta.retract_recomputed || 0;
      const offload = delta.retract_offloaded || 0;
      const tokens = (delta.retracted_input_tokens || 0) + (delta.retracted_output_tokens || 0);
      const r0 = before.gauges.new_token_ratio, r1 = w.gauges.new_token_ratio;
      events.push({ t, worker: w.id, cls: "retract", label: String(n),
                    text: `${w.id}: retract ${n} req (offload ${offload}, recompute ${recompute}), ` +
                          `${fmt.count(tokens)} tokens freed, new_token_ratio ${fmt.ratio(r0)} → ${fmt.ratio(r1)}` });
    }
    if ((delta.oom_aborts || 0) > 0) {
      events.push({ t, worker: w.id, cls: "oom", label: "OOM",
                    text: `${w.id}: ${delta.oom_aborts} request(s) aborted: KV pool too small even alone` });
    }
    noteMigrations(w, delta);
    while (events.length && events[0].t < t - SPAN) events.shift();
  }

  /** One marker per heartbeat in which `w` moved retracted requests (out: it was the source; in: the
   * target) or a migration failed; `n` is how many, so the markers of a worker add up to its counters. */
  function noteMigrations(w, delta) {
    const t = w.stats_t, bytes = fmt.bytes(delta.migration_bytes || 0);
    for (const [key, cls, label, what] of [
      ["migrations_out_done", "migrate out", "⇢", `migrated N retracted req to a peer decode worker (${bytes})`],
      ["migrations_in_done", "migrate in", "⇠", "took N migrated req in from a peer decode worker"],
      ["migrations_out_failed", "migrate failed", "✗", "N migration(s) out failed: resumed or recomputed here"],
      ["migrations_in_failed", "migrate failed", "✗", "N migration(s) in failed: the request was answered an error"]]) {
      const n = delta[key] || 0;
      if (n > 0) events.push({ t, worker: w.id, cls, n, label: `${label}${n}`, text: `${w.id}: ${what.replace("N", n)}` });
    }
  }

  function ingestWorker(w, t, heartbeat) {
    const g = w.gauges, id = w.id;
    for (const s of ["used", "cached", "free"]) record(`pool/${id}/${s}`, t, g[`kv_pages_${s}`]);
    for (const s of ["used", "free"]) record(`host/${id}/${s}`, t, g[`host_kv_pool_bytes_${s}`]);
    for (const q of Object.keys(g).filter((k) => k.startsWith("queue_"))) record(`queue/${id}/${q.slice(6)}`, t, g[q]);
    record(`ratio/${id}`, t, g.new_token_ratio);
    const { rates, delta, before } = workerRates(w, heartbeat);
    if (delta) noteEvents(w, delta, before);
    for (const k of ["retractions", "retract_resumed", "oom_aborts", "generation_tokens", "kv_transfer_bytes",
                     "retract_offload_bytes"]) record(`rate/${id}/${k}`, t, rates[k] ?? null);
    record(`rate/${id}/migration_bytes`, t, rates.migration_bytes ?? null);
    for (const k of PdSpec.KEYS) record(`rate/${id}/${k}`, t, rates[k] ?? null);
    for (const [prefix, name] of [["xfer", "kv_transfer_seconds"], ["mig", "migration_seconds"]]) {
      const h = w.histograms[name];
      const [p50, p99] = h ? windowQuantiles(`${prefix}/${id}`, t, h) : [null, null];
      record(`${prefix}/${id}/p50`, t, p50);
      record(`${prefix}/${id}/p99`, t, p99);
    }
    return rates.generation_tokens ?? null;
  }

  /** One marker per snapshot in which the streams of a dead worker failed over (by outcome); `n` is
   * how many, so a worker's markers add up to its pdserve_failovers_total since the page opened. */
  function noteFailovers(t, counts) {
    const prev = failovers.prev;
    failovers.prev = counts;
    if (!prev) return;  // the first snapshot is the baseline: what happened before the page opened
    for (const [worker, outcomes] of Object.entries(counts)) {
      for (const [outcome, v] of Object.entries(outcomes)) {
        const n = v - ((prev[worker] || {})[outcome] || 0);
        if (n > 0) failovers.events.push({ t, worker, cls: `failover ${outcome}`, n, label: `↻${n}`,
                                           text: `${worker} died: ${n} ${FAILOVER_TEXT[outcome] || outcome}` });
      }
    }
    while (failovers.events.length && failovers.events[0].t < t - SPAN) failovers.events.shift();
  }

  function ingestRouter(snap) {
    const r = snap.router, t = snap.t;
    noteFailovers(t, r.failovers);
    const { rates } = windowRates(routerRing, t, r.requests);
    for (const status of Object.keys(r.requests)) record(`req/${status}`, t, rates[status] ?? null);
    for (const name of ["ttft", "tpot"]) {
      const [p50, p99] = windowQuantiles(name, t, r[name]);
      record(`${name}/p50`, t, p50);
      record(`${name}/p99`, t, p99);
    }
  }

  function ingest(snap) {
    let tokens = null;
    for (const w of snap.workers) {
      const rate = ingestWorker(w, snap.t, snap.heartbeat_s);
      if (rate !== null) tokens = (tokens || 0) + rate;
    }
    record("tokens", snap.t, tokens);
    ingestRouter(snap);
    PdRoles.ingest(snap, SPAN);
  }

  // ---- rendering ---------------------------------------------------------------------------------
  const sorted = (o) => JSON.stringify(Object.fromEntries(Object.entries(o).sort()));
  const sample = (metric, labels) => ({ metric, labels: sorted(labels) });

  function chart(container, key, opts) {
    let c = charts.get(key);
    if (!c) charts.set(key, (c = new TimeChart(document.getElementById(container), opts)));
    c.opts.span = view.span;
    return c;
  }

  /** Replace the tiles of `id`: [{label, value, text?, metric?, labels?, hist?, q?}]. */
  function tiles(id, list) {
    const box = document.getElementById(id);
    box.replaceChildren();
    for (const it of list) {
      const tile = htmlEl("div", "tile", box);
      htmlEl("div", "tile-label", tile, it.label);
      const v = htmlEl("div", "tile-value", tile, it.text ?? fmt.count(it.value));
      if (it.metric) Object.assign(v.dataset, sample(it.metric, it.labels || {}));
      if (it.hist) Object.assign(v.dataset, { hist: it.hist, q: String(it.q), labels: sorted(it.labels || {}) });
      if (it.metric || it.hist) v.dataset.value = it.value === null ? "" : String(it.value);
    }
  }

  function renderWorkers(snap) {
    const body = document.querySelector("#workers tbody");
    body.replaceChildren();
    for (const w of snap.workers) {
      const tr = htmlEl("tr", `state-${w.state}`, body);
      tr.dataset.worker = w.id;
      htmlEl("td", "", tr, w.id);
      htmlEl("td", "", tr, w.role);
      const st = htmlEl("span", `badge ${w.state}`, htmlEl("td", "", tr), w.state);
      Object.assign(st.dataset, sample("pdserve_worker_up", { worker: w.id, role: w.role }), { value: w.up ? "1" : "0" });
      htmlEl("td", "", tr, w.model || "–");
      htmlEl("td", "", tr, fmt.duration(w.uptime_s) + (w.restarts ? ` (restarts: ${w.restarts})` : ""));
      htmlEl("td", "", tr, w.stats_age_s === null ? "–" : fmt.seconds(w.stats_age_s));
      htmlEl("td", "reason", tr, w.reason || "");
    }
  }

  /** The role timeline and the completed role switches (pdserve_role_switches_total{from,to,reason}). */
  function renderRoles(snap) {
    tiles("roles-tiles", snap.router.role_switches.map((c) => ({
      label: `role switches: ${c.old} → ${c.new} (${c.reason})`, value: c.count,
      metric: "pdserve_role_switches_total", labels: { from: c.old, to: c.new, reason: c.reason } })));
    PdRoles.render("roles", snap, view.span);
  }

  function renderPools(snap) {
    for (const w of snap.workers.filter((x) => "kv_pages_total" in x.gauges)) {
      const c = chart("pools", `pool/${w.id}`, { stacked: true, title: w.id });
      c.setTitle(`${w.id} (${w.role}): ${fmt.count(w.gauges.kv_pages_total)} pages × ${w.page_size} tokens`);
      c.draw(snap.t, ["used", "cached", "free"].map((s) => ({
        label: s, color: POOL[s], points: points(`pool/${w.id}/${s}`),
        attrs: sample("pdserve_kv_pool_pages", { worker: w.id, state: s }) })));
      const host = (w.gauges.host_kv_pool_bytes_used || 0) + (w.gauges.host_kv_pool_bytes_free || 0);
      if (!host) continue;
      const hc = chart("pools", `host/${w.id}`, { stacked: true, fmt: fmt.bytes, title: `${w.id} host pool (retracted KV)` });
      hc.draw(snap.t, ["used", "free"].map((s) => ({
        label: s, color: POOL[s], points: points(`host/${w.id}/${s}`),
        attrs: sample("pdserve_host_kv_pool_bytes", { worker: w.id, state: s }) })));
    }
  }

  function renderQueues(snap) {
    for (const w of snap.workers) {
      const names = Object.keys(w.gauges).filter((k) => k.startsWith("queue_")).map((k) => k.slice(6));
      if (!names.length) continue;
      chart("queues", `queue/${w.id}`, { title: `${w.id} (${w.role})` }).draw(snap.t, names.map((q, i) => ({
        label: q, color: QUEUES[q] || LINES[i % LINES.length], points: points(`queue/${w.id}/${q}`),
        attrs: sample("pdserve_queue_requests", { worker: w.id, queue: q }) })));
    }
  }

  function renderRetract(snap) {
    const list = [], workers = snap.workers.filter((w) => "new_token_ratio" in w.gauges);
    for (const w of workers) {
      const c = w.counters, lab = { worker: w.id }, mine = events.filter((e) => e.worker === w.id && !e.cls.startsWith("migrate"));
      const marks = mine.map((e) => ({ t: e.t, label: e.label, title: e.text, cls: e.cls }));
      chart("retract", `ratio/${w.id}`, { fmt: fmt.ratio, title: `${w.id}: new_token_ratio` }).draw(snap.t, [{
        label: "new_token_ratio", color: LINES[0], points: points(`ratio/${w.id}`), fmt: fmt.ratio,
        attrs: sample("pdserve_new_token_ratio", lab) }], marks);
      chart("retract", `rretract/${w.id}`, { fmt: fmt.count, title: `${w.id}: per second` }).draw(snap.t, [
        { label: "retracted/s", color: LINES[1], points: points(`rate/${w.id}/retractions`), fmt: fmt.count },
        { label: "resumed/s", color: LINES[2], points: points(`rate/${w.id}/retract_resumed`), fmt: fmt.count },
        { label: "OOM aborts/s", color: "#333", points: points(`rate/${w.id}/oom_aborts`), fmt: fmt.count }], marks);
      list.push({ label: `${w.id} retractions`, value: c.retractions ?? 0, metric: "pdserve_retractions_total", labels: lab },
                { label: "offloaded", value: w.role === "colocated" ? 0 : c.retract_offloaded ?? 0 },
                { label: "recomputed", value: w.role === "colocated" ? c.retractions ?? 0 : c.retract_recomputed ?? 0 },
                { label: "resumed", value: c.retract_resumed ?? 0, metric: "pdserve_retract_resumed_total", labels: lab },
                { label: "OOM aborts", value: c.oom_aborts ?? 0, metric: "pdserve_oom_aborts_total", labels: lab },
                { label: "tokens freed", value: (c.retracted_input_tokens ?? 0) + (c.retracted_output_tokens ?? 0) });
    }
    tiles("retract-tiles", list);
    const ol = document.getElementById("retract-events");
    ol.replaceChildren();
    const retracts = events.filter((e) => !e.cls.startsWith("migrate"));
    for (const e of retracts.slice(-MAX_EVENTS).reverse()) {
      const li = htmlEl("li", e.cls, ol, `${new Date((snap.time - (snap.t - e.t)) * 1000).toLocaleTimeString()}  ${e.text}`);
      li.dataset.worker = e.worker;
    }
    if (!retracts.length) htmlEl("li", "muted", ol, "no retractions in the last 10 minutes");
  }

  function renderTransfer(snap) {
    const rates = [], lat = [], list = [];
    snap.workers.forEach((w, i) => {
      const lab = { worker: w.id }, color = LINES[i % LINES.length];
      if (w.role === "prefill") {
        rates.push({ label: `${w.id} → decode`, color, points: points(`rate/${w.id}/kv_transfer_bytes`), fmt: fmt.byteRate });
        lat.push({ label: `${w.id} P50`, color, points: points(`xfer/${w.id}/p50`) },
                 { label: `${w.id} P99`, color: LINES[(i + 4) % LINES.length], points: points(`xfer/${w.id}/p99`) });
        const h = w.histograms.kv_transfer_seconds, n = h ? h.counts.reduce((a, b) => a + b, 0) : 0;
        list.push({ label: `${w.id} KV bytes sent`, value: w.counters.kv_transfer_bytes ?? 0, text: fmt.bytes(w.counters.kv_transfer_bytes ?? 0),
                    metric: "pdserve_kv_transfer_bytes_total", labels: lab },
                  { label: "transfers", value: n, metric: "pdserve_kv_transfer_seconds_count", labels: lab });
        for (const q of [0.5, 0.99]) {
          const v = h ? quantile(q, h) : null;
          list.push({ label: `P${q * 100} (all)`, value: v, text: fmt.seconds(v), hist: "pdserve_kv_transfer_seconds", q, labels: lab });
        }
      } else if (w.role === "decode") {
        rates.push({ label: `${w.id} → host`, color, points: points(`rate/${w.id}/retract_offload_bytes`), fmt: fmt.byteRate });
      }
      if ("transfer_failures" in w.counters) {
        list.push({ label: `${w.id} failures`, value: w.counters.transfer_failures, metric: "pdserve_transfer_failures_total", labels: lab });
      }
    });
    tiles("transfer-tiles", list);
    if (!rates.length) return;
    chart("transfer", "xfer-rate", { fmt: fmt.bytes, title: "throughput (bytes/s)" }).draw(snap.t, rates);
    chart("transfer", "xfer-lat", { fmt: fmt.seconds, title: `latency (last ${WINDOW_S}s)` }).draw(snap.t, lat);
  }

  /** Decode workers' migrations: counters by direction and outcome, bytes, write time, one marker per move. */
  function renderMigration(snap) {
    const rates = [], lat = [], list = [], workers = snap.workers.filter((w) => "migrations_out_done" in w.counters);
    workers.forEach((w, i) => {
      const c = w.counters, lab = { worker: w.id }, color = LINES[i % LINES.length];
      rates.push({ label: `${w.id} → peer`, color, points: points(`rate/${w.id}/migration_bytes`), fmt: fmt.byteRate });
      lat.push({ label: `${w.id} P50`, color, points: points(`mig/${w.id}/p50`) },
               { label: `${w.id} P99`, color: LINES[(i + 4) % LINES.length], points: points(`mig/${w.id}/p99`) });
      for (const [direction, outcomes] of [["out", ["done", "failed", "declined"]], ["in", ["done", "failed", "refused"]]]) {
        for (const outcome of outcomes) {
          list.push({ label: `${w.id} ${direction} ${outcome}`, value: c[`migrations_${direction}_${outcome}`] ?? 0,
                      metric: "pdserve_migrations_total", labels: { worker: w.id, direction, outcome } });
        }
      }
      const h = w.histograms.migration_seconds, n = h ? h.counts.reduce((a, b) => a + b, 0) : 0;
      list.push({ label: `${w.id} bytes out`, value: c.migration_bytes ?? 0, text: fmt.bytes(c.migration_bytes ?? 0),
                  metric: "pdserve_migration_bytes_total", labels: lab },
                { label: "writes timed", value: n, metric: "pdserve_migration_seconds_count", labels: lab });
      for (const q of [0.5, 0.99]) {
        const v = h ? quantile(q, h) : null;
        list.push({ label: `P${q * 100} (all)`, value: v, text: fmt.seconds(v), hist: "pdserve_migration_seconds", q, labels: lab });
      }
    });
    tiles("migration-tiles", list);
    const moves = events.filter((e) => e.cls.startsWith("migrate"));
    const marks = moves.map((e) => ({ t: e.t, label: e.label, title: e.text, cls: e.cls }));
    if (rates.length) {
      chart("migration", "mig-rate", { fmt: fmt.bytes, title: "KV moved host pool → peer (bytes/s)" }).draw(snap.t, rates, marks);
      chart("migration", "mig-lat", { fmt: fmt.seconds, title: `write time per request (last ${WINDOW_S}s)` }).draw(snap.t, lat, marks);
    }
    const ol = document.getElementById("migration-events");
    ol.replaceChildren();
    for (const e of moves.slice(-MAX_EVENTS).reverse()) {
      const li = htmlEl("li", e.cls, ol, `${new Date((snap.time - (snap.t - e.t)) * 1000).toLocaleTimeString()}  ${e.text}`);
      Object.assign(li.dataset, { worker: e.worker, n: String(e.n) });
    }
    if (!moves.length) htmlEl("li", "muted", ol, "no migrations in the last 10 minutes");
  }

  /** Speculative decoding: draft and accepted tokens per worker (tiles from PdSpec) and their rates. */
  function renderSpec(snap) {
    tiles("spec-tiles", PdSpec.tiles(snap));
    const lines = snap.workers.filter((w) => "spec_draft_tokens" in w.counters).flatMap((w, i) => [
      { label: `${w.id} drafted`, color: LINES[(2 * i) % LINES.length], points: points(`rate/${w.id}/spec_draft_tokens`), fmt: fmt.rate },
      { label: `${w.id} accepted`, color: LINES[(2 * i + 1) % LINES.length], points: points(`rate/${w.id}/spec_accepted_tokens`), fmt: fmt.rate }]);
    if (lines.length) chart("spec", "spec-rate", { fmt: fmt.count, title: "draft tokens/s" }).draw(snap.t, lines);
  }

  function statusColor(s) {
    return s.startsWith("2") ? LINES[2] : s === "499" ? "#999" : s.startsWith("4") ? LINES[4] : LINES[1];
  }

  function latencyTiles(r, list) {
    for (const [name, label] of [["ttft", "TTFT"], ["tpot", "TPOT"], ["queue_wait", "queue wait"]]) {
      const h = r[name], hist = `pdserve_${name}_seconds`;
      list.push({ label: `${label} count`, value: h.counts.reduce((a, b) => a + b, 0), metric: `${hist}_count` });
      for (const q of [0.5, 0.99]) {
        const v = quantile(q, h);
        list.push({ label: `${label} P${q * 100} (all)`, value: v, text: fmt.seconds(v), hist, q });
      }
    }
  }

  /** Failovers by dead worker and outcome, the tokens recomputed and the stall clients saw (all time). */
  function failoverTiles(r, list) {
    for (const worker of Object.keys(r.failovers).sort()) {
      for (const outcome of Object.keys(r.failovers[worker]).sort()) {
        list.push({ label: `failovers: ${worker} ${outcome}`, value: r.failovers[worker][outcome],
                    metric: "pdserve_failovers_total", labels: { worker, outcome } });
      }
    }
    const h = r.failover_stall, n = h.counts.reduce((a, b) => a + b, 0);
    if (!n) return;
    list.push({ label: "failover recomputed tokens", value: r.failover_recomputed, metric: "pdserve_failover_recomputed_tokens_total" },
              { label: "failover stalls", value: n, metric: "pdserve_failover_stall_seconds_count" });
    for (const q of [0.5, 0.99]) {
      const v = quantile(q, h);
      list.push({ label: `failover stall P${q * 100} (all)`, value: v, text: fmt.seconds(v), hist: "pdserve_failover_stall_seconds", q });
    }
  }

  function renderRequests(snap) {
    const r = snap.router, statuses = Object.keys(r.requests).sort(), list = [];
    list.push({ label: "in flight", value: r.inflight, metric: "pdserve_inflight_requests" });
    for (const s of statuses) list.push({ label: `HTTP ${s}`, value: r.requests[s], metric: "pdserve_requests_total", labels: { status: s } });
    for (const [key, [n, tokens]] of Object.entries(r.queued).sort()) {
      list.push({ label: `queued (${key})`, value: n, metric: "pdserve_queued_requests", labels: { key } });
      list.push({ label: `queued tokens (${key})`, value: tokens, metric: "pdserve_queued_tokens", labels: { key } });
    }
    for (const reason of Object.keys(r.shed).sort()) {
      list.push({ label: `shed: ${reason}`, value: r.shed[reason], metric: "pdserve_shed_requests_total", labels: { reason } });
    }
    latencyTiles(r, list);
    failoverTiles(r, list);
    for (const w of snap.workers.filter((x) => x.role !== "prefill")) {
      list.push({ label: `${w.id} output tokens`, value: w.counters.generation_tokens ?? 0,
                  metric: "pdserve_generation_tokens_total", labels: { worker: w.id } });
    }
    for (const w of snap.workers.filter((x) => (x.counters.prompt_tokens ?? 0) > 0)) {
      // prefix hit rate since the worker started: prompt tokens its radix cache served (decode: KV not shipped)
      const rate = (w.counters.cached_prompt_tokens ?? 0) / w.counters.prompt_tokens;
      list.push({ label: `${w.id} (${w.role}) prefix hit rate`, value: rate, text: `${(100 * rate).toFixed(1)}%` });
    }
    tiles("requests-tiles", list);
    const reqSeries = statuses.map((s) => ({ label: s, color: statusColor(s), points: points(`req/${s}`), fmt: fmt.rate }));
    const marks = failovers.events.map((e) => ({ t: e.t, label: e.label, title: e.text, cls: e.cls }));
    chart("requests", "req", { fmt: fmt.count, title: "requests/s by status" }).draw(snap.t, reqSeries, marks);
    for (const [name, label] of [["ttft", "TTFT"], ["tpot", "TPOT"]]) {
      chart("requests", name, { fmt: fmt.seconds, title: `${label} (last ${WINDOW_S}s)` }).draw(snap.t, [
        { label: "P50", color: LINES[0], points: points(`${name}/p50`) },
        { label: "P99", color: LINES[1], points: points(`${name}/p99`) }]);
    }
    chart("requests", "tokens", { fmt: fmt.count, title: "output tokens/s" }).draw(snap.t, [
      { label: "tokens/s", color: LINES[3], points: points("tokens"), fmt: fmt.rate }], marks);
  }

  function render(snap) {
    document.getElementById("model").textContent = `${snap.model} · ${snap.mode}`;
    const badge = document.getElementById("health");
    badge.textContent = snap.healthy ? "healthy" : "degraded";
    badge.className = `badge ${snap.healthy ? "ready" : "dead"}`;
    badge.title = snap.health;
    document.getElementById("updated").textContent = `updated ${new Date(snap.time * 1000).toLocaleTimeString()}`;
    renderWorkers(snap);
    renderRoles(snap);
    renderPools(snap);
    renderQueues(snap);
    renderRetract(snap);
    renderTransfer(snap);
    renderMigration(snap);
    renderSpec(snap);
    renderRequests(snap);
  }

  // ---- polling and the API key -------------------------------------------------------------------
  function banner(text) {
    const b = document.getElementById("banner");
    b.textContent = text || "";
    b.hidden = !text;
  }

  function askForKey(message) {
    const form = document.getElementById("keyform");
    form.hidden = false;
    document.getElementById("keyerror").textContent = message;
    document.getElementById("health").textContent = "API key needed";
  }

  async function poll() {
    const key = sessionStorage.getItem(KEY);
    let resp;
    try {
      resp = await fetch("dashboard/data", { cache: "no-store", headers: key ? { Authorization: `Bearer ${key}` } : {} });
    } catch (e) {
      banner(`router unreachable: ${e.message}`);
      return setTimeout(poll, POLL_MS);
    }
    if (resp.status === 401) return askForKey(key ? "that key was refused" : "");
    if (!resp.ok) {
      banner(`dashboard/data answered HTTP ${resp.status}`);
      return setTimeout(poll, POLL_MS);
    }
    const snap = await resp.json();
    banner("");
    document.getElementById("keyform").hidden = true;
    ingest(snap);
    render((view.last = snap));
    setTimeout(poll, POLL_MS);
  }

  for (const b of document.querySelectorAll("#spans button")) {
    b.addEventListener("click", () => {
      view.span = Number(b.dataset.span);
      for (const o of document.querySelectorAll("#spans button")) o.classList.toggle("on", o === b);
      if (view.last) render(view.last);
    });
  }

  document.getElementById("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, document.getElementById("key").value);
    poll();
  });
  poll();
})();
