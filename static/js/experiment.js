/* An experiment's page: the trials table sorted by a click on a header and filtered by state, trials
 * ticked for Compare, the searcher's metric charted per trial (the job page's charts, one line per trial),
 * the best value over time, and the parallel-coordinates view (parallel.js).
 *
 * The server rendered the header and the table; this script reads GET /api/v1/experiments/<id>/ (then
 * only the trials changed since, `changed_after`) and its metrics/ (from the last point it has, `after`), and until the experiment has finished asks again every
 * few seconds and brings the header, the table and the charts up to date; once finished, now and then,
 * to find it deleted. Pause, Resume and Kill are the template's forms; Delete, which a form cannot send, is
 * sent from here.
 */
(function () {
  "use strict";
  const T = window.Trainyard;
  const root = document.getElementById("experiment-page");
  if (!root) return;

  const experimentId = root.dataset.experimentId;
  const metric = root.dataset.metric;
  const smallerIsBetter = root.dataset.smallerIsBetter === "true";
  const api = (path) => `/api/v1/experiments/${encodeURIComponent(experimentId)}/${path}`;
  const REFRESH_MS = 3000;
  const FINAL_STATES = new Set(["COMPLETED", "TERMINATED"]);
  // The job pages' chip colours (portal/experiment_pages.py STATE_CHIPS).
  const CHIPS = { ACTIVE: "processing", PAUSED: "halted", COMPLETED: "completed", TERMINATED: "terminated",
    running: "processing", paused: "halted", completed: "completed", stopped: "terminated", failed: "failed" };
  const CHIP_CLASSES = [...new Set(Object.values(CHIPS))].map((c) => `status-${c}`);

  const $ = (testid) => root.querySelector(`[data-testid=${testid}]`);
  const ui = {
    state: $("experiment-state"),
    reason: $("experiment-reason"),
    connection: $("connection"),
    best: $("best"),
    trialsStarted: root.querySelector("[data-field=trials-started]"),
    finished: root.querySelector("[data-field=finished]"),
    table: $("trials-table"),
    tbody: $("trials-table").tBodies[0],
    trialCount: $("trial-count"),
    trialsEmpty: $("trials-empty"),
    filter: $("trial-filter"),
    compare: $("compare"),
    compareNote: $("compare-note"),
    actionError: $("action-error"),
    deletedNotice: $("experiment-deleted"),
    chartsStatus: $("charts-status"),
    bestChart: $("best-chart"),
    bestSoFar: $("best-so-far"),
  };

  /** Five significant digits, an exponent only for the very large and small (as jobcharts.js writes them). */
  function formatValue(v) {
    if (v == null || (typeof v === "number" && !Number.isFinite(v))) return "—";
    if (typeof v !== "number") return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-4)) return v.toExponential(3);
    return String(Number(v.toPrecision(5)));
  }

  const better = (a, b) => (smallerIsBetter ? a < b : a > b);
  let state = root.dataset.state;
  // Finished, not just final: a killed experiment is TERMINATED while its trials are still stopping.
  let finished = root.dataset.finished === "true";
  let best = root.dataset.bestTrial === "" ? null : Number(root.dataset.bestTrial);

  /* ------------------------------------------------------------------ sorting and filtering ---- */

  const headers = [...ui.table.tHead.rows[0].cells];
  let sort = null; // {index, dir: 1 | -1}

  function cellValue(row, index) {
    const cell = row.cells[index];
    return cell ? cell.dataset.value ?? "" : "";
  }

  function isNumeric(index) {
    return [...ui.tbody.rows].every((row) => {
      const v = cellValue(row, index);
      return v === "" || Number.isFinite(Number(v));
    });
  }

  function applySort() {
    if (!sort) return;
    const { index, dir } = sort;
    const numeric = isNumeric(index);
    const rows = [...ui.tbody.rows];
    rows.sort((a, b) => {
      const va = cellValue(a, index), vb = cellValue(b, index);
      if (va === "" || vb === "") return (va === "") - (vb === "") || Number(a.dataset.number) - Number(b.dataset.number);
      const order = numeric ? Number(va) - Number(vb) : va.localeCompare(vb);
      return order * dir || Number(a.dataset.number) - Number(b.dataset.number);
    });
    ui.tbody.append(...rows);
  }

  function sortBy(index) {
    const th = headers[index];
    const first = th.dataset.bestFirst === "desc" ? -1 : 1;
    sort = sort && sort.index === index ? { index, dir: -sort.dir } : { index, dir: first };
    headers.forEach((h) => h.removeAttribute("aria-sort"));
    th.setAttribute("aria-sort", sort.dir === 1 ? "ascending" : "descending");
    applySort();
  }

  headers.forEach((th, index) => {
    if (!th.dataset.sort) return;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "sort-button";
    button.dataset.testid = `sort-${th.dataset.sort}`;
    button.append(...th.childNodes);
    button.title = `Sort by ${button.textContent.trim()}${th.title ? ` (${th.title})` : ""}; again to reverse`;
    th.title = "";
    button.addEventListener("click", () => sortBy(index));
    th.appendChild(button);
  });

  function applyFilter() {
    const wanted = ui.filter.value;
    let shown = 0;
    for (const row of ui.tbody.rows) {
      row.hidden = Boolean(wanted) && row.dataset.state !== wanted;
      if (!row.hidden) shown += 1;
    }
    ui.table.dataset.shown = String(shown);
  }

  function countStates() {
    const rows = [...ui.tbody.rows];
    for (const option of ui.filter.options) {
      const count = option.value ? rows.filter((r) => r.dataset.state === option.value).length : rows.length;
      option.textContent = `${option.value || "every state"} (${count})`;
    }
  }

  ui.filter.addEventListener("change", applyFilter);

  /* ------------------------------------------------------------------ compare -------------------- */

  function showSelection() {
    const max = Number(ui.compare.dataset.max || 8);
    const ticked = ui.tbody.querySelectorAll("[data-testid=select-trial]:checked").length;
    ui.compare.disabled = ticked < 2 || ticked > max;
    ui.compare.textContent = ticked ? `Compare (${ticked})` : "Compare";
    ui.compareNote.textContent = ticked === 1 ? "select one more trial" : ticked > max ? `at most ${max} at once` : "";
  }

  ui.tbody.addEventListener("change", (event) => { if (event.target.matches("[data-testid=select-trial]")) showSelection(); });

  /* ------------------------------------------------------------------ the table, live ------------ */

  function setChip(chip, value) {
    chip.classList.remove(...CHIP_CLASSES);
    chip.classList.add(`status-${CHIPS[value] || "queued"}`);
    chip.textContent = value;
    chip.dataset.state = value;
  }

  function cell(row, key) {
    return row.querySelector(`td[data-key=${key}]`);
  }

  function td(key, value, className = "num mono") {
    const el = document.createElement("td");
    el.className = className;
    el.dataset.key = key;
    el.dataset.value = value == null ? "" : String(value);
    return el;
  }

  /** A row for a trial the server did not render (it started since), shaped as the template's. */
  function newRow(trial, varied, milestones) {
    const row = document.createElement("tr");
    row.dataset.number = trial.number;
    row.dataset.jobId = trial.job_id;
    row.dataset.testid = "trial-row";
    const select = document.createElement("td");
    select.className = "select-cell";
    const box = document.createElement("input");
    Object.assign(box, { type: "checkbox", name: "ids", value: trial.job_id });
    box.dataset.testid = "select-trial";
    box.setAttribute("aria-label", `Compare trial ${trial.number} (${trial.job_id})`);
    select.append(box);
    const number = td("number", trial.number, "mono");
    const stateCell = td("state", trial.state, "");
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.dataset.testid = "trial-state";
    stateCell.append(chip);
    const job = td("job", trial.job_status, "");
    const link = document.createElement("a");
    link.className = "mono";
    link.href = `/jobs/${encodeURIComponent(trial.job_id)}/`;
    link.textContent = trial.job_id;
    const status = document.createElement("span");
    status.className = "muted small";
    status.dataset.testid = "job-status";
    job.append(link, " ", status);
    const params = varied.map((name) => {
      const value = trial.params[name];
      const el = td("hp", value);
      el.textContent = formatValue(value);
      return el;
    });
    const value = td("value", null, "num mono metric-col");
    const step = td("step", null);
    row.append(select, number, stateCell, job, ...params, value, step);
    if (milestones.length) row.append(td("rung", 0));
    return row;
  }

  function updateRow(row, trial, milestones) {
    row.dataset.state = trial.state;
    const stateCell = cell(row, "state");
    stateCell.dataset.value = trial.state;
    setChip(stateCell.querySelector(".chip"), trial.state);
    const job = cell(row, "job");
    job.dataset.value = trial.job_status;
    job.querySelector("[data-testid=job-status]").textContent = trial.job_status;
    const value = cell(row, "value");
    value.dataset.value = trial.value == null ? "" : String(trial.value);
    value.textContent = formatValue(trial.value);
    const step = cell(row, "step");
    step.dataset.value = trial.step == null ? "" : String(trial.step);
    step.textContent = trial.step == null ? "—" : String(trial.step);
    const rung = cell(row, "rung");
    if (rung) {
      const reached = Object.keys(trial.rungs || {}).map(Number).sort((a, b) => a - b);
      rung.dataset.value = String(reached.length ? reached[reached.length - 1] + 1 : 0);
      rung.textContent = reached.length ? `${reached[reached.length - 1] + 1} / ${milestones.length}` : "—";
      rung.title = reached.filter((i) => i < milestones.length)
        .map((i) => `step ${milestones[i]}: ${formatValue(trial.rungs[String(i)])}`).join(" · ");
    }
    const isBest = trial.number === best;
    row.classList.toggle("is-best", isBest);
    if (isBest) row.setAttribute("aria-label", "best trial"); else row.removeAttribute("aria-label");
    const numberCell = cell(row, "number");
    numberCell.textContent = String(trial.number);
    if (isBest) {
      const badge = document.createElement("span");
      badge.className = "best-badge";
      badge.dataset.testid = "best-badge";
      badge.textContent = "best";
      numberCell.append(" ", badge);
    }
  }

  function renderTrials(detail) {
    const varied = detail.hyperparameters.filter((hp) => hp.type !== "const").map((hp) => hp.name);
    const milestones = detail.rungs || [];
    const rows = new Map([...ui.tbody.rows].map((row) => [Number(row.dataset.number), row]));
    for (const trial of detail.trials) {
      let row = rows.get(trial.number);
      if (!row) {
        row = newRow(trial, varied, milestones);
        ui.tbody.append(row);
      }
      updateRow(row, trial, milestones);
    }
    ui.trialsEmpty.hidden = detail.trials.length > 0;
    ui.trialCount.textContent = `${detail.trials.length} of at most ${detail.max_trials}`;
    countStates();
    applySort();
    applyFilter();
    showSelection();
  }

  /* ------------------------------------------------------------------ the header, live ----------- */

  function renderHeader(detail) {
    state = detail.state;
    finished = Boolean(detail.finished_at);
    root.dataset.state = state;
    root.dataset.finished = String(finished);
    setChip(ui.state, state);
    ui.reason.textContent = detail.state_reason || "";
    ui.reason.hidden = !detail.state_reason;
    const actions = { pause: state === "ACTIVE", resume: state === "PAUSED", kill: !FINAL_STATES.has(state),
      delete: finished };
    for (const action of root.querySelectorAll("[data-action]")) action.hidden = !actions[action.dataset.action];
    ui.trialsStarted.textContent = String(detail.trials_started);
    if (detail.finished_at) {
      const time = document.createElement("time");
      time.setAttribute("datetime", detail.finished_at);
      ui.finished.replaceChildren(time);
      T.localizeTimes(ui.finished);
    }
    best = detail.best_trial;
    root.dataset.bestTrial = best == null ? "" : String(best);
    const bestTrial = detail.trials.find((t) => t.number === best);
    const value = document.createElement("span");
    value.className = "mono";
    value.dataset.field = "best-value";
    value.textContent = formatValue(detail.best_value);
    const parts = [value];
    if (bestTrial) {
      const link = document.createElement("a");
      link.href = `/jobs/${encodeURIComponent(bestTrial.job_id)}/`;
      link.dataset.testid = "best-trial-link";
      link.textContent = `trial ${bestTrial.number}`;
      parts.push(" ", link);
    }
    ui.best.replaceChildren(...parts);
    document.title = `${state} · ${document.title.replace(/^[A-Z]+ · /, "")}`;
  }

  /* ------------------------------------------------------------------ delete --------------------- */

  function showActionError(text) {
    ui.actionError.textContent = text || "";
    ui.actionError.hidden = !text;
  }

  // The job page's Delete, for the experiment: a deleted experiment has no page left, so it goes to the list.
  async function deleteExperiment(button) {
    const trials = ui.tbody.rows.length;
    const question = `Delete experiment ${experimentId} and its ${trials === 1 ? "trial" : `${trials} trials`}?\n\n` +
      `${trials === 1 ? "Its" : "Their"} code, results, checkpoints, logs and metrics are removed for good; ` +
      `this cannot be undone. ${trials === 1 ? "Its" : "Their"} usage records stay.`;
    if (!window.confirm(question)) return;
    showActionError("");
    button.disabled = true;
    try {
      const response = await fetch(T.inTenant(api("")), {
        method: "DELETE",
        credentials: "same-origin",
        headers: { "X-CSRFToken": T.csrfToken(), Accept: "application/json" },
      });
      const body = await response.json().catch(() => ({}));
      if (!response.ok) {
        showActionError(body.detail || `Could not delete the experiment (HTTP ${response.status}).`);
        return;
      }
      location.assign(T.inTenant("/experiments/"));
    } catch (err) {
      showActionError(`Could not reach the server: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  /** Deleted while the page was open (elsewhere, or by someone else): the page says so, keeps what it
   * shows, and stops asking; its actions are gone with it. */
  function showDeleted() {
    const back = Object.assign(document.createElement("a"),
                               { href: T.inTenant("/experiments/"), textContent: "Back to the experiments" });
    ui.deletedNotice.replaceChildren("This experiment was deleted. Its trials' code, results, checkpoints, logs " +
      "and metrics are being removed; this page shows what it had and no longer follows it. ", back);
    ui.deletedNotice.hidden = false;
    showActionError("");
    for (const action of root.querySelectorAll("[data-action]")) action.hidden = true;
    T.showConnectionState(ui.connection, "deleted", "the experiment was deleted: this page no longer follows it");
    ui.chartsStatus.textContent = "";
    document.title = `deleted · ${document.title.replace(/^[A-Za-z]+ · /, "")}`;
  }

  const deleteButton = $("delete");
  if (deleteButton) deleteButton.addEventListener("click", () => deleteExperiment(deleteButton));

  /* ------------------------------------------------------------------ charts --------------------- */

  const hue = (n) => `hsl(${(n * 137.508) % 360}, 62%, 46%)`; // the golden angle: neighbours differ
  const byTrial = {
    key: (p) => p.trial,
    describe: (p) => ({ trial: p.trial }),
    order: (a, b) => a.trial - b.trial,
    label: (s) => (s.trial === best ? `trial ${s.trial} (best)` : `trial ${s.trial}`),
    color: (s) => (s.trial === best ? "#d97706" : hue(s.trial)),
    width: (s) => (s.trial === best ? 3 : 1.4),
    showLatest: false,
  };
  const trialCharts = new T.Charts($("trial-charts"), $("charts-empty"), byTrial);
  const timeline = []; // every point: [seconds, value], in time order once sorted
  let bestPlot = null;
  let cursor = 0; // the metrics endpoint's `after`
  let drawnBest = best;

  function bestSeries() {
    timeline.sort((a, b) => a[0] - b[0]);
    const xs = [], values = [], bests = [];
    let running = null;
    for (const [x, v] of timeline) {
      if (running == null || better(v, running)) running = v;
      xs.push(x);
      values.push(v);
      bests.push(running);
    }
    return [xs, values, bests];
  }

  function drawBestChart() {
    if (!timeline.length) return;
    ui.bestChart.hidden = false;
    const data = bestSeries();
    const last = data[2][data[2].length - 1];
    ui.bestSoFar.textContent = formatValue(last);
    ui.bestChart.dataset.pointCount = String(timeline.length);
    const body = ui.bestChart.querySelector(".chart-body");
    if (bestPlot) { bestPlot.setData(data); return; }
    bestPlot = new window.uPlot({
      width: Math.max(200, body.clientWidth),
      height: 170,
      series: [
        { label: "time" },
        { label: "reported", stroke: "#9aa3ae", width: 0, paths: () => null,
          points: { show: true, size: 4, fill: "#9aa3ae", stroke: "#9aa3ae" }, value: (u, v) => formatValue(v) },
        { label: "best so far", stroke: "#2f5bea", width: 2, paths: window.uPlot.paths.stepped({ align: 1 }),
          points: { show: false }, value: (u, v) => formatValue(v) },
      ],
      axes: [{}, { size: 54, values: (u, vals) => vals.map(formatValue) }],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
    }, data, body);
    new ResizeObserver(() => bestPlot.setSize({ width: Math.max(200, body.clientWidth), height: 170 })).observe(body);
  }

  async function loadPoints() {
    let added = 0;
    for (;;) { // a long experiment's points come in pages
      const page = await T.getJson(`${api("metrics/")}?after=${cursor}`);
      const points = page.results.filter((p) => Number.isFinite(p.value));
      trialCharts.add(points.map((p) => ({ name: metric, trial: p.trial, step: p.step, value: p.value, time: p.time })));
      for (const p of points) timeline.push([Date.parse(p.time) / 1000, p.value]);
      added += points.length;
      const next = page.next_after ?? cursor;
      if (!page.results.length || next === cursor) break;
      cursor = next;
    }
    return added;
  }

  /* ------------------------------------------------------------------ parallel coordinates ------- */

  const parallel = new T.ParallelCoordinates($("parallel"), $("parallel-empty"), formatValue);

  function drawParallel(detail) {
    const varied = detail.hyperparameters.filter((hp) => hp.type !== "const");
    if (!varied.length) return;
    const values = detail.trials.map((t) => t.value).filter(Number.isFinite);
    const axes = varied.map((hp) => (hp.type === "categorical"
      ? { name: hp.name, kind: "categorical", vals: hp.vals }
      : { name: hp.name, kind: "numeric", log: hp.type === "log", min: hp.minval, max: hp.maxval }));
    axes.push({ name: metric, kind: "numeric", metric: true, invert: smallerIsBetter,
      min: values.length ? Math.min(...values) : null, max: values.length ? Math.max(...values) : null });
    parallel.draw({
      axes,
      best,
      trials: detail.trials.map((t) => ({ number: t.number, values: t.params, value: t.value })),
    });
  }

  ui.tbody.addEventListener("mouseover", (event) => {
    const row = event.target.closest("tr");
    parallel.highlight(row ? Number(row.dataset.number) : null);
  });
  ui.tbody.addEventListener("mouseleave", () => parallel.highlight(null));

  /* ------------------------------------------------------------------ live --------------------- */

  // A finished experiment changes no more, but may still be deleted: the page asks once a minute, and
  // whenever its tab is shown again.
  const FINISHED_REFRESH_MS = 60000;
  let timer = null;
  let refreshing = false;
  let following = true;

  function refreshIn(ms) {
    clearTimeout(timer);
    if (following) timer = setTimeout(refresh, ms);
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !refreshing) refreshIn(0);
  });

  async function refresh() {
    refreshing = true;
    try {
      await refreshOnce();
    } finally {
      refreshing = false;
    }
    // A tab in the background asks less often.
    refreshIn(finished ? FINISHED_REFRESH_MS : document.hidden ? 5 * REFRESH_MS : REFRESH_MS);
  }

  // Every trial as last heard of, by number: after the first answer, each asks only for the trials
  // that changed since the one before (`next_changed_after`), which an experiment of thousands needs.
  const trialsByNumber = new Map();
  let changedAfter = null;

  /** The experiment's answer, its `trials` every trial heard of so far, in number order. */
  async function readDetail() {
    const detail = await T.getJson(api(changedAfter ? `?changed_after=${encodeURIComponent(changedAfter)}` : ""));
    for (const trial of detail.trials) trialsByNumber.set(trial.number, trial);
    detail.trials = [...trialsByNumber.values()].sort((a, b) => a.number - b.number);
    changedAfter = detail.next_changed_after;
    return detail;
  }

  async function refreshOnce() {
    let detail;
    try {
      detail = await readDetail();
      renderHeader(detail);
      renderTrials(detail);
      drawParallel(detail);
      const added = await loadPoints();
      if (added || drawnBest !== best) {
        if (drawnBest !== best && trialCharts.metrics.has(metric)) { // the best's line is drawn apart: redraw
          trialCharts.dirty.add(metric);
        }
        drawnBest = best;
        trialCharts.draw();
        drawBestChart();
      }
      ui.chartsStatus.textContent = finished ? "" : `updated every ${REFRESH_MS / 1000} s`;
      T.showConnectionState(ui.connection, finished ? "ended" : "live");
      root.dataset.loaded = "true";
    } catch (error) {
      if (error.status === 404) {
        following = false;
        showDeleted();
        return;
      }
      T.showConnectionState(ui.connection, "reconnecting", error.message);
      ui.chartsStatus.textContent = `could not refresh: ${error.message}`;
    }
  }

  showSelection();
  refresh();
})();
