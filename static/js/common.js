/* Shared helpers for Trainyard's pages: time and size formatting, status chips, CSRF, and a
 * websocket that reconnects by itself. Plain ES2020, no build step; exposed as window.Trainyard. */
(function () {
  "use strict";

  const FINAL_STATUSES = new Set(["COMPLETED", "FAILED", "TERMINATED"]);
  const STATUSES = ["QUEUED", "PENDING", "DOWNLOADING", "PROCESSING", "STORING", "COMPLETED",
    "FAILED", "HALTING", "HALTED", "TERMINATED"];
  // Close codes the server uses for "never going to work": reconnecting would only loop.
  const CLOSE_UNAUTHORIZED = 4401;
  const CLOSE_NOT_FOUND = 4404;

  function isFinal(status) {
    return FINAL_STATUSES.has(status);
  }

  /** Milliseconds since the epoch, or null for an empty / unparsable ISO string. */
  function parseTime(iso) {
    if (!iso) return null;
    const ms = Date.parse(iso);
    return Number.isNaN(ms) ? null : ms;
  }

  /** "42s", "3m 05s", "2h 03m", "3d 04h": compact but never ambiguous. */
  function formatDuration(ms) {
    if (ms == null || !Number.isFinite(ms)) return "—";
    let s = Math.max(0, Math.floor(ms / 1000));
    const d = Math.floor(s / 86400); s -= d * 86400;
    const h = Math.floor(s / 3600); s -= h * 3600;
    const m = Math.floor(s / 60); s -= m * 60;
    const pad = (n) => String(n).padStart(2, "0");
    if (d) return `${d}d ${pad(h)}h`;
    if (h) return `${h}h ${pad(m)}m`;
    if (m) return `${m}m ${pad(s)}s`;
    return `${s}s`;
  }

  /** Elapsed run time of a job: from started_at to finished_at (or now while it runs). */
  function elapsedMs(startedIso, finishedIso, now = Date.now()) {
    const started = parseTime(startedIso);
    if (started == null) return null;
    const finished = parseTime(finishedIso);
    return (finished ?? now) - started;
  }

  function formatBytes(bytes) {
    const n = Number(bytes);
    if (!Number.isFinite(n)) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = n;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    const digits = value >= 100 || Number.isInteger(value) ? 0 : 1;
    return `${value.toFixed(digits)} ${units[unit]}`;
  }

  function formatLocalTime(ms, withSeconds = false) {
    const d = new Date(ms);
    const pad = (n) => String(n).padStart(2, "0");
    const date = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;
    const time = `${pad(d.getHours())}:${pad(d.getMinutes())}${withSeconds ? ":" + pad(d.getSeconds()) : ""}`;
    return `${date} ${time}`;
  }

  /** The server renders times in UTC; show them in the reader's time zone instead. */
  function localizeTimes(root = document) {
    for (const el of root.querySelectorAll("time[datetime]")) {
      const ms = parseTime(el.getAttribute("datetime"));
      if (ms == null) continue;
      el.textContent = formatLocalTime(ms);
      el.title = new Date(ms).toString();
    }
    for (const el of root.querySelectorAll("[data-bytes]")) {
      el.textContent = formatBytes(el.dataset.bytes);
    }
  }

  function setStatusChip(chip, status, reason) {
    if (!chip || !status) return;
    for (const s of STATUSES) chip.classList.remove(`status-${s.toLowerCase()}`);
    chip.classList.add(`status-${String(status).toLowerCase()}`);
    chip.dataset.status = status;
    chip.textContent = status;
    if (reason !== undefined) chip.title = reason || "";
  }

  /** Django's CSRF token: the cookie, or any {% csrf_token %} field on the page as a fallback. */
  function csrfToken() {
    const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    if (match) return decodeURIComponent(match[1]);
    const input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  /** `url` (of this platform) in the tenant the page shows: its `?tenant=`, which the server read too. */
  function inTenant(url) {
    const tenant = new URLSearchParams(location.search).get("tenant");
    if (!tenant) return url;
    const full = new URL(url, location.href);
    if (!full.searchParams.has("tenant")) full.searchParams.set("tenant", tenant);
    return full.origin === location.origin || full.host === location.host ? full.href : url;
  }

  function wsUrl(path) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    return inTenant(`${scheme}//${location.host}${path}`);
  }

  /**
   * A websocket that reconnects with exponential backoff (1 s doubling to 10 s).
   * `url` is a function so each attempt can resume from fresh state (e.g. the last log seq).
   * onState receives "connecting" | "live" | "reconnecting" | "closed" (+ a reason for "closed").
   */
  class LiveSocket {
    constructor({ url, onMessage, onState = () => {}, minDelay = 1000, maxDelay = 10000 }) {
      this.url = url;
      this.onMessage = onMessage;
      this.onState = onState;
      this.minDelay = minDelay;
      this.maxDelay = maxDelay;
      this.delay = minDelay;
      this.socket = null;
      this.timer = null;
      this.stopped = false;
      this.openedAt = 0;
    }

    start() {
      this.stopped = false;
      this.connect("connecting");
    }

    stop() {
      this.stopped = true;
      clearTimeout(this.timer);
      if (this.socket) this.socket.close();
    }

    connect(state) {
      this.onState(state);
      let socket;
      try {
        socket = new WebSocket(this.url());
      } catch (err) {
        this.scheduleReconnect();
        return;
      }
      this.socket = socket;
      socket.addEventListener("open", () => {
        this.openedAt = Date.now();
        this.onState("live");
      });
      socket.addEventListener("message", (event) => {
        this.delay = this.minDelay; // the server is really talking to us: start backoff over
        let message;
        try {
          message = JSON.parse(event.data);
        } catch (err) {
          console.warn("trainyard: ignoring a websocket message that is not JSON", err);
          return;
        }
        this.onMessage(message);
      });
      socket.addEventListener("close", (event) => this.handleClose(event));
    }

    handleClose(event) {
      this.socket = null;
      if (this.stopped) return;
      if (event.code === CLOSE_UNAUTHORIZED) {
        this.onState("closed", "signed out: reload the page to sign in again");
        return;
      }
      if (event.code === CLOSE_NOT_FOUND) {
        this.onState("closed", "this job is not available");
        return;
      }
      // A connection that stayed up for a while was healthy; don't punish the next attempt.
      if (this.openedAt && Date.now() - this.openedAt > 5000) this.delay = this.minDelay;
      this.openedAt = 0;
      this.scheduleReconnect();
    }

    scheduleReconnect() {
      this.onState("reconnecting");
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.connect("reconnecting"), this.delay);
      this.delay = Math.min(this.delay * 2, this.maxDelay);
    }
  }

  /** GET a JSON resource of the platform with the browser session; throws on a non-2xx answer. */
  async function getJson(path) {
    const response = await fetch(inTenant(path), { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw Object.assign(new Error(`HTTP ${response.status}`), { status: response.status });
    return response.json();
  }

  /** Shows a socket's state in a small pill (`.live-indicator[data-state]`). */
  function showConnectionState(el, state, reason) {
    if (!el) return;
    const labels = { connecting: "connecting…", live: "live", reconnecting: "reconnecting…", closed: "offline",
                     ended: "ended", deleted: "deleted" };
    el.hidden = false;
    el.dataset.state = state;
    el.textContent = labels[state] || state;
    el.title = reason || "";
  }

  // The charts' line colours, in the order lines are given them (every page's charts).
  const CHART_PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

  window.Trainyard = {
    FINAL_STATUSES, isFinal, parseTime, formatDuration, elapsedMs, formatBytes, formatLocalTime,
    localizeTimes, setStatusChip, csrfToken, inTenant, wsUrl, LiveSocket, showConnectionState, getJson, CHART_PALETTE,
  };

  document.addEventListener("DOMContentLoaded", () => localizeTimes());

  // Forms that ask first (`data-confirm="question"`) and selects that submit their form when changed
  // (`data-autosubmit`): wired here, because the Content-Security-Policy refuses inline handlers.
  document.addEventListener("submit", (event) => {
    const question = event.target.dataset && event.target.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  }, true);
  document.addEventListener("change", (event) => {
    if (event.target.matches("select[data-autosubmit]") && event.target.form) event.target.form.requestSubmit();
  });
})();
