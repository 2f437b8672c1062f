/* The live job page: header and status, actions, timeline, checkpoints and results, and the
 * wiring of the log (joblog.js) and charts (jobcharts.js) to the job's websocket.
 *
 * Everything arrives over /ws/jobs/<id>/?since=<seq>: a "job" snapshot first, then the backlog,
 * then live "logs", "metrics" and "status" messages, and "deleted" if the job is deleted meanwhile.
 * After a reconnect the server re-sends the backlog from our last seq (and every metric point); the log
 * and the charts drop duplicates.
 */
(function () {
  "use strict";
  const T = window.Trainyard;

  const root = document.getElementById("job-page");
  if (!root) return;
  const jobId = root.dataset.jobId;
  const api = (path) => `/api/v1/jobs/${encodeURIComponent(jobId)}/${path}`;

  const socket = { state: "connecting", reason: "" };  // the job's websocket (LiveSocket's onState)
  let live = null;  // that websocket's LiveSocket, once started
  const job = {
    deleted: false,
    status: root.dataset.status,
    attempt: Number(root.dataset.attempt) || 1,
    startedAt: root.dataset.started || null,
    finishedAt: root.dataset.finished || null,
  };

  const ui = {
    chip: root.querySelector("[data-testid=job-status]"),
    reason: root.querySelector("[data-testid=job-reason]"),
    connection: root.querySelector("[data-testid=connection]"),
    actions: [...root.querySelectorAll("[data-action]")],
    actionError: root.querySelector("[data-testid=action-error]"),
    deletedNotice: root.querySelector("[data-testid=job-deleted]"),
    clone: root.querySelector("[data-testid=clone]"),
    elapsed: root.querySelector("[data-testid=elapsed]"),
    attempt: root.querySelector("[data-field=attempt]"),
    retries: root.querySelector("[data-field=retries]"),
    exitCode: root.querySelector("[data-field=exit_code]"),
    timeline: root.querySelector("[data-testid=timeline]"),
    timelineSummary: root.querySelector("[data-testid=timeline-summary]"),
    artifacts: root.querySelector("[data-testid=artifacts]"),
    artifactsEmpty: root.querySelector("[data-testid=artifacts-empty]"),
    artifactsMore: root.querySelector("[data-testid=artifacts-more]"),
    artifactsCount: root.querySelector("[data-testid=artifacts-count]"),
  };

  const getJson = T.getJson;

  /* ---------------------------------------------------------------- header & status -------- */

  function renderElapsed() {
    const ms = T.elapsedMs(job.startedAt, job.finishedAt);
    ui.elapsed.textContent = ms == null ? "—" : T.formatDuration(ms);
  }

  /** Why the job is where it is: the status reason, or for a queued job why it waits and where. */
  function reasonOf(detail) {
    if (detail.status === "QUEUED") {
      // The wait reason begins with the job's place; before the scheduler's first cycle has seen the
      // job (a cycle follows each submission) it has neither.
      return detail.wait_reason || detail.status_reason || "waiting for the scheduler's next cycle";
    }
    return detail.status_reason || detail.wait_reason || "";
  }

  function renderReason(reason) {
    ui.reason.textContent = reason || "";
    ui.reason.hidden = !reason;
  }

  function renderStatus(status, reason) {
    const changed = status !== job.status;
    job.status = status;
    root.dataset.status = status;
    T.setStatusChip(ui.chip, status);
    if (reason !== undefined) renderReason(reason);
    renderActions(status);
    renderConnection();
    document.title = `${status} · ${document.title.replace(/^[A-Z]+ · /, "")}`;
    if (changed) { loadTimeline(); loadArtifacts(); }
    // A resize is a new attempt, and its allocation row fills in as the job moves: read it again.
    if (elastic) elastic.setSummary(null, status);
    if (elastic && changed) elastic.reload();
  }

  /** Apply a job snapshot: the REST detail ("job" messages and action answers) or the list form. */
  function applyJob(detail) {
    if (!detail) return;
    if ("started_at" in detail) job.startedAt = detail.started_at;
    if ("finished_at" in detail) job.finishedAt = detail.finished_at;
    if ("attempt" in detail) {
      if (elastic && detail.attempt !== job.attempt) elastic.reload(); // a resize starts the next attempt
      job.attempt = detail.attempt;
      ui.attempt.textContent = detail.attempt;
    }
    if ("retries" in detail) ui.retries.textContent = detail.retries;
    if ("exit_code" in detail) ui.exitCode.textContent = detail.exit_code ?? "—";
    if (detail.status) renderStatus(detail.status, reasonOf(detail));
    if (elastic && "elastic" in detail) elastic.setSummary(detail.elastic, detail.status);
    renderElapsed();
  }

  function applyStatusMessage(message) {
    applyJob(message.job_detail);
    const reason = message.job_detail ? reasonOf(message.job_detail) : message.reason;
    renderStatus(message.status, reason || message.reason || "");
  }

  /* ---------------------------------------------------------------- actions ----------------- */

  // Which buttons a status offers; the server still decides (409 with a reason otherwise).
  const ACTIONS_BY_STATUS = {
    halt: ["PENDING", "DOWNLOADING", "PROCESSING"],
    resume: ["HALTED"],
    terminate: ["QUEUED", "PENDING", "DOWNLOADING", "PROCESSING", "STORING", "HALTING", "HALTED"],
    delete: ["COMPLETED", "FAILED", "TERMINATED", "HALTED"],
  };
  const CONFIRM = {
    halt: (id) => `Halt job ${id}?\n\nIts learners get the checkpoint signal, save, and stop; Resume continues from there.`,
    terminate: (id) => `Terminate job ${id}?\n\nIts learners are stopped now and the job cannot be resumed.`,
    delete: (id) => `Delete job ${id}?\n\nIts code, results, checkpoints, logs and metrics are removed for good; ` +
      "this cannot be undone. Its usage records stay.",
  };
  // How an action is sent and what its answer does, where that differs from POST <action>/ answered
  // with the job. A deleted job has no page left, so deleting goes to the jobs list.
  const REQUESTS = {
    delete: { method: "DELETE", path: "", done: () => location.assign(T.inTenant("/")) },
  };

  // The socket's state is shown as "ended" (no green dot) once the job is final: nothing more will come.
  function renderConnection() {
    if (job.deleted) {
      T.showConnectionState(ui.connection, "deleted", "the job was deleted: this page no longer follows it");
      return;
    }
    const ended = socket.state === "live" && T.isFinal(job.status);
    T.showConnectionState(ui.connection, ended ? "ended" : socket.state,
                          ended ? "the job has ended: everything it recorded is shown" : socket.reason);
  }

  function renderActions(status) {
    for (const button of ui.actions) {
      button.hidden = job.deleted || !(ACTIONS_BY_STATUS[button.dataset.action] || []).includes(status);
    }
    if (ui.clone) ui.clone.hidden = job.deleted;
  }

  /* ---------------------------------------------------------------- deleted ----------------- */

  /** The job was deleted while the page was open (elsewhere, or by someone else): the page says so,
   * keeps what it shows, and stops following the job; its socket would only be refused from now on. */
  function showDeleted(message) {
    job.deleted = true;
    if (live) live.stop();
    resources.stop();
    const ms = T.parseTime(message.time);
    const back = Object.assign(document.createElement("a"), { href: T.inTenant("/"), textContent: "Back to the jobs" });
    ui.deletedNotice.replaceChildren(
      `This job was deleted${ms == null ? "" : ` at ${T.formatLocalTime(ms, true)}`}. Its code, results, ` +
      "checkpoints, logs and metrics are being removed; this page shows what it had and no longer follows it. ",
      back);
    ui.deletedNotice.hidden = false;
    showActionError("");
    renderActions(job.status);
    renderConnection();
    document.title = `deleted · ${document.title.replace(/^[A-Za-z]+ · /, "")}`;
  }

  function showActionError(text) {
    ui.actionError.textContent = text || "";
    ui.actionError.hidden = !text;
  }

  async function runAction(button) {
    const action = button.dataset.action;
    const { method = "POST", path = `${action}/`, done = applyJob } = REQUESTS[action] || {};
    if (CONFIRM[action] && !window.confirm(CONFIRM[action](jobId))) return;
    showActionError("");
    button.disabled = true;
    try {
      const response = await fetch(T.inTenant(api(path)), {
        method,
        credentials: "same-origin",
        headers: { "X-CSRFToken": T.csrfToken(), Accept: "application/json" },
      });
      const body = await response.json().catch(() => ({}));
      if (!response.ok) {
        showActionError(body.detail || `Could not ${action} the job (HTTP ${response.status}).`);
        return;
      }
      done(body);
    } catch (err) {
      showActionError(`Could not reach the server: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  /* ---------------------------------------------------------------- timeline ---------------- */

  let timelineLoading = null;

  function loadTimeline() {
    // One request at a time; a change that arrives meanwhile asks again when it is done.
    if (timelineLoading) { timelineLoading.again = true; return; }
    timelineLoading = { again: false };
    getJson(api("events/"))
      .then((body) => renderTimeline(body.results || []))
      .catch((err) => { ui.timelineSummary.textContent = `could not load: ${err.message}`; })
      .finally(() => {
        const again = timelineLoading.again;
        timelineLoading = null;
        if (again) loadTimeline();
      });
  }

  function renderTimeline(events) {
    const fragment = document.createDocumentFragment();
    let previousAttempt = null;
    for (const e of events) {
      if (previousAttempt !== null && e.attempt !== previousAttempt) {
        const divider = document.createElement("li");
        divider.className = "timeline-attempt";
        divider.textContent = `attempt ${e.attempt}`;
        fragment.appendChild(divider);
      }
      previousAttempt = e.attempt;
      const item = document.createElement("li");
      item.className = "timeline-event";
      const time = document.createElement("time");
      const ms = T.parseTime(e.time);
      time.dateTime = e.time;
      time.textContent = ms == null ? e.time : T.formatLocalTime(ms, true).slice(11);
      time.title = ms == null ? "" : new Date(ms).toString();
      const chip = document.createElement("span");
      T.setStatusChip(chip, e.to_status);
      chip.className += " chip";
      const who = document.createElement("span");
      who.className = "muted small";
      who.textContent = e.actor ? `by ${e.actor}` : "";
      item.append(time, chip, who);
      if (e.reason) {
        const reason = document.createElement("div");
        reason.className = "timeline-reason small";
        reason.textContent = e.reason;
        item.appendChild(reason);
      }
      fragment.appendChild(item);
    }
    ui.timeline.replaceChildren(fragment);
    const attempts = new Set(events.map((e) => e.attempt)).size;
    ui.timelineSummary.textContent = `${events.length} event${events.length === 1 ? "" : "s"}` +
      (attempts > 1 ? `, ${attempts} attempts` : "");
  }

  /* ---------------------------------------------------------------- artifacts --------------- */

  // The API lists a job's files a page at a time (a job may have thousands): the first page on load and
  // on each status change, the next ones when asked for. Two lists (the API's `kind` filter), so the
  // results come first however many checkpoint files sort before them by name.
  const artifactLists = ["result", "checkpoint,log"].map((kind) => ({ kind, items: [], next: null, count: 0 }));

  async function loadArtifacts(more = false) {
    try {
      if (more) {
        const list = artifactLists.find((l) => l.next);  // results first, then checkpoints and logs
        if (list) await readArtifactPage(list, list.next, false);
      } else {
        await Promise.all(artifactLists.map((l) => readArtifactPage(l, api(`artifacts/?kind=${l.kind}`), true)));
      }
    } catch (err) {
      ui.artifactsEmpty.textContent = `Could not load the files: ${err.message}`;
      ui.artifactsEmpty.hidden = false;
      return;
    }
    const loaded = artifactLists.reduce((n, l) => n + l.items.length, 0);
    const total = artifactLists.reduce((n, l) => n + l.count, 0);
    ui.artifactsMore.parentElement.hidden = !artifactLists.some((l) => l.next);
    ui.artifactsCount.textContent = total > loaded ? `${loaded} of ${total} files` : "";
    // Results first (what people come to download), then checkpoints (what resume uses) and logs;
    // within each, newest attempt first.
    const items = artifactLists.flatMap((l) => l.items.slice().sort((a, b) => b.attempt - a.attempt
      || a.name.localeCompare(b.name)));
    const tbody = ui.artifacts.tBodies[0];
    const fragment = document.createDocumentFragment();
    for (const a of items) {
      const row = document.createElement("tr");
      const name = document.createElement("td");
      const link = document.createElement("a");
      link.href = a.url;
      link.textContent = a.name.replace(/^(results|checkpoints)\//, "");
      link.title = `Download ${a.name} (sha256 ${a.sha256})`;
      link.setAttribute("download", "");
      name.appendChild(link);
      if (!a.complete) name.append(" ", Object.assign(document.createElement("span"), { className: "muted small", textContent: "(incomplete)" }));
      const kind = Object.assign(document.createElement("td"), { textContent: a.kind });
      const attempt = Object.assign(document.createElement("td"), { className: "num", textContent: a.attempt });
      const size = Object.assign(document.createElement("td"), { className: "num mono", textContent: T.formatBytes(a.size) });
      row.append(name, kind, attempt, size);
      fragment.appendChild(row);
    }
    tbody.replaceChildren(fragment);
    ui.artifactsEmpty.hidden = items.length > 0;
    ui.artifacts.hidden = items.length === 0;
  }

  async function readArtifactPage(list, url, fresh) {
    const page = await getJson(url);
    list.items = (fresh ? [] : list.items).concat(page.results || []);
    list.next = page.next || null;
    list.count = page.count || 0;
  }

  /* ---------------------------------------------------------------- wiring ----------------- */

  const logView = new T.LogView(root, { jobId, learners: Number(root.dataset.learners) || 1 });
  const logIntake = new T.LogIntake(logView, jobId);
  const charts = new T.Charts(root.querySelector("[data-testid=charts]"), root.querySelector("[data-testid=charts-empty]"));

  const elasticSection = root.querySelector("[data-testid=elastic]");
  const elastic = elasticSection ? new T.ElasticChart(elasticSection, jobId) : null;

  const resources = new T.ResourceCharts(root.querySelector("[data-testid=resources]"), root, jobId);

  // For the console and the browser tests, which feed the log and charts without a real job.
  T.page = { logView, logIntake, charts, elastic, resources };

  function onMessage(message) {
    switch (message.type) {
      case "job": applyJob(message.job); break;
      case "logs": logIntake.receive(message.lines || []); break;
      case "metrics":
        charts.add(message.points || []);
        if (elastic) elastic.addPoints(message.points || []);
        break;
      case "status": applyStatusMessage(message); break;
      case "deleted": showDeleted(message); break;
      default: break; // newer servers may send more; ignoring them keeps old pages working
    }
  }

  function start() {
    for (const button of ui.actions) button.addEventListener("click", () => runAction(button));
    // "/" searches the log, as in most log viewers (unless the reader is typing somewhere).
    document.addEventListener("keydown", (event) => {
      const typing = event.target.closest("input, textarea, select, [contenteditable]");
      if (event.key === "/" && !typing && !event.ctrlKey && !event.metaKey) {
        event.preventDefault();
        root.querySelector("[data-testid=log-search]").focus();
      }
    });
    renderActions(job.status);
    renderElapsed();
    setInterval(() => { if (job.startedAt && !job.finishedAt) renderElapsed(); }, 1000);
    loadTimeline();
    loadArtifacts();
    ui.artifactsMore.addEventListener("click", () => loadArtifacts(true));
    if (elastic) { elastic.reload(); setInterval(() => elastic.tick(), 5000); }
    resources.start();
    live = new T.LiveSocket({
      url: () => T.wsUrl(`/ws/jobs/${encodeURIComponent(jobId)}/?since=${logIntake.lastSeq}`),
      onMessage,
      onState: (state, reason) => { Object.assign(socket, { state, reason }); renderConnection(); },
    });
    live.start();
  }

  start();
})();
