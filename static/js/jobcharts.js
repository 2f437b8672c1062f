/* Metric charts: one uPlot chart per metric name, step on x. On the job page one line per
 * (attempt, learner) overlaid, so a resumed or restarted job continues on the same chart; the compare
 * page groups lines by job instead (a `grouping`, below).
 *
 * Every point is kept; what is drawn is at most MAX_DRAWN_STEPS steps per chart (a long run's
 * steps are averaged per bucket, min and max kept per bucket in the hover values), so a chart of a
 * million-step run redraws as fast as one of a hundred steps.
 */
(function () {
  "use strict";
  const T = window.Trainyard;

  const MAX_DRAWN_STEPS = 1500;
  const CHART_HEIGHT = 170;
  // Steps are whole numbers: ticks at 1, 2, 5, 10, 20, 50, ... apart, never at 2.5.
  const STEP_INCREMENTS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7].map((p) => m * p)).sort((a, b) => a - b);
  const PALETTE = T.CHART_PALETTE;

  function formatValue(v) {
    if (v == null || !Number.isFinite(v)) return "—";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-4)) return v.toExponential(3);
    return String(Number(v.toPrecision(5)));
  }

  /** How points become lines: which line a point belongs to, how lines are ordered, named and coloured
   * (and, optionally, `width(s)`: how thick each is drawn). */
  const BY_ATTEMPT_AND_LEARNER = {
    key: (p) => `${p.attempt ?? 1}:${p.learner}`,
    describe: (p) => ({ attempt: p.attempt ?? 1, learner: p.learner }),
    order: (a, b) => a.attempt - b.attempt || a.learner - b.learner,
    label(s, list) {
      const attempts = new Set(list.map((x) => x.attempt)).size > 1;
      const learners = new Set(list.map((x) => x.learner)).size > 1;
      const parts = [];
      if (attempts || !learners) parts.push(`attempt ${s.attempt}`);
      if (learners) parts.push(`learner ${s.learner}`);
      return parts.join(" · ");
    },
    color: (s, i) => PALETTE[i % PALETTE.length],
    showLatest: true,
  };

  /** Loss-like metrics first (what people look at), then by name. */
  function metricOrder(a, b) {
    const la = /loss/i.test(a) ? 0 : 1;
    const lb = /loss/i.test(b) ? 0 : 1;
    return la - lb || a.localeCompare(b);
  }

  class Metric {
    constructor(name, grouping) {
      this.name = name;
      this.grouping = grouping;
      this.series = new Map(); // grouping.key(p) -> {...grouping.describe(p), xs: [], ys: [], sorted}
      this.count = 0;
      this.latest = null; // {value, step, attempt}
    }

    add(p) {
      const attempt = p.attempt ?? 1;
      const key = this.grouping.key(p);
      let s = this.series.get(key);
      if (!s) {
        s = { ...this.grouping.describe(p), xs: [], ys: [], sorted: true };
        this.series.set(key, s);
      }
      const x = p.step ?? s.xs.length; // no step: plot against the point's index
      if (s.xs.length && x < s.xs[s.xs.length - 1]) s.sorted = false;
      s.xs.push(x);
      s.ys.push(Number.isFinite(p.value) ? p.value : null);
      this.count += 1;
      this.latest = { value: p.value, step: p.step, attempt };
    }

    orderedSeries() {
      const list = [...this.series.values()].sort(this.grouping.order);
      for (const s of list) {
        if (s.sorted) continue;
        const order = s.xs.map((_, i) => i).sort((i, j) => s.xs[i] - s.xs[j]);
        s.xs = order.map((i) => s.xs[i]);
        s.ys = order.map((i) => s.ys[i]);
        s.sorted = true;
      }
      return list;
    }

    /** uPlot's aligned columns: [xs, ys per series], with at most MAX_DRAWN_STEPS distinct xs. */
    aligned() {
      const list = this.orderedSeries();
      let lo = Infinity, hi = -Infinity, distinct = new Set();
      for (const s of list) {
        if (s.xs.length) { lo = Math.min(lo, s.xs[0]); hi = Math.max(hi, s.xs[s.xs.length - 1]); }
        if (distinct && s.xs.length <= MAX_DRAWN_STEPS) for (const x of s.xs) distinct.add(x);
        else distinct = null;
        if (distinct && distinct.size > MAX_DRAWN_STEPS) distinct = null;
      }
      if (distinct) { // few steps: plot them exactly
        const xs = [...distinct].sort((a, b) => a - b);
        const at = new Map(xs.map((x, i) => [x, i]));
        const columns = list.map((s) => {
          const ys = new Array(xs.length).fill(null);
          s.xs.forEach((x, i) => { ys[at.get(x)] = s.ys[i]; });
          return ys;
        });
        return { data: [xs, ...columns], list, downsampled: false };
      }
      // many steps: average each series over MAX_DRAWN_STEPS equal buckets of the step range
      const width = (hi - lo) / MAX_DRAWN_STEPS || 1;
      const xs = Array.from({ length: MAX_DRAWN_STEPS }, (_, i) => lo + (i + 0.5) * width);
      const columns = list.map((s) => {
        const sums = new Float64Array(MAX_DRAWN_STEPS);
        const counts = new Uint32Array(MAX_DRAWN_STEPS);
        for (let i = 0; i < s.xs.length; i += 1) {
          if (s.ys[i] == null) continue;
          const b = Math.min(MAX_DRAWN_STEPS - 1, Math.floor((s.xs[i] - lo) / width));
          sums[b] += s.ys[i];
          counts[b] += 1;
        }
        return Array.from(sums, (sum, b) => (counts[b] ? sum / counts[b] : null));
      });
      return { data: [xs, ...columns], list, downsampled: true };
    }
  }

  class Charts {
    constructor(container, emptyNote, grouping = BY_ATTEMPT_AND_LEARNER) {
      this.container = container;
      this.emptyNote = emptyNote;
      this.grouping = grouping;
      this.metrics = new Map(); // name -> Metric
      this.cards = new Map(); // name -> {card, plot, seriesKey, title}
      this.dirty = new Set();
      this.seen = new Set(); // points arrive again after a reconnect: keep each once
      this.frame = 0;
      new ResizeObserver(() => this.resizeAll()).observe(container);
    }

    add(points) {
      for (const p of points) {
        const key = `${p.name}\u0000${this.grouping.key(p)}\u0000${p.step}\u0000${p.time}`;
        if (this.seen.has(key)) continue;
        this.seen.add(key);
        let metric = this.metrics.get(p.name);
        if (!metric) { metric = new Metric(p.name, this.grouping); this.metrics.set(p.name, metric); }
        metric.add(p);
        this.dirty.add(p.name);
      }
      if (this.dirty.size && !this.frame) this.frame = requestAnimationFrame(() => { this.frame = 0; this.draw(); });
    }

    draw() {
      const names = [...this.dirty];
      this.dirty.clear();
      for (const name of names) this.drawMetric(this.metrics.get(name));
      this.emptyNote.hidden = this.metrics.size > 0;
    }

    labelOf(s, list) {
      return this.grouping.label(s, list);
    }

    drawMetric(metric) {
      const { data, list, downsampled } = metric.aligned();
      const seriesKey = list.map((s) => this.labelOf(s, list)).join("|");
      let entry = this.cards.get(metric.name);
      if (!entry) entry = this.createCard(metric.name);
      if (entry.seriesKey !== seriesKey) { // a new attempt or learner: new lines, new chart
        if (entry.plot) entry.plot.destroy();
        entry.plot = this.createPlot(entry, list, data);
        entry.seriesKey = seriesKey;
      } else {
        entry.plot.setData(data);
      }
      entry.card.dataset.pointCount = String(metric.count);
      entry.card.dataset.seriesCount = String(list.length);
      const latest = metric.latest;
      if (this.grouping.showLatest) entry.latest.textContent = latest ? `${formatValue(latest.value)} at step ${latest.step ?? "—"}` : "";
      entry.note.textContent = downsampled ? `${metric.count.toLocaleString()} points, averaged to ${MAX_DRAWN_STEPS} steps` : "";
    }

    createCard(name) {
      const card = document.createElement("figure");
      card.className = "card chart-card";
      card.dataset.testid = "chart";
      card.dataset.metric = name;
      const head = document.createElement("figcaption");
      head.className = "card-head";
      const title = document.createElement("h3");
      title.textContent = name;
      const latest = document.createElement("span");
      latest.className = "mono small muted chart-latest";
      const note = document.createElement("span");
      note.className = "small muted";
      head.append(title, latest, note);
      const body = document.createElement("div");
      body.className = "chart-body";
      body.setAttribute("role", "img");
      body.setAttribute("aria-label", `${name} by step`);
      card.append(head, body);
      // Keep cards in metric order.
      const names = [...this.cards.keys(), name].sort(metricOrder);
      const next = names[names.indexOf(name) + 1];
      this.container.insertBefore(card, next ? this.cards.get(next).card : null);
      const entry = { card, body, latest, note, plot: null, seriesKey: null };
      this.cards.set(name, entry);
      return entry;
    }

    createPlot(entry, list, data) {
      const series = [{ label: "step" }].concat(list.map((s, i) => ({
        label: this.labelOf(s, list),
        stroke: this.grouping.color(s, i),
        width: this.grouping.width ? this.grouping.width(s) : 1.6,
        spanGaps: true,
        points: { show: data[0].length <= 60, size: 4 },
        value: (u, v) => formatValue(v),
      })));
      const options = {
        width: Math.max(200, entry.body.clientWidth),
        height: CHART_HEIGHT,
        series,
        scales: { x: { time: false } },
        axes: [{ label: "step", labelSize: 18, size: 30, incrs: STEP_INCREMENTS }, { size: 54, values: (u, vals) => vals.map(formatValue) }],
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
      };
      return new window.uPlot(options, data, entry.body);
    }

    /** Forget every point and chart (the compare page redraws from a fresh answer). */
    clear() {
      for (const entry of this.cards.values()) if (entry.plot) entry.plot.destroy();
      this.cards.clear();
      this.metrics.clear();
      this.seen.clear();
      this.dirty.clear();
      this.container.replaceChildren();
    }

    resizeAll() {
      for (const entry of this.cards.values()) {
        if (entry.plot) entry.plot.setSize({ width: Math.max(200, entry.body.clientWidth), height: CHART_HEIGHT });
      }
    }
  }

  T.Charts = Charts;
})();
