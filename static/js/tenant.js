/* The tenant usage page: quota against usage as bars, from GET /api/v1/tenants/current/.
 * Any quota key may be missing or null (no limit); the page says so instead of guessing. */
(function () {
  "use strict";
  const T = window.Trainyard;
  const root = document.getElementById("tenant-page");
  if (!root) return;

  // [label, usage key, quota key, how to show a value]
  const ROWS = [
    ["GPUs in use now", "gpus", "gpus", (v) => String(v)],
    ["CPUs in use now", "cpus", "cpus", (v) => String(Number(Number(v).toFixed(2)))],
    ["Memory in use now", "memory_bytes", "memory_bytes", (v) => T.formatBytes(v)],
    ["Running jobs", "jobs", "jobs", (v) => String(v)],
    ["GPU-hours this period", "gpu_hours", "gpu_hours", (v) => Number(v).toFixed(2)],
    ["CPU-hours this period", "cpu_hours", "cpu_hours", (v) => Number(v).toFixed(2)],
    ["Stored results, checkpoints, logs and code", "storage_bytes", "storage_bytes", (v) => T.formatBytes(v)],
  ];

  function el(tag, props = {}, children = []) {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  }

  function bar(used, limit, label) {
    const meter = el("div", { className: "bar" });
    meter.setAttribute("role", "meter");
    meter.setAttribute("aria-label", label);
    const fill = el("div", { className: "bar-fill" });
    if (limit == null || limit <= 0) {
      meter.classList.add("bar-unlimited");
      meter.setAttribute("aria-valuetext", "no limit");
    } else {
      const share = Math.max(0, used / limit);
      fill.style.width = `${Math.min(100, share * 100)}%`;
      if (share >= 1) meter.classList.add("bar-full");
      else if (share >= 0.8) meter.classList.add("bar-high");
      meter.setAttribute("aria-valuemin", "0");
      meter.setAttribute("aria-valuemax", String(limit));
      meter.setAttribute("aria-valuenow", String(used));
    }
    meter.appendChild(fill);
    return meter;
  }

  function renderBars(quota, usage) {
    const rows = ROWS.filter(([, usageKey]) => usageKey in usage).map(([label, usageKey, quotaKey, show]) => {
      const used = Number(usage[usageKey]) || 0;
      const limit = quota[quotaKey] ?? null;
      const text = limit == null ? `${show(used)} · no limit` : `${show(used)} of ${show(limit)}`;
      const row = el("div", { className: "quota-row" }, [
        el("span", { className: "quota-label", textContent: label }),
        bar(used, limit, label),
        el("span", { className: "quota-value mono", textContent: text }),
      ]);
      row.dataset.quota = usageKey;
      return row;
    });
    const box = root.querySelector("[data-testid=quota-bars]");
    box.replaceChildren(...(rows.length ? rows : [el("p", { className: "muted pad", textContent: "No usage figures yet." })]));
  }

  function renderHistory(history) {
    const tbody = root.querySelector("[data-testid=history] tbody");
    const peak = Math.max(1e-9, ...history.map((h) => Number(h.gpu_hours) || 0));
    tbody.replaceChildren(...history.map((h) => {
      const start = T.parseTime(h.period_start);
      const period = start == null ? h.period_start : T.formatLocalTime(start).slice(0, 7);
      const cell = el("td");
      cell.appendChild(bar(Number(h.gpu_hours) || 0, peak, `GPU-hours in ${period}`));
      return el("tr", {}, [el("td", { textContent: period }),
        el("td", { className: "num mono", textContent: Number(h.gpu_hours || 0).toFixed(1) }),
        el("td", { className: "num mono", textContent: Number(h.cpu_hours || 0).toFixed(1) }), cell]);
    }));
    if (!history.length) tbody.appendChild(el("tr", {}, [el("td", { colSpan: 4, className: "muted", textContent: "No past periods yet." })]));
  }

  async function load() {
    const error = root.querySelector("[data-testid=tenant-error]");
    try {
      const t = await T.getJson("/api/v1/tenants/current/");
      const quota = t.quota || {};
      const usage = t.usage || {};
      renderBars(quota, usage);
      const queued = t.queued && typeof t.queued === "object" ? t.queued : { jobs: t.queued };
      const facts = root.querySelector("[data-testid=queued]");
      facts.querySelector("[data-fact=jobs]").textContent = queued.jobs ?? "—";
      facts.querySelector("[data-fact=gpus]").textContent = queued.gpus ?? "—";
      facts.querySelector("[data-fact=my_gpus]").textContent = usage.my_gpus ?? "—";
      renderHistory(Array.isArray(t.history) ? t.history : []);
      const start = T.parseTime(usage.period_start);
      const end = T.parseTime(usage.period_end);
      if (start != null) {
        root.querySelector("[data-testid=period]").textContent = `period ${T.formatLocalTime(start).slice(0, 10)} – ` +
          `${end == null ? "…" : T.formatLocalTime(end).slice(0, 10)}${quota.budget_mode ? ` · ${quota.budget_mode} budget` : ""}`;
      }
      const budget = root.querySelector("[data-testid=budget]");
      budget.hidden = !(t.budget && t.budget.reason);
      if (t.budget && t.budget.reason) budget.textContent = t.budget.reason;
      error.hidden = true;
    } catch (err) {
      error.textContent = `Could not load the tenant's usage: ${err.message}`;
      error.hidden = false;
    }
  }

  load();
  setInterval(load, 15000);
})();
