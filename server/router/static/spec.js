"use strict";
/* The dashboard's speculative decoding panel: per worker that reports the n-gram draft series
 * (colocated and decode workers; zero where speculation is off).
 *
 * PdSpec.tiles(snap) is the panel's tiles, computed from the snapshot alone (no DOM, no history):
 * draft tokens verified (pdserve_spec_draft_tokens_total), of those accepted
 * (pdserve_spec_accepted_tokens_total), the acceptance rate (accepted / drafted), the rows that
 * drafted (pdserve_spec_acceptance_length_count) and the mean tokens accepted per drafting row
 * (the histogram's sum / count). Counters are cumulative per worker process, as on /metrics. */
const PdSpec = (() => {
  const KEYS = ["spec_draft_tokens", "spec_accepted_tokens"];  // the counters the panel plots as rates

  function pct(num, den) {
    return den > 0 ? `${((100 * num) / den).toFixed(1)}%` : "–";
  }

  /** [{label, value, text?, metric?, labels?}] for every worker whose counters carry the series. */
  function tiles(snap) {
    const list = [];
    for (const w of snap.workers.filter((x) => "spec_draft_tokens" in x.counters)) {
      const c = w.counters, lab = { worker: w.id }, h = w.histograms.spec_acceptance_length;
      const rows = h ? h.counts.reduce((a, b) => a + b, 0) : 0, accepted = h ? h.sum : 0;
      list.push({ label: `${w.id} draft tokens`, value: c.spec_draft_tokens, metric: "pdserve_spec_draft_tokens_total", labels: lab },
                { label: "accepted", value: c.spec_accepted_tokens ?? 0, metric: "pdserve_spec_accepted_tokens_total", labels: lab },
                { label: "acceptance", value: null, text: pct(c.spec_accepted_tokens ?? 0, c.spec_draft_tokens) },
                { label: "rows drafted", value: rows, metric: "pdserve_spec_acceptance_length_count", labels: lab },
                { label: "accepted per row", value: null, text: rows > 0 ? (accepted / rows).toFixed(2) : "–" });
    }
    return list;
  }

  return { KEYS, tiles };
})();
if (typeof module !== "undefined") module.exports = PdSpec;  // the unit tests run it under node
