/* The cluster page: GPUs per node, used and free, and which of the tenant's jobs hold them; below,
 * what each node's learners used over the last hour. */
(function () {
  "use strict";
  const T = window.Trainyard;
  const root = document.getElementById("cluster-page");
  if (!root) return;

  function el(tag, props = {}, children = []) {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  }

  function usageCell(used, total, label, show = String) {
    const share = total > 0 ? used / total : 0;
    const fill = el("div", { className: "bar-fill" });
    fill.style.width = `${Math.min(100, share * 100)}%`;
    const meter = el("div", { className: `bar${share >= 1 ? " bar-full" : share >= 0.8 ? " bar-high" : ""}` }, [fill]);
    meter.setAttribute("role", "meter");
    meter.setAttribute("aria-label", label);
    meter.setAttribute("aria-valuemin", "0");
    meter.setAttribute("aria-valuemax", String(total));
    meter.setAttribute("aria-valuenow", String(used));
    return el("td", { className: "usage-cell" }, [meter, el("span", { className: "mono small", textContent: `${show(used)} / ${show(total)}` })]);
  }

  /** An elastic job's whole size (not only this node's share): what it holds now and at most. */
  function elasticSize(e) {
    const badge = el("span", { className: "chip chip-elastic", textContent: `elastic ${e.learners}/${e.max_learners}` });
    badge.dataset.testid = "elastic-size";
    badge.title = `${e.learners} learner${e.learners === 1 ? "" : "s"} now; it may shrink to ${e.min_learners} or grow to ${e.max_learners}`;
    return el("span", {}, [" ", badge]);
  }

  function jobsCell(jobs) {
    if (!jobs.length) return el("td", { className: "muted", textContent: "—" });
    return el("td", {}, jobs.map((j) => {
      const chip = el("span", { className: "chip" });
      T.setStatusChip(chip, j.status);
      return el("div", { className: "node-job" }, [
        el("a", { href: `/jobs/${encodeURIComponent(j.id)}/`, className: "mono", textContent: j.id }), " ",
        el("span", { textContent: j.name }), " ", chip,
        el("span", { className: "muted small", textContent: ` ${j.gpus} GPU${j.gpus === 1 ? "" : "s"} · ${j.owner}` }),
        ...(j.elastic ? [elasticSize(j.elastic)] : []),
      ]);
    }));
  }

  async function load() {
    const error = root.querySelector("[data-testid=cluster-error]");
    try {
      const c = await T.getJson("/api/v1/cluster/");
      const cpus = (v) => String(Number(Number(v).toFixed(2)));
      root.querySelector("[data-testid=nodes] tbody").replaceChildren(...c.nodes.map((n) => {
        const row = el("tr", {}, [
          el("th", { scope: "row", className: "mono", textContent: n.name }),
          usageCell(n.gpus_used, n.gpus, `GPUs used on ${n.name}`),
          el("td", { className: "num mono", textContent: String(n.gpus_free ?? n.gpus - n.gpus_used) }),
          usageCell(n.cpus_used ?? 0, n.cpus, `CPUs used on ${n.name}`, cpus),
          jobsCell(n.my_jobs || []),
        ]);
        row.dataset.node = n.name;
        return row;
      }));
      root.querySelector("[data-testid=cluster-summary]").textContent =
        `${c.backend} backend · ${c.nodes.length} node${c.nodes.length === 1 ? "" : "s"} · ${c.gpus_used} of ${c.gpus_total} GPUs in use`;
      error.hidden = true;
    } catch (err) {
      error.textContent = `Could not load the cluster: ${err.message}`;
      error.hidden = false;
    }
  }

  /* ------------------------------------------------------------ use per node over time ---- */
  // GET /api/v1/cluster/use/: per node, a point a minute. One chart per figure, a line per node.
  const USE_CHARTS = [
    { key: "cpu", title: "CPU cores used", value: (p) => p.cpu_cores },
    { key: "gpu", title: "GPUs busy", value: (p) => p.gpus_busy },
  ];
  const USE_POLL_MS = 30000;
  const USE_MINUTES = 60;
  const CHART_HEIGHT = 170;
  const plots = new Map(); // chart key -> {card, body, plot, seriesKey}

  function useColumns(nodes, chart) {
    const times = [...new Set(nodes.flatMap((n) => n.points.map((p) => Date.parse(p.time) / 1000)))].sort((a, b) => a - b);
    const index = new Map(times.map((t, i) => [t, i]));
    const lines = nodes.map((n) => {
      const values = new Array(times.length).fill(null);
      for (const p of n.points) values[index.get(Date.parse(p.time) / 1000)] = chart.value(p);
      return { name: n.name, values };
    }).filter((line) => line.values.some((v) => v != null));
    return { times, lines };
  }

  function useCard(chart) {
    let entry = plots.get(chart.key);
    if (entry) return entry;
    const body = el("div", { className: "chart-body" });
    body.setAttribute("role", "img");
    body.setAttribute("aria-label", `${chart.title} per node over time`);
    const card = el("figure", { className: "card chart-card" }, [
      el("figcaption", { className: "card-head" }, [el("h3", { textContent: chart.title })]), body]);
    card.dataset.testid = "node-use-chart";
    card.dataset.chart = chart.key;
    root.querySelector("[data-testid=node-use-charts]").appendChild(card);
    entry = { card, body, plot: null, seriesKey: null };
    plots.set(chart.key, entry);
    return entry;
  }

  function drawUse(nodes) {
    for (const chart of USE_CHARTS) {
      const { times, lines } = useColumns(nodes, chart);
      const existing = plots.get(chart.key);
      if (!lines.length) {
        if (existing) existing.card.hidden = true;
        continue;
      }
      const entry = useCard(chart);
      entry.card.hidden = false;
      const data = [times, ...lines.map((l) => l.values)];
      const seriesKey = lines.map((l) => l.name).join("|");
      if (entry.seriesKey !== seriesKey) {
        if (entry.plot) entry.plot.destroy();
        const series = [{ label: "time", value: (u, v) => (v == null ? "—" : T.formatLocalTime(v * 1000)) }].concat(
          lines.map((l, i) => ({ label: l.name, stroke: T.CHART_PALETTE[i % T.CHART_PALETTE.length], width: 1.6,
                                 spanGaps: false, points: { show: times.length <= 40, size: 4 },
                                 value: (u, v) => (v == null ? "—" : String(Number(v.toFixed(2)))) })));
        entry.plot = new window.uPlot({
          width: Math.max(200, entry.body.clientWidth), height: CHART_HEIGHT, series,
          // The whole window, whatever minutes have samples: a lone point is not stretched into years.
          scales: { x: { time: true, range: () => { const end = Date.now() / 1000; return [end - USE_MINUTES * 60, end]; } },
                    y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },
          axes: [{ size: 30 }, { size: 50 }], legend: { live: true }, cursor: { sync: { key: "node-use" } },
        }, data, entry.body);
        entry.seriesKey = seriesKey;
      } else {
        entry.plot.setData(data);
      }
      entry.card.dataset.pointCount = String(times.length);
      entry.card.dataset.seriesCount = String(lines.length);
    }
    root.querySelector("[data-testid=node-use-empty]").hidden = nodes.some((n) => n.points.length);
  }

  async function loadUse() {
    try {
      drawUse((await T.getJson(`/api/v1/cluster/use/?minutes=${USE_MINUTES}`)).nodes);
    } catch (err) {
      const error = root.querySelector("[data-testid=cluster-error]");
      error.textContent = `Could not load the use per node: ${err.message}`;
      error.hidden = false;
    }
  }

  load();
  setInterval(load, 5000);
  if (window.uPlot) {
    loadUse();
    setInterval(loadUse, USE_POLL_MS);
  }
})();
