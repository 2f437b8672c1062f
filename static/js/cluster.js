/* The cluster page: GPUs per node, used and free, and which of the tenant's jobs hold them. */
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

  load();
  setInterval(load, 5000);
})();
