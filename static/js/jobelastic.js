/* The job page's elastic chart: how many learners an elastic job held, at what global batch, and
 * how many samples per second it processed, over time. Three uPlot panels on one time axis (their
 * cursors move together), because the three figures have units of their own.
 *
 * Learners and batch come from the allocation timeline (GET …/allocations/: one row per shape, reloaded
 * when the job changes attempt or status, or its learners report a batch change applied). Throughput is measured from the `samples` metric
 * rank 0 reports (cumulative samples, so a rate is a difference over time), as it arrives over the
 * websocket; each closed allocation's mean (the API's samples_per_s) is drawn beside it, dashed.
 * A resize is a checkpoint-restart: between one allocation's end and the next one's start the job
 * runs nowhere, and the lines break there rather than pretend otherwise. A batch change inside the
 * running learners starts its stretch where the last one ends: the lines go on.
 */
(function () {
  "use strict";
  const T = window.Trainyard;

  const SAMPLES_METRIC = "samples";
  const BATCH_APPLIED_METRIC = "batch_applied"; // learner_agent.batch_changes: a new stretch has started
  const PANEL_HEIGHT = 120;
  // A rate over less than this is mostly noise of when reports happened to be sent.
  const MIN_RATE_WINDOW_S = 2;
  const MAX_RATE_POINTS = 1500; // per chart, like jobcharts.js: a long run's rate is measured over wider windows
  const COLORS = { learners: "#2563eb", batch: "#7c3aed", rate: "#059669", mean: "#059669" };

  function seconds(iso) {
    const ms = T.parseTime(iso);
    return ms == null ? null : ms / 1000;
  }

  function formatNumber(v) {
    if (v == null || !Number.isFinite(v)) return "—";
    if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString();
    return String(Number(v.toPrecision(4)));
  }

  /** The stretches the job held a shape: [{attempt, learners, batch, mean, start, end, open}], by start. */
  function stretchesOf(rows, nowS) {
    return rows
      .filter((r) => r.started_at)
      .map((r) => ({
        attempt: r.attempt, learners: r.learners, batch: r.global_batch, mean: r.samples_per_s,
        start: seconds(r.started_at), end: seconds(r.ended_at) ?? nowS, open: !r.ended_at,
      }))
      .sort((a, b) => a.start - b.start);
  }

  /** Samples/s between reports of one attempt, each over at least `window` seconds: [[t, rate]]. */
  function ratesOf(points, window) {
    const byAttempt = new Map();
    for (const p of points) {
      if (!byAttempt.has(p.attempt)) byAttempt.set(p.attempt, []);
      byAttempt.get(p.attempt).push(p);
    }
    const rates = [];
    for (const list of byAttempt.values()) {
      list.sort((a, b) => a.t - b.t);
      let anchor = list[0];
      for (const p of list.slice(1)) {
        const dt = p.t - anchor.t;
        if (dt < window) continue;
        rates.push([p.t, Math.max(0, (p.samples - anchor.samples) / dt), p.attempt]);
        anchor = p;
      }
    }
    return rates.sort((a, b) => a[0] - b[0]);
  }

  class ElasticChart {
    constructor(section, jobId) {
      this.section = section;
      this.jobId = jobId;
      this.body = section.querySelector("[data-testid=elastic-chart]");
      this.empty = section.querySelector("[data-testid=elastic-empty]");
      this.now = section.querySelector("[data-testid=elastic-now]");
      this.learnersStat = document.querySelector("[data-field=learners]");
      const d = section.dataset;
      this.bounds = { min_learners: d.minLearners, max_learners: d.maxLearners, lr_scaling: d.lrScaling };
      this.rows = [];
      this.points = [];
      this.seen = new Set();
      this.active = true;
      this.plots = [];
      this.frame = 0;
      this.loading = null;
      new ResizeObserver(() => this.resize()).observe(this.body);
    }

    /** Metric points off the websocket: keeps rank 0's cumulative samples. */
    addPoints(points) {
      let added = false;
      if (points.some((p) => p.name === BATCH_APPLIED_METRIC && p.learner === 0)) this.reload();
      for (const p of points) {
        if (p.name !== SAMPLES_METRIC || p.learner !== 0) continue;
        const key = `${p.attempt ?? 1}\u0000${p.step}\u0000${p.time}\u0000${p.value}`;
        if (this.seen.has(key)) continue;
        this.seen.add(key);
        const t = seconds(p.time);
        if (t == null || !Number.isFinite(p.value)) continue;
        this.points.push({ t, samples: p.value, attempt: p.attempt ?? 1 });
        added = true;
      }
      if (added) this.schedule();
    }

    /** The job detail's `elastic` (or null: only the status changed). */
    setSummary(elastic, status) {
      if (status) this.active = !T.isFinal(status) && status !== "HALTED" && status !== "QUEUED";
      if (!elastic) return;
      this.bounds = elastic;
      this.renderNow(elastic);
    }

    /** The header's "now" line and the summary's learners: from the detail, or the newest allocation row. */
    renderNow(shape) {
      const b = this.bounds;
      const parts = [`${shape.learners} of ${b.min_learners}–${b.max_learners} learners`];
      if (shape.global_batch != null) parts.push(`batch ${shape.global_batch} (${shape.local_batch} each)`);
      if (shape.lr_scale != null) parts.push(`lr ×${formatNumber(shape.lr_scale)} (${b.lr_scaling})`);
      this.now.textContent = parts.join(" · ");
      this.section.dataset.learners = String(shape.learners);
      if (this.learnersStat) this.learnersStat.textContent = String(shape.learners);
    }

    /** Fetch the allocation timeline again (one request at a time; a change meanwhile asks again). */
    reload() {
      if (this.loading) { this.loading.again = true; return; }
      this.loading = { again: false };
      T.getJson(`/api/v1/jobs/${encodeURIComponent(this.jobId)}/allocations/`)
        .then((body) => {
          this.rows = body.results || [];
          const newest = this.rows.filter((r) => r.started_at).pop(); // not a batch change still on its way
          if (newest) this.renderNow(newest);
          this.schedule();
        })
        .catch((err) => { this.empty.textContent = `Could not load the allocations: ${err.message}`; this.empty.hidden = false; })
        .finally(() => {
          const again = this.loading.again;
          this.loading = null;
          if (again) this.reload();
        });
    }

    /** While the job runs, its open stretch grows with the clock. */
    tick() {
      if (this.active && this.rows.some((r) => r.started_at && !r.ended_at)) this.schedule();
    }

    schedule() {
      if (!this.frame) this.frame = requestAnimationFrame(() => { this.frame = 0; this.draw(); });
    }

    /** uPlot's aligned columns: [xs, learners, batch, rate, mean]; null breaks a line. Within a stretch the
     * only xs are its rate points, so the rate line is unbroken there. */
    data() {
      const stretches = stretchesOf(this.rows, Date.now() / 1000);
      const span = stretches.length ? stretches[stretches.length - 1].end - stretches[0].start : 0;
      const rates = ratesOf(this.points, Math.max(MIN_RATE_WINDOW_S, span / MAX_RATE_POINTS));
      const xs = new Set();
      for (const s of stretches) { xs.add(s.start); xs.add(s.end); }
      stretches.forEach((s, i) => { // a point in each gap between stretches, where every line breaks
        const next = stretches[i + 1];
        if (next && next.start > s.end) xs.add((s.end + next.start) / 2);
      });
      const rateAt = new Map(rates.map(([t, r]) => [t, r]));
      for (const [t] of rates) xs.add(t);
      const x = [...xs].sort((a, b) => a - b);
      const covering = (t) => stretches.find((s) => s.start <= t && t <= s.end) || null;
      const learners = [], batch = [], rate = [], mean = [];
      for (const t of x) {
        const s = covering(t);
        learners.push(s ? s.learners : null);
        batch.push(s ? s.batch : null);
        mean.push(s ? s.mean : null);
        // null, not undefined, where no rate was measured: uPlot clips a gap between the neighbours of a
        // null, so an undefined beside it would let a segment across the resize show at its edge.
        rate.push(rateAt.has(t) ? rateAt.get(t) : null);
      }
      return { columns: [x, learners, batch, rate, mean], stretches, rates };
    }

    draw() {
      const { columns, stretches, rates } = this.data();
      this.section.dataset.allocationCount = String(stretches.length);
      this.section.dataset.ratePoints = String(rates.length);
      const latest = rates.length ? rates[rates.length - 1][1] : null;
      this.section.dataset.latestRate = latest == null ? "" : latest.toFixed(1);
      this.empty.hidden = stretches.length > 0;
      this.body.hidden = stretches.length === 0;
      if (!stretches.length) return;
      const panels = [
        { key: "learners", columns: [columns[0], columns[1]], series: [this.series("learners", COLORS.learners, true)] },
        { key: "batch", columns: [columns[0], columns[2]], series: [this.series("global batch", COLORS.batch, true)] },
        { key: "rate", columns: [columns[0], columns[3], columns[4]],
          series: [this.series("samples/s", COLORS.rate, false), this.series("mean per allocation", COLORS.mean, true, [4, 4])] },
      ];
      if (!this.plots.length) {
        this.plots = panels.map((panel, i) => this.createPlot(panel, i === panels.length - 1));
      } else {
        panels.forEach((panel, i) => this.plots[i].setData(panel.columns));
      }
    }

    series(label, stroke, stepped, dash) {
      return {
        label, stroke, width: stepped ? 2 : 1.6, dash,
        paths: stepped ? window.uPlot.paths.stepped({ align: 1 }) : undefined,
        points: { show: false },
        value: (u, v) => formatNumber(v),
      };
    }

    createPlot(panel, withTimeAxis) {
      const holder = document.createElement("div");
      holder.className = "elastic-panel";
      holder.dataset.panel = panel.key;
      holder.setAttribute("role", "img");
      holder.setAttribute("aria-label", `${panel.series.map((s) => s.label).join(" and ")} over time`);
      this.body.appendChild(holder);
      const options = {
        width: Math.max(200, this.body.clientWidth),
        height: PANEL_HEIGHT + (withTimeAxis ? 30 : 0),
        series: [{ label: "time", value: (u, v) => (v == null ? "—" : T.formatLocalTime(v * 1000, true)) }, ...panel.series],
        scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.15 : 1] } },
        axes: [
          { show: withTimeAxis, size: withTimeAxis ? 30 : 0 },
          { size: 60, label: panel.series[0].label, labelSize: 16, values: (u, vals) => vals.map(formatNumber) },
        ],
        legend: { live: true },
        cursor: { sync: { key: `elastic-${this.jobId}` }, drag: { x: false, y: false } },
      };
      return new window.uPlot(options, panel.columns, holder);
    }

    resize() {
      for (const plot of this.plots) plot.setSize({ width: Math.max(200, this.body.clientWidth), height: plot.height });
    }
  }

  T.ElasticChart = ElasticChart;
})();
