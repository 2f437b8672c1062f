/* The compare page (/jobs/compare/?ids=a,b,c): one chart per metric with one line per job, drawn by
 * the job page's chart code from GET /api/v1/jobs/compare/ (the same comparison whose table the
 * server rendered). Line colours follow the jobs' order, as the swatches in the table do. While any of
 * the jobs runs it asks again every few seconds and redraws, with the final values and statuses. */
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

  /** Running or queued: its lines can still grow (HALTED waits for someone to resume it). */
  const moving = (job) => !T.isFinal(job.status) && job.status !== "HALTED";

  /** The table's cells that change while jobs run: each metric's final value, and the status row. */
  function updateTable(comparison) {
    for (const metric of comparison.metrics) {
      const row = root.querySelector(`[data-testid=final-row][data-metric="${CSS.escape(metric.name)}"]`);
      if (row) row.querySelectorAll("td").forEach((cell, i) => { cell.textContent = formatFinal(metric.final[i]); });
    }
    const statusRow = root.querySelector("[data-testid=diff-row][data-key=status]");
    if (statusRow) statusRow.querySelectorAll("td").forEach((cell, i) => { cell.textContent = comparison.jobs[i].status; });
  }

  function formatFinal(value) {
    return value == null ? "—" : String(Number(value.toPrecision(6)));
  }

  let charts = null;

  async function refresh() {
    const status = root.querySelector("[data-testid=charts-status]");
    try {
      const comparison = await T.getJson("/api/v1/jobs/compare/" + location.search);
      if (!charts) {
        charts = new T.Charts(root.querySelector("[data-testid=charts]"),
          root.querySelector("[data-testid=charts-empty]"), byJob(comparison.jobs));
      }
      charts.clear(); // thinned and averaged lines are chosen afresh each time: redraw, never merge
      charts.add(pointsOf(comparison));
      charts.draw();
      updateTable(comparison);
      const lines = comparison.metrics.flatMap((m) => m.series);
      const averaged = lines.some((s) => s.averaged);
      const running = comparison.jobs.filter(moving).length;
      status.textContent = [
        lines.some((s) => s.thinned) ? `long runs are ${averaged ? "averaged" : "thinned"} to ${comparison.limits.max_points} points per line` : "",
        running ? `${running} still running: updated every ${REFRESH_MS / 1000} s` : "",
      ].filter(Boolean).join(" · ");
      root.dataset.loaded = "true";
      root.dataset.running = String(running);
      if (running) setTimeout(refresh, REFRESH_MS);
    } catch (error) {
      if (error.message === "HTTP 429") { // the tenant's other comparisons are running: a moment later
        status.textContent = "waiting for the tenant's other comparisons to finish…";
        setTimeout(refresh, REFRESH_MS);
        return;
      }
      status.textContent = `could not load the metrics: ${error.message}`;
      root.dataset.loaded = "error";
    }
  }

  const REFRESH_MS = 3000;
  refresh();
})();
