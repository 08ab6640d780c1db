"use strict";
/* Small SVG time-series charts and number formatting for the pdserve dashboard (no dependencies).
 *
 * PdChart.TimeChart(container, opts) draws the last `span` seconds of some series as lines or, with
 * `stacked`, as stacked areas, plus optional event markers; its legend shows each series' latest
 * value. Series: {label, color, points: [[t, value or null], ...], attrs: {data-* for the legend value}}.
 */
const PdChart = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const M = { left: 48, right: 8, top: 8, bottom: 18 };

  function svgEl(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (parent) parent.appendChild(e);
    return e;
  }

  function htmlEl(name, cls, parent, text) {
    const e = document.createElement(name);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= v * 1.0001) return m * p;
    return 10 * p;
  }

  const SI = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  const fmt = {
    count(v) {
      if (v === null || v === undefined || Number.isNaN(v)) return "–";
      for (const [d, s] of SI) if (Math.abs(v) >= d * 10) return (v / d).toFixed(Math.abs(v) >= d * 100 ? 0 : 1) + s;
      return Number.isInteger(v) ? String(v) : v.toFixed(Math.abs(v) >= 10 ? 1 : 2);
    },
    bytes(v) {
      if (v === null || v === undefined) return "–";
      for (const [d, s] of SI) if (Math.abs(v) >= d) return (v / d).toFixed(1) + " " + s + "B";
      return v.toFixed(0) + " B";
    },
    rate(v) { return v === null || v === undefined ? "–" : fmt.count(v) + "/s"; },
    byteRate(v) { return v === null || v === undefined ? "–" : fmt.bytes(v) + "/s"; },
    seconds(v) {
      if (v === null || v === undefined) return "–";
      if (v < 1e-3) return (v * 1e6).toFixed(0) + " µs";
      if (v < 1) return (v * 1e3).toFixed(v < 0.01 ? 2 : v < 0.1 ? 1 : 0) + " ms";
      return v.toFixed(v < 10 ? 2 : 1) + " s";
    },
    duration(v) {
      if (v === null || v === undefined) return "–";
      const s = Math.floor(v), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
      return h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
    },
    ratio(v) { return v === null || v === undefined ? "–" : v.toFixed(3); },
  };

  class TimeChart {
    /** opts: {title, fmt (value -> text), stacked, height, yMax (fixed top), span (seconds)} */
    constructor(container, opts) {
      this.opts = Object.assign({ fmt: fmt.count, stacked: false, height: 110, span: 600 }, opts);
      this.root = htmlEl("div", "chart", container);
      this.titleEl = htmlEl("div", "chart-title", this.root, this.opts.title || "");
      this.svg = svgEl("svg", { class: "plot", height: this.opts.height, preserveAspectRatio: "none" }, this.root);
      this.legend = htmlEl("div", "legend", this.root);
    }

    setTitle(text) { this.titleEl.textContent = text; }

    /** Redraw for time `now` (seconds, same clock as the points); markers: [{t, label, title, cls}]. */
    draw(now, series, markers = []) {
      const o = this.opts, W = Math.max(200, this.svg.clientWidth || 480), H = o.height;
      const x0 = now - o.span, pw = W - M.left - M.right, ph = H - M.top - M.bottom;
      const X = (t) => M.left + ((t - x0) / o.span) * pw;
      const stacks = o.stacked ? this.stack(series, x0) : series.map((s) => s.points.filter((p) => p[0] >= x0));
      let top = 0;
      for (const pts of stacks) for (const p of pts) if (p[1] !== null && p[1] > top) top = p[1];
      const yMax = o.yMax || niceMax(top);
      const Y = (v) => M.top + ph - (Math.min(v, yMax) / yMax) * ph;
      this.svg.replaceChildren();
      this.svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
      this.axes(W, H, X, Y, yMax, now);
      stacks.forEach((pts, i) => this.path(pts, series[i], i, stacks, X, Y));
      for (const m of markers) if (m.t >= x0) this.marker(m, X(m.t), H);
      this.drawLegend(series);
    }

    stack(series, x0) {
      const out = [];
      let base = null;
      for (const s of series) {
        const pts = s.points.filter((p) => p[0] >= x0).map((p, i) => [p[0], (p[1] || 0) + (base && base[i] ? base[i][1] : 0)]);
        out.push(pts);
        base = pts;
      }
      return out;
    }

    axes(W, H, X, Y, yMax, now) {
      const g = svgEl("g", { class: "axes" }, this.svg);
      for (const f of [0, 0.5, 1]) {
        const y = Y(yMax * f);
        svgEl("line", { x1: M.left, x2: W - M.right, y1: y, y2: y, class: "grid" }, g);
        svgEl("text", { x: M.left - 4, y: y + 3, "text-anchor": "end" }, g).textContent = this.opts.fmt(yMax * f);
      }
      const span = this.opts.span, step = span <= 120 ? 10 : 60;
      for (let a = 0; a <= span; a += step) {
        const x = X(now - a);
        svgEl("line", { x1: x, x2: x, y1: M.top, y2: H - M.bottom, class: a ? "grid faint" : "grid" }, g);
      }
      for (const a of [0, span / 2, span]) {
        const anchor = a === 0 ? "end" : a === span ? "start" : "middle";
        const text = a === 0 ? "now" : a < 120 ? `-${a}s` : `-${a / 60}m`;
        svgEl("text", { x: X(now - a), y: H - 4, "text-anchor": anchor }, g).textContent = text;
      }
    }

    path(pts, s, i, stacks, X, Y) {
      const vals = pts.filter((p) => p[1] !== null), n = vals.length;
      const own = this.opts.stacked ? vals.map((p, j) => p[1] - (i > 0 && stacks[i - 1][j] ? stacks[i - 1][j][1] : 0)) : vals.map((p) => p[1]);
      let d = "", pen = false;
      for (const [t, v] of pts) {
        if (v === null) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${X(t).toFixed(1)},${Y(v).toFixed(1)}`;
        pen = true;
      }
      const attrs = { d, class: "series", stroke: s.color, "data-n": n, "data-max": Math.max(0, ...own), "data-label": s.label };
      if (this.opts.stacked && n > 0) {
        const below = i > 0 ? stacks[i - 1] : pts.map((p) => [p[0], 0]);
        let back = "";
        for (let j = below.length - 1; j >= 0; j--) back += `L${X(below[j][0]).toFixed(1)},${Y(below[j][1]).toFixed(1)}`;
        svgEl("path", { d: d + back + "Z", class: "area", fill: s.color }, this.svg);
      }
      svgEl("path", Object.assign(attrs, { fill: "none" }), this.svg);
    }

    marker(m, x, H) {
      const g = svgEl("g", { class: "marker " + (m.cls || "") }, this.svg);
      svgEl("line", { x1: x, x2: x, y1: M.top, y2: H - M.bottom }, g);
      svgEl("path", { d: `M${x - 4},${M.top}L${x + 4},${M.top}L${x},${M.top + 6}Z` }, g);
      if (m.label) svgEl("text", { x: x + 3, y: M.top + 14 }, g).textContent = m.label;
      svgEl("title", {}, g).textContent = m.title || m.label || "";
    }

    drawLegend(series) {
      this.legend.replaceChildren();
      for (const s of series) {
        const item = htmlEl("span", "item", this.legend);
        htmlEl("span", "swatch", item).style.background = s.color;
        htmlEl("span", "label", item, s.label + " ");
        const v = s.points.length ? s.points[s.points.length - 1][1] : null;  // "–" once a window empties
        const val = htmlEl("b", "value", item, (s.fmt || this.opts.fmt)(v));
        if (s.attrs) {  // a /metrics sample: the raw value rides along for readers of the DOM
          for (const [k, a] of Object.entries(s.attrs)) val.dataset[k] = a;
          val.dataset.value = v === null ? "" : String(v);
        }
      }
    }
  }

  return { TimeChart, fmt, htmlEl };
})();
