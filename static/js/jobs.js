/* The jobs page: live status chips over /ws/jobs/, rows that go as their jobs are deleted, ticking
 * durations of running jobs, fresh results (through htmx, which also drives the filters and pages) when a
 * new job appears, and the jobs selected for "Compare", kept while the reader filters and pages. */
(function () {
  "use strict";
  const T = window.Trainyard;

  const indicator = document.querySelector("[data-testid=connection]");
  let refreshTimer = null;

  const results = () => document.getElementById("jobs-results");
  const table = () => document.querySelector("[data-testid=jobs-table]");

  function rowOf(jobId) {
    const t = table();
    return t ? t.querySelector(`tr[data-job-id="${CSS.escape(String(jobId))}"]`) : null;
  }

  function renderDuration(cell) {
    const ms = T.elapsedMs(cell.dataset.started, cell.dataset.finished);
    cell.textContent = ms == null ? "—" : T.formatDuration(ms);
  }

  function renderAll(root = document) {
    for (const cell of root.querySelectorAll("td.duration")) renderDuration(cell);
    T.localizeTimes(root);
  }

  /** Only running jobs (started, not finished) change from one second to the next. */
  function tickDurations() {
    for (const cell of document.querySelectorAll('td.duration:not([data-started=""])[data-finished=""]')) {
      renderDuration(cell);
    }
  }

  /**
   * A job we don't show is usually a new one. It belongs on the first page of the default view
   * (newest first, unfiltered); anywhere else the reader chose what to look at, so leave it be.
   */
  function showsNewJobs() {
    const el = results();
    return el && el.dataset.firstPage === "true" && el.dataset.defaultView === "true";
  }

  function refreshResults() {
    // Several jobs are often submitted at once: one refresh covers them all.
    if (refreshTimer || !window.htmx) return;
    refreshTimer = setTimeout(() => {
      refreshTimer = null;
      window.htmx.ajax("GET", location.pathname + location.search, { target: "#jobs-results", swap: "outerHTML" });
    }, 400);
  }

  function applyStatus(message) {
    const row = rowOf(message.job);
    if (!row) {
      if (showsNewJobs()) refreshResults();
      return;
    }
    const detail = message.job_detail;
    const reason = message.reason || (detail && detail.wait_reason) || "";
    T.setStatusChip(row.querySelector("[data-testid=job-status]"), message.status, reason);
    const cell = row.querySelector("td.duration");
    if (detail && cell) {
      cell.dataset.started = detail.started_at || "";
      cell.dataset.finished = detail.finished_at || "";
      renderDuration(cell);
    }
  }

  /** Jobs deleted meanwhile (here or anywhere else) leave the list, and the selection for "Compare". */
  function removeDeleted(message) {
    let removed = 0;
    for (const jobId of message.jobs || []) {
      const row = rowOf(jobId);
      if (row) { row.remove(); removed += 1; }
      const at = selected.indexOf(String(jobId));
      if (at >= 0) selected.splice(at, 1);
    }
    if (!removed) return;
    const count = document.querySelector("[data-testid=job-count]");
    const left = count ? Number.parseInt(count.textContent, 10) - removed : NaN;
    if (count && left >= 0) count.textContent = count.textContent.replace(/^\d+ jobs?/, `${left} job${left === 1 ? "" : "s"}`);
    if (compareButton) showSelection();
    // A page left without rows shows the next jobs, or the page for none.
    if (!table().querySelector("tr[data-job-id]")) refreshResults();
  }

  function applyChange(change) {
    if (change.type === "status") applyStatus(change);
    if (change.type === "deleted") removeDeleted(change);
  }

  // --- selecting jobs to compare ---------------------------------------------------------------
  const compareButton = document.querySelector("[data-testid=compare]");
  const compareNote = document.querySelector("[data-testid=compare-note]");
  const selected = []; // job ids in the order they were ticked: the compare page's column order

  function showSelection() {
    const max = Number(compareButton.dataset.max || 8);
    for (const box of document.querySelectorAll("[data-testid=select-job]")) box.checked = selected.includes(box.value);
    compareButton.disabled = selected.length < 2 || selected.length > max;
    compareButton.textContent = selected.length ? `Compare (${selected.length})` : "Compare";
    compareNote.textContent = selected.length === 1 ? "select one more job"
      : selected.length > max ? `at most ${max} jobs at once` : "";
  }

  function onSelect(event) {
    const box = event.target;
    if (!box.matches || !box.matches("[data-testid=select-job]")) return;
    const at = selected.indexOf(box.value);
    if (box.checked && at < 0) selected.push(box.value);
    if (!box.checked && at >= 0) selected.splice(at, 1);
    showSelection();
  }

  function compare(event) {
    event.preventDefault(); // the plain form would send only this page's boxes
    if (selected.length >= 2) location.assign(`/jobs/compare/?ids=${selected.map(encodeURIComponent).join(",")}`);
  }

  function start() {
    renderAll();
    if (compareButton) {
      document.body.addEventListener("change", onSelect);
      compareButton.addEventListener("click", compare);
      showSelection();
    }
    document.body.addEventListener("htmx:afterSettle", () => { renderAll(); if (compareButton) showSelection(); });
    setInterval(tickDurations, 1000);
    new T.LiveSocket({
      url: () => T.wsUrl("/ws/jobs/"),
      onMessage: (message) => {
        // Changes that came within a moment of each other arrive together (jobs.listhub).
        if (message.type === "statuses") message.changes.forEach(applyChange);
        else applyChange(message);
      },
      onState: (state, reason) => T.showConnectionState(indicator, state, reason),
    }).start();
  }

  start();
})();
