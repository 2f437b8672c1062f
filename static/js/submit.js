/* The submit page: pick an example or open a manifest, see it validated as you type (by the
 * server's own rules, POST /api/v1/manifests/validate/), and what it asks for next to what the
 * tenant has left. Submitting is a plain form post, so it works without this script too. */
(function () {
  "use strict";
  const T = window.Trainyard;
  const VALIDATE_DELAY_MS = 250;

  const form = document.getElementById("submit-form");
  if (!form) return;
  const editor = form.querySelector("[data-testid=manifest]");
  const status = form.querySelector("[data-testid=manifest-status]");
  const example = form.querySelector("[data-testid=example]");
  const manifestFile = form.querySelector("[data-testid=manifest-file]");
  const facts = form.querySelector("[data-testid=manifest-resources]");
  const quotaBox = form.querySelector("[data-testid=quota-left]");
  const quotaNote = form.querySelector("[data-testid=quota-note]");

  let timer = 0;
  let generation = 0; // answers to older requests are dropped: the text has changed since
  let left = null; // {gpus, cpus, jobs, gpu_hours}: null entries mean "no limit"
  let asks = null;

  function setStatus(state, html) {
    status.dataset.state = state;
    status.classList.toggle("is-error", state === "invalid");
    status.replaceChildren(...html);
    editor.setAttribute("aria-invalid", state === "invalid" ? "true" : "false");
  }

  function strong(text) {
    const el = document.createElement("strong");
    el.textContent = text;
    return el;
  }

  function fact(name, text) {
    const el = facts.querySelector(`[data-fact=${name}]`);
    if (el) el.textContent = text;
  }

  function renderAsks(m) {
    asks = m;
    if (!m) {
      for (const el of facts.querySelectorAll("dd")) el.textContent = "—";
    } else {
      const each = m.learners > 1 ? ` (${m.learners} × ` : "";
      fact("framework", m.framework + (m.framework_version ? ` ${m.framework_version}` : ""));
      fact("learners", String(m.learners) + (m.learners > 1 ? " (gang-scheduled)" : ""));
      fact("gpus", `${m.total_gpus}${each ? `${each}${m.gpus})` : ""}`);
      fact("cpus", `${Number(m.total_cpus.toFixed(2))}${each ? `${each}${m.cpus})` : ""}`);
      fact("memory", `${T.formatBytes(m.total_memory_bytes)}${each ? `${each}${T.formatBytes(m.memory_bytes)})` : ""}`);
      fact("priority", m.priority);
    }
    renderFit();
  }

  async function validate() {
    const mine = ++generation;
    const text = editor.value;
    if (!text.trim()) {
      setStatus("idle", ["Write a manifest, open one, or start from an example."]);
      renderAsks(null);
      return;
    }
    setStatus("checking", ["Checking…"]);
    let response, body;
    try {
      response = await fetch("/api/v1/manifests/validate/", {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": T.csrfToken() },
        body: JSON.stringify({ manifest: text }),
      });
      body = await response.json().catch(() => ({}));
    } catch (err) {
      if (mine === generation) setStatus("unknown", [`Could not check the manifest: ${err.message}`]);
      return;
    }
    if (mine !== generation) return;
    if (response.ok) {
      setStatus("valid", ["✓ Valid: ", strong(body.manifest.name), ` — ${body.manifest.framework}, `,
        `${body.manifest.learners} learner${body.manifest.learners > 1 ? "s" : ""}`]);
      renderAsks(body.manifest);
    } else {
      setStatus("invalid", body.field ? [strong(body.field), " — ", body.detail || "invalid"]
        : [body.detail || `HTTP ${response.status}`]);
      renderAsks(null);
    }
  }

  function scheduleValidate() {
    clearTimeout(timer);
    timer = setTimeout(validate, VALIDATE_DELAY_MS);
  }

  /* ------------------------------------------------------------ quota ------------------------ */

  const remaining = (limit, used) => (limit == null ? null : Math.max(0, limit - (used || 0)));

  function showLeft(name, value, unit = "") {
    const el = quotaBox.querySelector(`[data-left=${name}]`);
    if (el) el.textContent = value == null ? "no limit" : `${Number(value.toFixed(2))}${unit}`;
  }

  async function loadQuota() {
    try {
      const t = await T.getJson("/api/v1/tenants/current/");
      const quota = t.quota || {};
      const usage = t.usage || {};
      left = {
        gpus: remaining(quota.gpus, usage.gpus),
        cpus: remaining(quota.cpus, usage.cpus),
        jobs: remaining(quota.jobs, usage.jobs),
        gpu_hours: remaining(quota.gpu_hours, usage.gpu_hours),
      };
      showLeft("gpus", left.gpus);
      showLeft("cpus", left.cpus);
      showLeft("jobs", left.jobs);
      showLeft("gpu_hours", left.gpu_hours, " h");
    } catch (err) {
      for (const el of quotaBox.querySelectorAll("dd")) el.textContent = "?";
      quotaNote.textContent = `Could not load the quota: ${err.message}`;
      quotaNote.hidden = false;
    }
    renderFit();
  }

  /** Say plainly when the job will wait for quota, before anyone submits it. */
  function renderFit() {
    if (!left || !asks) { if (left) quotaNote.hidden = true; return; }
    const short = [];
    if (left.gpus != null && asks.total_gpus > left.gpus) short.push(`${asks.total_gpus} GPUs (${left.gpus} free in the quota)`);
    if (left.cpus != null && asks.total_cpus > left.cpus) short.push(`${asks.total_cpus} CPUs (${left.cpus} free)`);
    if (left.jobs != null && left.jobs < 1) short.push("a running-job slot (none free)");
    quotaNote.textContent = short.length ? `It will queue until the tenant has ${short.join(" and ")}.` : "It fits in what the tenant has left now.";
    quotaNote.classList.toggle("warn", short.length > 0);
    quotaNote.hidden = false;
  }

  /* ------------------------------------------------------------ sources ---------------------- */

  async function loadExample(name) {
    if (!name) return;
    const response = await fetch(`/submit/examples/${encodeURIComponent(name)}/manifest.yml`, { credentials: "same-origin" });
    if (!response.ok) { setStatus("invalid", [await response.text()]); return; }
    editor.value = await response.text();
    validate();
  }

  function start() {
    editor.addEventListener("input", scheduleValidate);
    example.addEventListener("change", () => loadExample(example.value));
    manifestFile.addEventListener("change", async () => {
      const file = manifestFile.files[0];
      if (!file) return;
      editor.value = await file.text();
      validate();
    });
    // Tab indents inside the editor (YAML is indentation); Escape then Tab leaves it.
    let escaped = false;
    editor.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); form.requestSubmit(); return; }
      if (event.key === "Escape") { escaped = true; return; }
      if (event.key === "Tab" && !event.shiftKey && !escaped) {
        event.preventDefault();
        editor.setRangeText("  ", editor.selectionStart, editor.selectionEnd, "end");
        scheduleValidate();
      }
      escaped = false;
    });
    form.addEventListener("submit", () => { form.querySelector("[data-testid=submit]").disabled = true; });
    loadQuota();
    if (editor.value.trim()) validate();
    else if (example.value) loadExample(example.value);
  }

  start();
})();
