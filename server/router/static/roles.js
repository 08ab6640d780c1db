"use strict";
/* The dashboard's role timeline: each worker's role over the shown span, one band per worker.
 *
 * PdRoles.ingest(snap) records, per worker, the segments of constant (role, state) seen in the
 * snapshots (the router's registry: /health's "id (role): state"); PdRoles.render(container, snap,
 * span) draws them: a band per worker coloured by role (switching, dead and restarting stretches
 * shaded), one marker where its role changed ("→prefill"). The markers' <g> carry data-worker,
 * data-from and data-to; the bands' <rect> data-worker, data-role and data-state. */
const PdRoles = (() => {
  const { htmlEl } = PdChart;
  const NS = "http://www.w3.org/2000/svg", ROW = 18, LEFT = 90, RIGHT = 8, AXIS = 14;
  const segments = new Map();  // worker id -> [{role, state, t0, t1}], oldest first
  const switches = new Map();  // worker id -> [{t, from, to}]

  function svgEl(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    parent.appendChild(e);
    return e;
  }

  /** Extend each worker's last segment to `snap.t`, or open a new one when its role or state changed. */
  function ingest(snap, keep) {
    for (const w of snap.workers) {
      let segs = segments.get(w.id);
      if (!segs) segments.set(w.id, (segs = []));
      const last = segs[segs.length - 1];
      if (last && last.role === w.role && last.state === w.state) last.t1 = snap.t;
      else {
        if (last && last.role !== w.role) {
          const marks = switches.get(w.id) || [];
          marks.push({ t: snap.t, from: last.role, to: w.role });
          switches.set(w.id, marks);
        }
        segs.push({ role: w.role, state: w.state, t0: last ? last.t1 : snap.t, t1: snap.t });
      }
      while (segs.length > 1 && segs[0].t1 < snap.t - keep) segs.shift();
      const marks = switches.get(w.id);
      while (marks && marks.length && marks[0].t < snap.t - keep) marks.shift();
    }
  }

  /** Redraw the timeline into `container` for the workers of `snap` over the last `span` seconds. */
  function render(container, snap, span) {
    const box = document.getElementById(container);
    box.replaceChildren();
    const W = box.clientWidth || 600, H = snap.workers.length * ROW + AXIS, x0 = snap.t - span;
    const X = (t) => LEFT + ((Math.max(t, x0) - x0) / span) * (W - LEFT - RIGHT);
    const svg = svgEl("svg", { class: "plot roles", width: W, height: H }, box);
    snap.workers.forEach((w, i) => {
      const y = i * ROW, row = svgEl("g", { class: "role-row", "data-worker": w.id }, svg);
      svgEl("text", { x: 2, y: y + ROW - 5 }, row).textContent = `${w.id} (${w.role})`;
      for (const s of segments.get(w.id) || []) {
        if (s.t1 < x0) continue;
        const r = svgEl("rect", { x: X(s.t0), y: y + 2, width: Math.max(1, X(s.t1) - X(s.t0)), height: ROW - 4,
                                  class: `band ${s.role} ${s.state}`, "data-worker": w.id, "data-role": s.role,
                                  "data-state": s.state }, row);
        svgEl("title", {}, r).textContent = `${w.id}: ${s.role}, ${s.state}`;
      }
      for (const m of switches.get(w.id) || []) {
        if (m.t < x0) continue;
        const g = svgEl("g", { class: "marker role-switch", "data-worker": w.id, "data-from": m.from, "data-to": m.to }, row);
        svgEl("line", { x1: X(m.t), x2: X(m.t), y1: y, y2: y + ROW }, g);
        svgEl("text", { x: X(m.t) + 3, y: y + ROW - 5 }, g).textContent = `→${m.to}`;
        svgEl("title", {}, g).textContent = `${w.id}: ${m.from} → ${m.to}`;
      }
    });
    svgEl("text", { x: LEFT, y: H - 2 }, svg).textContent = `last ${span} s`;
    if (!snap.workers.length) htmlEl("div", "muted", box, "no workers");
  }

  return { ingest, render };
})();
