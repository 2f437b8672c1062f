/* The live job page: header and status, the loss chart and latest metrics, and the log.
 *
 * Everything arrives over /ws/jobs/<id>/?since=<seq>: a "job" snapshot first, then the backlog,
 * then live "logs", "metrics" and "status" messages. After a reconnect the server re-sends the
 * backlog from our last seq (and every metric point), so the page de-duplicates both.
 */
(function () {
  "use strict";
  const T = window.Trainyard;

  const MAX_LOG_LINES = 20000; // DOM cap: beyond this, scrolling and appending get sluggish
  // Lines live in blocks of this many; off-screen blocks skip layout (content-visibility), which
  // keeps an append at the cap from re-laying out all 20,000 lines.
  const LOG_BLOCK_LINES = 250;
  const GAP_FETCH_LIMIT = 10000; // the API's own maximum per request
  const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

  const root = document.getElementById("job-page");
  if (!root) return;
  const jobId = root.dataset.jobId;

  const job = {
    id: jobId,
    status: root.dataset.status,
    learners: Number(root.dataset.learners) || 1,
    startedAt: root.dataset.started || null,
    finishedAt: root.dataset.finished || null,
  };

  const ui = {
    chip: root.querySelector("[data-testid=job-status]"),
    reason: root.querySelector("[data-testid=job-reason]"),
    connection: root.querySelector("[data-testid=connection]"),
    actions: [...root.querySelectorAll("[data-action]")],
    actionError: root.querySelector("[data-testid=action-error]"),
    elapsed: root.querySelector("[data-testid=elapsed]"),
    attempt: root.querySelector("[data-field=attempt]"),
    exitCode: root.querySelector("[data-field=exit_code]"),
  };

  /* ---------------------------------------------------------------- header & status -------- */

  function renderElapsed() {
    const ms = T.elapsedMs(job.startedAt, job.finishedAt);
    ui.elapsed.textContent = ms == null ? "—" : T.formatDuration(ms);
  }

  function renderReason(reason) {
    ui.reason.textContent = reason || "";
    ui.reason.hidden = !reason;
  }

  function renderStatus(status, reason) {
    job.status = status;
    root.dataset.status = status;
    T.setStatusChip(ui.chip, status);
    if (reason !== undefined) renderReason(reason);
    renderActions(status);
  }

  /** Apply a job snapshot: the REST detail ("job" messages) or the list form (status.job_detail). */
  function applyJob(detail) {
    if (!detail) return;
    if ("learners" in detail) job.learners = Number(detail.learners) || 1;
    if ("started_at" in detail) job.startedAt = detail.started_at;
    if ("finished_at" in detail) job.finishedAt = detail.finished_at;
    if ("attempt" in detail) ui.attempt.textContent = detail.attempt;
    if ("exit_code" in detail) ui.exitCode.textContent = detail.exit_code ?? "—";
    let reason = detail.status_reason || detail.wait_reason || "";
    if (!reason && detail.status === "QUEUED" && detail.queue_position) {
      reason = `Position ${detail.queue_position} in the queue`;
    }
    if (detail.status) renderStatus(detail.status, reason);
    renderElapsed();
    if (detail.latest_metrics) metrics.seedLatest(detail.latest_metrics);
  }

  function applyStatusMessage(message) {
    applyJob(message.job_detail);
    renderStatus(message.status, message.reason || (message.job_detail && message.job_detail.wait_reason) || "");
    if ("attempt" in message) ui.attempt.textContent = message.attempt;
    if ("exit_code" in message) ui.exitCode.textContent = message.exit_code ?? "—";
  }

  function showActionError(text) {
    ui.actionError.textContent = text || "";
    ui.actionError.hidden = !text;
  }

  // Which buttons a status offers; the server still decides (409 with a reason otherwise).
  const ACTIONS_BY_STATUS = {
    halt: ["PENDING", "DOWNLOADING", "PROCESSING"],
    resume: ["HALTED"],
    terminate: ["QUEUED", "PENDING", "DOWNLOADING", "PROCESSING", "STORING", "HALTING", "HALTED"],
  };
  const CONFIRM = {
    halt: (id) => `Halt job ${id}?\n\nIts learners get the checkpoint signal, save, and stop; resume continues from there.`,
    terminate: (id) => `Terminate job ${id}?\n\nIts learners are stopped now and the job cannot be resumed.`,
  };

  function renderActions(status) {
    for (const button of ui.actions) {
      button.hidden = !(ACTIONS_BY_STATUS[button.dataset.action] || []).includes(status);
    }
  }

  async function runAction(button) {
    const action = button.dataset.action;
    if (CONFIRM[action] && !window.confirm(CONFIRM[action](jobId))) return;
    showActionError("");
    button.disabled = true;
    try {
      const response = await fetch(`/api/v1/jobs/${encodeURIComponent(jobId)}/${action}/`, {
        method: "POST",
        credentials: "same-origin",
        headers: { "X-CSRFToken": T.csrfToken(), Accept: "application/json" },
      });
      const body = await response.json().catch(() => ({}));
      if (!response.ok) {
        showActionError(body.detail || `Could not ${action} the job (HTTP ${response.status}).`);
        return;
      }
      applyJob(body);
    } catch (err) {
      showActionError(`Could not reach the server: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  /* ---------------------------------------------------------------- log view --------------- */

  /**
   * The log pane: batches appends per animation frame, caps the DOM, and follows the tail.
   * DOM: .log > .lblock (up to LOG_BLOCK_LINES log lines, plus any markers) > .ll rows.
   */
  class LogView {
    constructor(el, { followBox, wrapBox, summary }) {
      this.el = el;
      this.followBox = followBox;
      this.summary = summary;
      this.pending = []; // lines and markers waiting for the next frame
      this.frame = 0;
      this.shown = 0; // log lines in the DOM (markers excluded)
      this.lastUserIntent = 0;

      followBox.addEventListener("change", () => { if (followBox.checked) this.scrollToBottom(); });
      wrapBox.addEventListener("change", () => {
        el.classList.toggle("nowrap", !wrapBox.checked);
        if (this.following) this.scrollToBottom();
      });
      // Only input from the user may turn following on again; our own scrolling must not.
      const noteIntent = () => { this.lastUserIntent = Date.now(); };
      el.addEventListener("wheel", (event) => {
        noteIntent();
        if (event.deltaY < 0) this.setFollow(false); // before the next append scrolls it back down
      }, { passive: true });
      el.addEventListener("touchmove", noteIntent, { passive: true });
      el.addEventListener("pointerdown", noteIntent);
      el.addEventListener("pointermove", (event) => { if (event.buttons) noteIntent(); }); // scrollbar drags
      el.addEventListener("keydown", noteIntent);
      el.addEventListener("scroll", () => this.onScroll(), { passive: true });
      new ResizeObserver(() => { if (this.following) this.scrollToBottom(); }).observe(el);
    }

    get following() {
      return this.followBox.checked;
    }

    setFollow(on) {
      if (this.followBox.checked !== on) this.followBox.checked = on;
    }

    isAtBottom() {
      return this.el.scrollHeight - this.el.scrollTop - this.el.clientHeight < 4;
    }

    /**
     * Scroll events also come from our own appends and from layout changes (resizes, trimmed
     * lines); only a scroll the user just caused may switch following on or off.
     */
    onScroll() {
      if (Date.now() - this.lastUserIntent > 500) return;
      this.setFollow(this.isAtBottom());
    }

    scrollToBottom() {
      this.el.scrollTop = this.el.scrollHeight;
    }

    append(lines) {
      for (const line of lines) this.pending.push(line);
      this.schedule();
    }

    addMarker(text) {
      this.pending.push({ marker: text });
      this.schedule();
    }

    schedule() {
      // In a background tab frames stop; keep only what could still be shown once they resume.
      if (this.pending.length > MAX_LOG_LINES * 2) this.pending.splice(0, this.pending.length - MAX_LOG_LINES);
      if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
    }

    flush() {
      this.frame = 0;
      let batch = this.pending;
      this.pending = [];
      if (batch.length > MAX_LOG_LINES) batch = batch.slice(batch.length - MAX_LOG_LINES);
      let block = this.el.lastElementChild;
      let fragment = null; // rows for the current block, inserted in one go
      const fill = () => { if (fragment) block.appendChild(fragment); fragment = null; };
      for (const item of batch) {
        if (!block || block.lineCount >= LOG_BLOCK_LINES) {
          fill();
          block = this.newBlock();
        }
        fragment ??= document.createDocumentFragment();
        if (item.marker) {
          fragment.appendChild(this.renderMarker(item.marker));
        } else {
          fragment.appendChild(this.renderLine(item));
          block.lineCount += 1;
          this.shown += 1;
        }
      }
      fill();
      this.trim();
      this.el.dataset.lineCount = String(this.shown);
      this.renderSummary();
      if (this.following) this.scrollToBottom();
    }

    newBlock() {
      const block = document.createElement("div");
      block.className = "lblock";
      block.lineCount = 0;
      this.el.appendChild(block);
      return block;
    }

    renderLine(line) {
      const row = document.createElement("div");
      row.className = line.stream === "stderr" ? "ll err" : "ll";
      row.title = line.time || "";
      const seq = document.createElement("span");
      seq.className = "ln";
      seq.textContent = line.seq;
      const text = document.createElement("span");
      text.className = "lt";
      if (job.learners > 1) {
        const prefix = document.createElement("span");
        prefix.className = "lp";
        prefix.textContent = `[learner ${line.learner}] `;
        text.appendChild(prefix);
      }
      text.appendChild(document.createTextNode(line.line));
      row.append(seq, text);
      return row;
    }

    renderMarker(text) {
      const row = document.createElement("div");
      row.className = "ll marker";
      row.textContent = text;
      return row;
    }

    /** Drop the oldest lines past the cap, keeping what the reader is looking at in place. */
    trim() {
      let excess = this.shown - MAX_LOG_LINES;
      if (excess <= 0) return;
      const heightBefore = this.following ? 0 : this.el.scrollHeight;
      this.shown -= excess;
      // Whole blocks first (cheap), then single rows from the new first block.
      let block = this.el.firstElementChild;
      while (block && block.lineCount <= excess) {
        excess -= block.lineCount;
        const next = block.nextElementSibling;
        block.remove();
        block = next;
      }
      while (block && excess > 0) {
        const row = block.firstElementChild;
        if (!row.classList.contains("marker")) { excess -= 1; block.lineCount -= 1; }
        row.remove();
      }
      if (!this.following) this.el.scrollTop -= heightBefore - this.el.scrollHeight;
    }

    renderSummary() {
      const n = this.shown.toLocaleString();
      this.summary.textContent = this.shown >= MAX_LOG_LINES ? `last ${n} lines` : `${n} lines`;
    }
  }

  /* ---------------------------------------------------------------- log intake ------------- */

  /**
   * Puts lines in seq order into the view, exactly once. Batches are handled one after another
   * (a gap fetch is async and must finish before later lines go in).
   */
  class LogIntake {
    constructor(view) {
      this.view = view;
      this.lastSeq = 0; // highest seq handed to the view; the websocket resumes from here
      this.queue = Promise.resolve();
    }

    receive(lines) {
      this.queue = this.queue
        .then(() => this.ingest(lines))
        .catch((err) => console.error("trainyard: log intake failed", err));
    }

    async ingest(lines) {
      const fresh = lines.filter((l) => l.seq > this.lastSeq).sort((a, b) => a.seq - b.seq);
      if (!fresh.length) return;
      const first = fresh[0].seq;
      if (first > this.lastSeq + 1) {
        if (this.lastSeq === 0) {
          // A fresh page gets only the tail of a long log from the backlog; that is not a gap.
          this.view.addMarker(`… ${(first - 1).toLocaleString()} earlier lines not shown ` +
            `(trainyard logs ${jobId} prints the whole log)`);
        } else {
          await this.fillGap(first);
        }
      }
      this.accept(fresh);
    }

    accept(lines) {
      const fresh = lines.filter((l) => l.seq > this.lastSeq);
      if (!fresh.length) return;
      this.lastSeq = fresh[fresh.length - 1].seq;
      this.view.append(fresh);
    }

    /** Fetch the lines between lastSeq and `nextSeq` over REST (missed while reconnecting). */
    async fillGap(nextSeq) {
      const missing = nextSeq - 1 - this.lastSeq;
      if (missing > MAX_LOG_LINES) {
        // Fetching lines only to trim them from the DOM right away would be wasted work.
        const skipTo = nextSeq - 1 - MAX_LOG_LINES;
        this.view.addMarker(`… ${(skipTo - this.lastSeq).toLocaleString()} lines skipped`);
        this.lastSeq = skipTo;
      }
      while (this.lastSeq < nextSeq - 1) {
        const since = this.lastSeq;
        let data;
        try {
          const url = `/api/v1/jobs/${encodeURIComponent(jobId)}/logs/?since=${since}&limit=${GAP_FETCH_LIMIT}`;
          const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
          if (!response.ok) throw new Error(`HTTP ${response.status}`);
          data = await response.json();
        } catch (err) {
          this.view.addMarker(`… lines ${since + 1}–${nextSeq - 1} could not be loaded (${err.message})`);
          return;
        }
        this.accept(data.results || []);
        if (this.lastSeq === since) return; // nothing newer stored: the gap is permanent
      }
    }
  }

  /* ---------------------------------------------------------------- metrics ---------------- */

  const isLoss = (name) => String(name).toLowerCase().includes("loss");

  /** Every metric point once, grouped into series by (name, learner), plus each name's latest value. */
  class MetricStore {
    constructor() {
      this.seen = new Set();
      this.series = new Map(); // "name\u0000learner" -> {name, learner, points: [{x, y}], sorted}
      this.latest = new Map(); // name -> {value, step}
    }

    /** Adds points; returns which views need redrawing. */
    add(points) {
      let loss = false;
      let latest = false;
      for (const p of points) {
        const key = `${p.name}\u0000${p.step}\u0000${p.learner}\u0000${p.time}`;
        if (this.seen.has(key)) continue;
        this.seen.add(key);
        this.latest.set(p.name, { value: p.value, step: p.step });
        latest = true;
        if (isLoss(p.name) && Number.isFinite(p.value)) {
          this.addToSeries(p);
          loss = true;
        }
      }
      return { loss, latest };
    }

    addToSeries(p) {
      const key = `${p.name}\u0000${p.learner}`;
      let s = this.series.get(key);
      if (!s) {
        s = { name: p.name, learner: p.learner, points: [], sorted: true, color: PALETTE[this.series.size % PALETTE.length] };
        this.series.set(key, s);
      }
      const x = p.step ?? s.points.length; // no step: plot against the point's index
      const prev = s.points[s.points.length - 1];
      if (prev && x < prev.x) s.sorted = false;
      s.points.push({ x, y: p.value });
    }

    seedLatest(latestMetrics) {
      for (const [name, m] of Object.entries(latestMetrics)) this.latest.set(name, { value: m.value, step: m.step });
    }

    /** Series in first-seen order, sorted by x, labelled by name (and learner when several report it). */
    lossSeries() {
      const learnersByName = new Map();
      for (const s of this.series.values()) {
        learnersByName.set(s.name, (learnersByName.get(s.name) || 0) + 1);
      }
      const list = [];
      for (const s of this.series.values()) {
        if (!s.sorted) {
          s.points.sort((a, b) => a.x - b.x);
          s.sorted = true;
        }
        s.label = learnersByName.get(s.name) > 1 ? `${s.name} · learner ${s.learner}` : s.name;
        list.push(s);
      }
      return list;
    }

    colorOf(name) {
      for (const s of this.series.values()) if (s.name === name) return s.color;
      return null;
    }
  }

  function formatValue(v) {
    if (v == null || !Number.isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-4)) return v.toExponential(3);
    return String(Number(v.toPrecision(5)));
  }

  function renderMetricsTable(store, table, emptyNote) {
    const tbody = table.tBodies[0];
    const names = [...store.latest.keys()].sort((a, b) => a.localeCompare(b));
    const fragment = document.createDocumentFragment();
    for (const name of names) {
      const m = store.latest.get(name);
      const row = document.createElement("tr");
      row.dataset.metric = name;
      const nameCell = document.createElement("td");
      const color = store.colorOf(name);
      if (color) {
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = color;
        nameCell.appendChild(swatch);
      }
      nameCell.appendChild(document.createTextNode(name));
      const valueCell = document.createElement("td");
      valueCell.className = "num mono";
      valueCell.textContent = formatValue(m.value);
      valueCell.title = String(m.value);
      const stepCell = document.createElement("td");
      stepCell.className = "num mono muted";
      stepCell.textContent = m.step ?? "—";
      row.append(nameCell, valueCell, stepCell);
      fragment.appendChild(row);
    }
    tbody.replaceChildren(fragment);
    emptyNote.hidden = names.length > 0;
  }

  /* ---------------------------------------------------------------- chart ------------------ */

  /** 1, 2 or 5 times a power of ten: the step between ticks that reads best. */
  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const power = 10 ** Math.floor(Math.log10(raw));
    const f = raw / power;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * power;
  }

  function linearTicks(min, max, count, integer = false) {
    const step = integer ? Math.max(1, niceStep(max - min, count)) : niceStep(max - min, count);
    const ticks = [];
    for (let v = Math.ceil(min / step) * step; v <= max + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
    return { ticks, step };
  }

  /** Powers of ten, or 1-2-5 multiples when the range spans less than about two decades. */
  function logTicks(min, max) {
    const lo = Math.floor(Math.log10(min));
    const hi = Math.ceil(Math.log10(max));
    const multiples = hi - lo <= 2 ? [1, 2, 5] : [1];
    const ticks = [];
    for (let e = lo; e <= hi; e += 1) {
      for (const m of multiples) {
        const v = Number((m * 10 ** e).toPrecision(12));
        if (v >= min && v <= max) ticks.push(v);
      }
    }
    return ticks.length >= 2 ? ticks : linearTicks(min, max, 4).ticks.filter((v) => v > 0);
  }

  function formatTick(v, step) {
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(0);
    if (!step) return String(Number(v.toPrecision(3))); // log-scale ticks: 0.02, 0.1, 50
    const decimals = step ? Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9))) : 2;
    return v.toFixed(decimals);
  }

  function formatStep(v) {
    const a = Math.abs(v);
    if (a >= 1e6) return `${Number((v / 1e6).toPrecision(3))}M`;
    if (a >= 1e4) return `${Number((v / 1e3).toPrecision(3))}k`;
    return String(Number(v.toPrecision(6)));
  }

  /** Nearest point to x in a series sorted by x (binary search). */
  function nearest(points, x) {
    let lo = 0;
    let hi = points.length - 1;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (points[mid].x < x) lo = mid; else hi = mid;
    }
    return Math.abs(points[lo].x - x) <= Math.abs(points[hi].x - x) ? points[lo] : points[hi];
  }

  /** Line chart on a <canvas>: one line per series, axes with ticks, HTML legend and tooltip. */
  class LossChart {
    constructor(canvas, { legend, empty, tooltip, logToggle }) {
      this.canvas = canvas;
      this.legend = legend;
      this.empty = empty;
      this.tooltip = tooltip;
      this.logToggle = logToggle;
      this.series = [];
      this.frame = 0;
      this.hoverX = null; // CSS px within the canvas, or null
      this.layout = null;
      this.legendKey = "";

      logToggle.addEventListener("change", () => this.requestDraw());
      new ResizeObserver(() => this.requestDraw()).observe(canvas);
      canvas.addEventListener("mousemove", (e) => { this.hoverX = e.offsetX; this.requestDraw(); });
      canvas.addEventListener("mouseleave", () => { this.hoverX = null; this.requestDraw(); });
    }

    setSeries(series) {
      this.series = series;
      this.requestDraw();
    }

    requestDraw() {
      if (!this.frame) this.frame = requestAnimationFrame(() => { this.frame = 0; this.draw(); });
    }

    /** Canvas backing store in device pixels, so lines stay crisp on HiDPI screens. */
    prepareContext() {
      const dpr = window.devicePixelRatio || 1;
      const width = this.canvas.clientWidth;
      const height = this.canvas.clientHeight;
      if (this.canvas.width !== Math.round(width * dpr) || this.canvas.height !== Math.round(height * dpr)) {
        this.canvas.width = Math.round(width * dpr);
        this.canvas.height = Math.round(height * dpr);
      }
      const ctx = this.canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, width, height);
      return { ctx, width, height };
    }

    bounds(useLog) {
      let xMin = Infinity, xMax = -Infinity, yMin = Infinity, yMax = -Infinity;
      for (const s of this.series) {
        for (const p of s.points) {
          if (useLog && p.y <= 0) continue;
          if (p.x < xMin) xMin = p.x;
          if (p.x > xMax) xMax = p.x;
          if (p.y < yMin) yMin = p.y;
          if (p.y > yMax) yMax = p.y;
        }
      }
      if (xMin === xMax) { xMin -= 1; xMax += 1; }
      if (yMin === yMax) {
        const pad = Math.abs(yMin) * 0.1 || 1;
        yMin = useLog ? yMin / 2 : yMin - pad;
        yMax = useLog ? yMax * 2 : yMax + pad;
      } else if (!useLog) {
        const pad = (yMax - yMin) * 0.05;
        yMin = yMin >= 0 && yMin - pad < 0 ? 0 : yMin - pad; // a loss never dips below zero
        yMax += pad;
      }
      return { xMin, xMax, yMin, yMax };
    }

    draw() {
      const total = this.series.reduce((n, s) => n + s.points.length, 0);
      this.canvas.dataset.pointCount = String(total);
      this.empty.hidden = total > 0;
      this.renderLegend();

      const allPositive = this.series.every((s) => s.points.every((p) => p.y > 0));
      this.logToggle.disabled = !allPositive;
      const useLog = this.logToggle.checked && allPositive;

      const { ctx, width, height } = this.prepareContext();
      if (!total || width < 50 || height < 50) { this.tooltip.hidden = true; return; }

      const b = this.bounds(useLog);
      const yTicks = useLog ? { ticks: logTicks(b.yMin, b.yMax), step: null } : linearTicks(b.yMin, b.yMax, 5);
      ctx.font = "11px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
      const labelWidth = Math.max(...yTicks.ticks.map((t) => ctx.measureText(formatTick(t, yTicks.step)).width), 10);
      // Room on the right for half of the last step label, which is centred on its tick.
      const rightPad = Math.max(12, Math.ceil(ctx.measureText(formatStep(b.xMax)).width / 2) + 4);
      const plot = { left: Math.ceil(labelWidth) + 14, right: width - rightPad, top: 10, bottom: height - 26 };
      const fy = useLog ? Math.log10 : (v) => v;
      const [y0, y1] = [fy(b.yMin), fy(b.yMax)];
      const toX = (x) => plot.left + ((x - b.xMin) / (b.xMax - b.xMin)) * (plot.right - plot.left);
      const toY = (y) => plot.bottom - ((fy(y) - y0) / (y1 - y0)) * (plot.bottom - plot.top);
      this.layout = { plot, b, toX, toY, fromX: (px) => b.xMin + ((px - plot.left) / (plot.right - plot.left)) * (b.xMax - b.xMin) };

      this.drawAxes(ctx, plot, b, yTicks, toX, toY);
      ctx.save();
      ctx.beginPath();
      ctx.rect(plot.left, plot.top - 2, plot.right - plot.left, plot.bottom - plot.top + 4);
      ctx.clip();
      for (const s of this.series) this.drawSeries(ctx, s, toX, toY, useLog);
      ctx.restore();
      this.drawHover(ctx, plot, toX, toY, useLog);
    }

    drawAxes(ctx, plot, b, yTicks, toX, toY) {
      ctx.lineWidth = 1;
      ctx.strokeStyle = "#e7e9ee";
      ctx.fillStyle = "#5b6470";
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (const t of yTicks.ticks) {
        const y = Math.round(toY(t)) + 0.5;
        ctx.beginPath(); ctx.moveTo(plot.left, y); ctx.lineTo(plot.right, y); ctx.stroke();
        ctx.fillText(formatTick(t, yTicks.step), plot.left - 6, y);
      }
      const xTicks = linearTicks(b.xMin, b.xMax, Math.max(2, Math.floor((plot.right - plot.left) / 80)), true);
      ctx.textAlign = "center";
      ctx.textBaseline = "top";
      for (const t of xTicks.ticks) {
        const x = Math.round(toX(t)) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, plot.bottom); ctx.lineTo(x, plot.bottom + 4); ctx.stroke();
        ctx.fillText(formatStep(t), x, plot.bottom + 7);
      }
      ctx.strokeStyle = "#b9bfc9";
      ctx.beginPath();
      ctx.moveTo(plot.left + 0.5, plot.top);
      ctx.lineTo(plot.left + 0.5, plot.bottom + 0.5);
      ctx.lineTo(plot.right, plot.bottom + 0.5);
      ctx.stroke();
    }

    /**
     * Dense series are reduced to the min and max of each pixel column: the same picture as
     * drawing every point, at a cost bounded by the chart's width.
     */
    drawSeries(ctx, s, toX, toY, useLog) {
      const pts = useLog ? s.points.filter((p) => p.y > 0) : s.points;
      if (!pts.length) return;
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.6;
      ctx.lineJoin = "round";
      ctx.beginPath();
      let column = null, lo = 0, hi = 0;
      const flush = () => { if (column !== null) { ctx.lineTo(column, lo); if (hi !== lo) ctx.lineTo(column, hi); } };
      ctx.moveTo(toX(pts[0].x), toY(pts[0].y));
      for (const p of pts) {
        const x = Math.round(toX(p.x));
        const y = toY(p.y);
        if (x !== column) { flush(); column = x; lo = hi = y; } else { lo = Math.min(lo, y); hi = Math.max(hi, y); }
      }
      flush();
      ctx.stroke();
      if (pts.length === 1 || pts.length <= 40) { // few points: show where they are
        ctx.fillStyle = s.color;
        for (const p of pts) { ctx.beginPath(); ctx.arc(toX(p.x), toY(p.y), 2.2, 0, Math.PI * 2); ctx.fill(); }
      }
    }

    drawHover(ctx, plot, toX, toY, useLog) {
      if (this.hoverX == null || this.hoverX < plot.left || this.hoverX > plot.right) { this.tooltip.hidden = true; return; }
      const x = this.layout.fromX(this.hoverX);
      const rows = [];
      let snapX = null;
      for (const s of this.series) {
        const pts = useLog ? s.points.filter((p) => p.y > 0) : s.points;
        if (!pts.length) continue;
        const p = nearest(pts, x);
        snapX ??= p.x;
        rows.push({ s, p });
        ctx.fillStyle = "#fff";
        ctx.strokeStyle = s.color;
        ctx.lineWidth = 2;
        ctx.beginPath(); ctx.arc(toX(p.x), toY(p.y), 3.5, 0, Math.PI * 2); ctx.fill(); ctx.stroke();
      }
      if (!rows.length) { this.tooltip.hidden = true; return; }
      ctx.strokeStyle = "rgba(27,31,36,.25)";
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(Math.round(toX(snapX)) + 0.5, plot.top);
      ctx.lineTo(Math.round(toX(snapX)) + 0.5, plot.bottom);
      ctx.stroke();
      this.renderTooltip(rows, toX(snapX), plot);
    }

    renderTooltip(rows, px, plot) {
      const tip = this.tooltip;
      tip.replaceChildren();
      const head = document.createElement("div");
      head.className = "tip-head";
      head.textContent = `step ${formatStep(rows[0].p.x)}`;
      tip.appendChild(head);
      for (const { s, p } of rows) {
        const row = document.createElement("div");
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = s.color;
        row.append(swatch, `${s.label}: `);
        const value = document.createElement("b");
        value.textContent = formatValue(p.y);
        row.appendChild(value);
        tip.appendChild(row);
      }
      tip.hidden = false;
      // Keep the tooltip on the side of the cursor with more room.
      const left = px > (plot.left + plot.right) / 2 ? px - tip.offsetWidth - 12 : px + 12;
      tip.style.left = `${Math.max(0, left)}px`;
      tip.style.top = `${plot.top + 4}px`;
    }

    renderLegend() {
      const key = this.series.map((s) => `${s.label}|${s.color}`).join("\n");
      if (key === this.legendKey) return; // rebuilt only when a series appears
      this.legendKey = key;
      const fragment = document.createDocumentFragment();
      for (const s of this.series) {
        const item = document.createElement("li");
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = s.color;
        item.append(swatch, s.label);
        fragment.appendChild(item);
      }
      this.legend.replaceChildren(fragment);
    }
  }

  /* ---------------------------------------------------------------- wiring ----------------- */

  const logEl = root.querySelector("[data-testid=log]");
  const logView = new LogView(logEl, {
    followBox: root.querySelector("[data-testid=log-follow]"),
    wrapBox: root.querySelector("[data-testid=log-wrap]"),
    summary: root.querySelector("[data-testid=log-summary]"),
  });
  const logIntake = new LogIntake(logView);

  const metrics = new MetricStore();
  const metricsTable = root.querySelector("[data-testid=metrics-table]");
  const metricsEmpty = root.querySelector(".metrics-empty");
  const chart = new LossChart(root.querySelector("[data-testid=loss-chart]"), {
    legend: root.querySelector("[data-testid=loss-legend]"),
    empty: root.querySelector(".chart-empty"),
    tooltip: root.querySelector(".chart-tooltip"),
    logToggle: root.querySelector("[data-testid=chart-log-scale]"),
  });
  let tableFrame = 0;

  function refreshMetricsTable() {
    if (!tableFrame) {
      tableFrame = requestAnimationFrame(() => {
        tableFrame = 0;
        renderMetricsTable(metrics, metricsTable, metricsEmpty);
      });
    }
  }

  function receivePoints(points) {
    const changed = metrics.add(points);
    if (changed.loss) chart.setSeries(metrics.lossSeries());
    if (changed.latest) refreshMetricsTable();
  }

  function onMessage(message) {
    switch (message.type) {
      case "job":
        applyJob(message.job);
        refreshMetricsTable();
        break;
      case "logs":
        logIntake.receive(message.lines || []);
        break;
      case "metrics":
        receivePoints(message.points || []);
        break;
      case "status":
        applyStatusMessage(message);
        break;
      default:
        break; // newer servers may send more; ignoring them keeps old pages working
    }
  }

  function start() {
    for (const button of ui.actions) button.addEventListener("click", () => runAction(button));
    renderActions(job.status);
    renderElapsed();
    setInterval(() => { if (job.startedAt && !job.finishedAt) renderElapsed(); }, 1000);
    chart.setSeries([]);
    refreshMetricsTable();
    new T.LiveSocket({
      url: () => T.wsUrl(`/ws/jobs/${encodeURIComponent(jobId)}/?since=${logIntake.lastSeq}`),
      onMessage,
      onState: (state, reason) => T.showConnectionState(ui.connection, state, reason),
    }).start();
  }

  start();
})();
