/* The job list: live status chips over /ws/jobs/ and ticking durations of running jobs. */
(function () {
  "use strict";
  const T = window.Trainyard;

  const table = document.querySelector("[data-testid=jobs-table]");
  const indicator = document.querySelector("[data-testid=connection]");
  let reloadTimer = null;

  function rowOf(jobId) {
    return table ? table.querySelector(`tr[data-job-id="${CSS.escape(String(jobId))}"]`) : null;
  }

  function renderDuration(cell) {
    const ms = T.elapsedMs(cell.dataset.started, cell.dataset.finished);
    cell.textContent = ms == null ? "—" : T.formatDuration(ms);
  }

  function renderAllDurations() {
    if (!table) return;
    for (const cell of table.querySelectorAll("td.duration")) renderDuration(cell);
  }

  /** Only running jobs (started, not finished) change from one second to the next. */
  function tickDurations() {
    if (!table) return;
    for (const cell of table.querySelectorAll('td.duration:not([data-started=""])[data-finished=""]')) {
      renderDuration(cell);
    }
  }

  /**
   * A status change for a job we don't show usually means a new job: reload to show it. A job
   * older than the oldest row of a full table would not appear after a reload either, so skip it.
   */
  function isNewerThanTable(detail) {
    if (!table || !detail || !detail.created_at) return true;
    const rows = table.tBodies[0].rows;
    const oldest = rows.length ? T.parseTime(rows[rows.length - 1].dataset.created) : null;
    const created = T.parseTime(detail.created_at);
    return rows.length < 200 || oldest == null || created == null || created >= oldest;
  }

  function scheduleReload() {
    // Several jobs are often submitted at once: one reload covers them all.
    if (reloadTimer) return;
    reloadTimer = setTimeout(() => location.reload(), 500);
  }

  function applyStatus(message) {
    const row = rowOf(message.job);
    if (!row) {
      if (isNewerThanTable(message.job_detail)) scheduleReload();
      return;
    }
    T.setStatusChip(row.querySelector("[data-testid=job-status]"), message.status, message.reason);
    const detail = message.job_detail;
    const cell = row.querySelector("td.duration");
    if (detail && cell) {
      cell.dataset.started = detail.started_at || "";
      cell.dataset.finished = detail.finished_at || "";
      renderDuration(cell);
    }
  }

  function onMessage(message) {
    if (message.type === "status") applyStatus(message);
  }

  function start() {
    renderAllDurations();
    setInterval(tickDurations, 1000);
    new T.LiveSocket({
      url: () => T.wsUrl("/ws/jobs/"),
      onMessage,
      onState: (state, reason) => T.showConnectionState(indicator, state, reason),
    }).start();
  }

  start();
})();
