/* The compare page (/jobs/compare/?ids=a,b,c): one chart per metric with one line per job, drawn by
 * the job page's chart code from GET /api/v1/jobs/compare/ (the same comparison whose table the
 * server rendered). Line colours follow the jobs' order, as the swatches in the table do. */
(function () {
  "use strict";
  const T = window.Trainyard;
  const root = document.getElementById("compare-page");
  if (!root) return;

  function byJob(jobs) {
    const index = new Map(jobs.map((job, i) => [job.id, i]));
    const names = jobs.map((job) => job.name);
    const unique = new Set(names).size === names.length;
    return {
      key: (p) => p.job,
      describe: (p) => ({ job: p.job, index: index.get(p.job) }),
      order: (a, b) => a.index - b.index,
      label: (s) => {
        const job = jobs[s.index];
        return unique ? job.name : `${job.name} · ${job.id}`;
      },
      color: (s) => T.CHART_PALETTE[s.index % T.CHART_PALETTE.length],
      showLatest: false,
    };
  }

  function pointsOf(comparison) {
    const points = [];
    for (const metric of comparison.metrics) {
      for (const series of metric.series) {
        for (const [step, value] of series.points) {
          points.push({ name: metric.name, job: series.job, step, value: value == null ? NaN : value });
        }
      }
    }
    return points;
  }

  async function start() {
    const status = root.querySelector("[data-testid=charts-status]");
    try {
      const comparison = await T.getJson("/api/v1/jobs/compare/" + location.search);
      const charts = new T.Charts(root.querySelector("[data-testid=charts]"),
        root.querySelector("[data-testid=charts-empty]"), byJob(comparison.jobs));
      charts.add(pointsOf(comparison));
      charts.draw();
      const lines = comparison.metrics.flatMap((m) => m.series);
      const averaged = lines.some((s) => s.averaged);
      status.textContent = lines.some((s) => s.thinned)
        ? `long runs are ${averaged ? "averaged" : "thinned"} to ${comparison.limits.max_points} points per line` : "";
      root.dataset.loaded = "true";
    } catch (error) {
      status.textContent = `could not load the metrics: ${error.message}`;
      root.dataset.loaded = "error";
    }
  }

  start();
})();
