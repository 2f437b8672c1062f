/* The job page's resource charts: what each learner really used, as its agent sampled it
 * (GET /api/v1/jobs/<id>/resources/): CPU cores, memory against the job's limit, and each GPU's
 * utilisation, memory and power. Time on x, one line per (attempt, learner), or per (attempt,
 * learner, GPU) on the GPU charts. Read in pages at load, then polled while the job is active.
 *
 * A job killed for its memory limit says so above the charts; the memory chart shows the curve that
 * led there, the peak the kernel saw (which may fall between two samples) and the limit.
 */
(function () {
  "use strict";
  const T = window.Trainyard;

  const POLL_MS = 5000;
  const PAGE = 5000;
  const MAX_DRAWN = 1500; // times per chart; a long run's samples are averaged per bucket of time
  const CHART_HEIGHT = 170;
  const LIMIT_COLOR = "#dc2626";
  const OOM = /memory limit .* exceeded/i;
  // Byte axes tick at powers of two (32 MiB, 64 MiB, ...), not at 47.7 MiB.
  const BYTE_INCREMENTS = Array.from({ length: 41 }, (_, i) => 2 ** (i + 10));

  function formatNumber(v, digits = 2) {
    if (v == null || !Number.isFinite(v)) return "—";
    return String(Number(v.toFixed(digits)));
  }

  /** The charts: key, title, unit formatter, and the lines a sample adds ({key, label, value}). */
  const CHARTS = [
    {
      key: "cpu", title: "CPU", unit: "cores", format: (v) => formatNumber(v),
      lines: (s) => [{ key: lineKey(s), who: s, value: s.cpu_cores }],
    },
    {
      key: "memory", title: "Memory", unit: "", format: (v) => (v == null ? "—" : T.formatBytes(v)), bytes: true,
      lines: (s) => [
        { key: lineKey(s), who: s, value: s.memory_bytes },
        { key: `${lineKey(s)}:peak`, who: s, value: s.memory_peak_bytes, peak: true },
        ...(s.memory_limit_bytes ? [{ key: "limit", value: s.memory_limit_bytes, limit: true }] : []),
      ],
    },
    {
      key: "gpu-utilization", title: "GPU utilisation", unit: "%", format: (v) => formatNumber(v, 0), gpu: true,
      lines: (s) => (s.gpus || []).map((g) => ({ key: `${lineKey(s)}:${g.index}`, who: s, gpu: g.index, value: g.utilization })),
    },
    {
      key: "gpu-memory", title: "GPU memory", unit: "", format: (v) => (v == null ? "—" : T.formatBytes(v)), gpu: true, bytes: true,
      lines: (s) => (s.gpus || []).map((g) => ({
        key: `${lineKey(s)}:${g.index}`, who: s, gpu: g.index,
        value: g.learner_memory_bytes ?? g.memory_used_bytes,
      })),
    },
    {
      key: "gpu-power", title: "GPU power", unit: "W", format: (v) => formatNumber(v, 0), gpu: true,
      lines: (s) => (s.gpus || []).map((g) => ({ key: `${lineKey(s)}:${g.index}`, who: s, gpu: g.index, value: g.power_watts })),
    },
  ];

  function lineKey(s) {
    return `${s.attempt}:${s.learner}`;
  }

  class ResourceCharts {
    constructor(section, root, jobId) {
      this.section = section;
      this.root = root;
      this.jobId = jobId;
      this.container = section.querySelector("[data-testid=resource-charts]");
      this.empty = section.querySelector("[data-testid=resources-empty]");
      this.oom = section.querySelector("[data-testid=resources-oom]");
      this.samples = [];
      this.after = 0;
      this.cards = new Map(); // chart key -> {card, body, plot, seriesKey, latest}
      this.loading = false;
      new ResizeObserver(() => this.resize()).observe(this.container);
    }

    start() {
      this.load();
      this.timer = setInterval(() => {
        if (!T.isFinal(this.root.dataset.status) || this.root.dataset.resourcesFinalRead !== "1") this.load();
      }, POLL_MS);
    }

    /** No more polls: the job is gone (deleted while the page was open). */
    stop() {
      clearInterval(this.timer);
    }

    async load() {
      if (this.loading) return;
      this.loading = true;
      const finalBefore = T.isFinal(this.root.dataset.status);
      try {
        let more = true;
        while (more) {
          const page = await T.getJson(`/api/v1/jobs/${encodeURIComponent(this.jobId)}/resources/?after=${this.after}&limit=${PAGE}`);
          this.samples.push(...page.results);
          this.after = page.next_after;
          more = page.more;
        }
        // Once a final job has been read to its end, nothing more will come.
        if (finalBefore) this.root.dataset.resourcesFinalRead = "1";
        this.draw();
      } catch (error) {
        // The next poll tries again; the charts keep what they have.
      } finally {
        this.loading = false;
      }
    }

    draw() {
      this.section.dataset.sampleCount = String(this.samples.length);
      this.empty.hidden = this.samples.length > 0;
      this.renderOom();
      if (!this.samples.length) return;
      const hasGpus = this.samples.some((s) => (s.gpus || []).length);
      for (const chart of CHARTS) {
        if (chart.gpu && !hasGpus) continue;
        this.drawChart(chart);
      }
    }

    renderOom() {
      const reason = this.root.querySelector("[data-testid=job-reason]")?.textContent || "";
      const killed = this.root.dataset.status === "FAILED" && OOM.test(reason);
      this.oom.hidden = !killed;
      if (!killed) return;
      const withLimit = this.samples.filter((s) => s.memory_limit_bytes);
      const last = withLimit[withLimit.length - 1];
      const peak = Math.max(0, ...this.samples.map((s) => s.memory_peak_bytes || 0));
      this.oom.textContent = last
        ? `Killed for exceeding its memory limit of ${T.formatBytes(last.memory_limit_bytes)}: the memory chart `
          + `shows the curve that led there (peak ${T.formatBytes(peak)}).`
        : "Killed for exceeding its memory limit: the memory chart shows the curve that led there.";
    }

    /** {xs (seconds), lines: [{key, label, color, dash, values}]} with at most MAX_DRAWN times. */
    columns(chart) {
      const lines = new Map(); // key -> {meta, points: Map(time -> value)}
      for (const s of this.samples) {
        const t = Date.parse(s.time) / 1000;
        for (const line of chart.lines(s)) {
          let entry = lines.get(line.key);
          if (!entry) { entry = { meta: line, points: new Map() }; lines.set(line.key, entry); }
          entry.points.set(t, line.value);
        }
      }
      const list = [...lines.values()];
      const who = new Set(list.filter((l) => l.meta.who).map((l) => lineKey(l.meta.who)));
      const attempts = new Set(list.filter((l) => l.meta.who).map((l) => l.meta.who.attempt));
      const learners = new Set(list.filter((l) => l.meta.who).map((l) => l.meta.who.learner));
      list.sort((a, b) => (a.meta.limit ? 1 : 0) - (b.meta.limit ? 1 : 0) || a.meta.key.localeCompare(b.meta.key, undefined, { numeric: true }));
      let times = [...new Set(list.flatMap((l) => [...l.points.keys()]))].sort((a, b) => a - b);
      let bucketOf = null;
      if (times.length > MAX_DRAWN) {
        const lo = times[0], width = (times[times.length - 1] - lo) / MAX_DRAWN || 1;
        bucketOf = (t) => Math.min(MAX_DRAWN - 1, Math.floor((t - lo) / width));
        times = Array.from({ length: MAX_DRAWN }, (_, i) => lo + (i + 0.5) * width);
      }
      const index = bucketOf ? null : new Map(times.map((t, i) => [t, i]));
      let colorIndex = 0;
      const colors = new Map();
      const drawn = list.map((line) => {
        const sums = new Float64Array(times.length), counts = new Uint32Array(times.length);
        for (const [t, v] of line.points) {
          if (v == null || !Number.isFinite(v)) continue;
          const i = bucketOf ? bucketOf(t) : index.get(t);
          sums[i] += v;
          counts[i] += 1;
        }
        const values = Array.from(sums, (sum, i) => (counts[i] ? sum / counts[i] : null));
        const meta = line.meta;
        if (meta.limit) return { key: meta.key, label: "limit", color: LIMIT_COLOR, dash: [6, 4], values };
        const base = lineKey(meta.who) + (meta.gpu != null ? `:${meta.gpu}` : "");
        if (!colors.has(base)) colors.set(base, T.CHART_PALETTE[colorIndex++ % T.CHART_PALETTE.length]);
        const parts = [];
        if (attempts.size > 1) parts.push(`attempt ${meta.who.attempt}`);
        if (learners.size > 1 || who.size === 1) parts.push(`learner ${meta.who.learner}`);
        if (meta.gpu != null) parts.push(`GPU ${meta.gpu}`);
        const label = parts.join(" · ") + (meta.peak ? " peak" : "");
        return { key: meta.key, label, color: colors.get(base), dash: meta.peak ? [2, 3] : undefined, width: meta.peak ? 1 : 1.6, values };
      });
      return { xs: times, lines: drawn };
    }

    drawChart(chart) {
      const { xs, lines } = this.columns(chart);
      let entry = this.cards.get(chart.key);
      if (!entry) entry = this.createCard(chart);
      const data = [xs, ...lines.map((l) => l.values)];
      const seriesKey = lines.map((l) => l.key).join("|");
      if (entry.seriesKey !== seriesKey) {
        if (entry.plot) entry.plot.destroy();
        entry.plot = this.createPlot(entry, chart, lines, data);
        entry.seriesKey = seriesKey;
      } else {
        entry.plot.setData(data);
      }
      entry.card.dataset.pointCount = String(xs.length);
      entry.card.dataset.seriesCount = String(lines.length);
      const firstLine = lines.find((l) => l.label !== "limit");
      const lastValue = firstLine ? [...firstLine.values].reverse().find((v) => v != null) : null;
      entry.latest.textContent = lastValue == null ? "" : `${chart.format(lastValue)}${chart.unit && chart.unit !== "%" ? ` ${chart.unit}` : chart.unit}`;
    }

    createCard(chart) {
      const card = document.createElement("figure");
      card.className = "card chart-card";
      card.dataset.testid = "resource-chart";
      card.dataset.chart = chart.key;
      const head = document.createElement("figcaption");
      head.className = "card-head";
      const title = document.createElement("h3");
      title.textContent = chart.unit && chart.unit !== "%" ? `${chart.title} (${chart.unit})` : chart.title;
      const latest = document.createElement("span");
      latest.className = "mono small muted chart-latest";
      head.append(title, latest);
      const body = document.createElement("div");
      body.className = "chart-body";
      body.setAttribute("role", "img");
      body.setAttribute("aria-label", `${chart.title} over time`);
      card.append(head, body);
      this.container.appendChild(card);
      const entry = { card, body, latest, plot: null, seriesKey: null };
      this.cards.set(chart.key, entry);
      return entry;
    }

    createPlot(entry, chart, lines, data) {
      const series = [{ label: "time", value: (u, v) => (v == null ? "—" : T.formatLocalTime(v * 1000, true)) }].concat(
        lines.map((l) => ({
          label: l.label, stroke: l.color, width: l.width || 1.4, dash: l.dash, spanGaps: true,
          points: { show: data[0].length <= 40, size: 4 }, value: (u, v) => chart.format(v),
        })));
      const options = {
        width: Math.max(200, entry.body.clientWidth),
        height: CHART_HEIGHT,
        series,
        scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },
        axes: [{ size: 30 }, { size: 76, values: (u, vals) => vals.map(chart.format), incrs: chart.bytes ? BYTE_INCREMENTS : undefined }],
        legend: { live: true },
        cursor: { sync: { key: `resources-${this.jobId}` }, drag: { x: true, y: false } },
      };
      return new window.uPlot(options, data, entry.body);
    }

    resize() {
      for (const entry of this.cards.values()) {
        if (entry.plot) entry.plot.setSize({ width: Math.max(200, entry.body.clientWidth), height: CHART_HEIGHT });
      }
    }
  }

  T.ResourceCharts = ResourceCharts;
})();
