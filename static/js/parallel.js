/* Parallel coordinates for an experiment's page: one vertical axis per varied hyperparameter and a last
 * one for the searcher's metric (the better end at the top), one line per trial through its values.
 * A line's colour says how its metric ranks among the trials' (pale: worse, blue: better); the best
 * trial's is drawn last, thick and orange; a trial without a value yet is a dashed grey line through
 * the hyperparameters only. Hovering a line names its trial. Plain SVG: no library, no inline styles
 * (the Content-Security-Policy refuses them; colours are presentation attributes and classes). */
(function () {
  "use strict";
  const T = window.Trainyard;
  const NS = "http://www.w3.org/2000/svg";
  const HEIGHT = 300;
  const PAD = { top: 40, bottom: 34, side: 64 };
  const WORSE = [199, 210, 230]; // #c7d2e6
  const BETTER = [47, 91, 234]; // #2f5bea, the accent
  const MAX_CATEGORY_TICKS = 12;

  function node(name, attrs = {}, parent = null, text = null) {
    const el = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
    if (text != null) el.textContent = text;
    if (parent) parent.appendChild(el);
    return el;
  }

  function mix(t) {
    const c = WORSE.map((w, i) => Math.round(w + (BETTER[i] - w) * t));
    return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
  }

  /** Where a value sits on an axis: 0 at the bottom, 1 at the top; null when it cannot be placed. */
  function positionOn(axis, value) {
    if (value == null) return null;
    if (axis.kind === "categorical") {
      const at = axis.vals.findIndex((v) => String(v) === String(value));
      if (at < 0) return null;
      return axis.vals.length === 1 ? 0.5 : at / (axis.vals.length - 1);
    }
    const v = Number(value);
    if (!Number.isFinite(v)) return null;
    let lo = axis.min, hi = axis.max, x = v;
    if (axis.log && lo > 0 && hi > 0 && v > 0) { lo = Math.log(lo); hi = Math.log(hi); x = Math.log(v); }
    let t = hi === lo ? 0.5 : (x - lo) / (hi - lo);
    t = Math.min(1, Math.max(0, t));
    return axis.invert ? 1 - t : t;
  }

  /** The labels an axis shows: each choice, or its ends and middle. */
  function ticksOf(axis, format) {
    if (axis.kind === "categorical") {
      const vals = axis.vals.length <= MAX_CATEGORY_TICKS ? axis.vals : [axis.vals[0], axis.vals[axis.vals.length - 1]];
      return vals.map((v) => ({ value: v, label: typeof v === "number" ? format(v) : String(v) }));
    }
    if (axis.min == null || axis.max == null) return [];
    const middle = axis.log && axis.min > 0 ? Math.sqrt(axis.min * axis.max) : (axis.min + axis.max) / 2;
    const values = axis.min === axis.max ? [axis.min] : [axis.min, middle, axis.max];
    return values.map((v) => ({ value: v, label: format(v) }));
  }

  class ParallelCoordinates {
    /** `format`: how numbers are written (the page's formatValue). */
    constructor(container, emptyNote, format) {
      this.container = container;
      this.emptyNote = emptyNote;
      this.format = format;
      this.last = null;
      this.highlighted = null;
      new ResizeObserver(() => { if (this.last) this.draw(this.last); }).observe(container);
    }

    /**
     * axes: [{name, kind: "numeric"|"categorical", log, min, max, vals, invert, metric}], the metric's last;
     * trials: [{number, values: {name: value}, value}]; best: the best trial's number or null.
     */
    draw(data) {
      this.last = data;
      const { axes, trials, best } = data;
      this.emptyNote.hidden = trials.length > 0;
      this.container.hidden = trials.length === 0;
      if (!trials.length) { this.container.replaceChildren(); return; }
      const width = Math.max(360, this.container.clientWidth);
      const svg = node("svg", { width, height: HEIGHT, viewBox: `0 0 ${width} ${HEIGHT}`, class: "parallel-svg",
        role: "img", "aria-label": `${trials.length} trials' hyperparameters against ${axes[axes.length - 1].name}` });
      const step = axes.length > 1 ? (width - 2 * PAD.side) / (axes.length - 1) : 0;
      const xOf = (i) => (axes.length > 1 ? PAD.side + i * step : width / 2);
      const yOf = (t) => PAD.top + (1 - t) * (HEIGHT - PAD.top - PAD.bottom);

      // Colour by rank, so one outlier does not wash the others out.
      const ranked = trials.filter((t) => Number.isFinite(t.value)).sort((a, b) => {
        const metric = axes[axes.length - 1];
        return metric.invert ? b.value - a.value : a.value - b.value;
      });
      const rank = new Map(ranked.map((t, i) => [t.number, ranked.length > 1 ? i / (ranked.length - 1) : 1]));

      const lines = node("g", { class: "parallel-lines" }, svg);
      const order = [...trials].sort((a, b) => (a.number === best) - (b.number === best)
        || (rank.get(a.number) ?? -1) - (rank.get(b.number) ?? -1));
      for (const trial of order) {
        const points = [];
        axes.forEach((axis, i) => {
          const t = positionOn(axis, axis.metric ? trial.value : trial.values[axis.name]);
          if (t != null) points.push([xOf(i), yOf(t)]);
        });
        if (points.length < 2 && !(axes.length === 1 && points.length)) continue;
        const d = points.map(([x, y], i) => `${i ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
        const isBest = trial.number === best;
        const hasValue = rank.has(trial.number);
        const path = node("path", {
          d, fill: "none", class: `parallel-line${isBest ? " is-best" : ""}${hasValue ? "" : " no-value"}`,
          stroke: isBest ? "#d97706" : hasValue ? mix(rank.get(trial.number)) : "#c3c8cf",
          "stroke-width": isBest ? 3 : 1.6, "data-number": trial.number,
        }, lines);
        const parts = axes.map((axis) => `${axis.name} ${this.label(axis.metric ? trial.value : trial.values[axis.name])}`);
        node("title", {}, path, `trial ${trial.number}${isBest ? " (best)" : ""}: ${parts.join(", ")}`);
      }

      const axesGroup = node("g", { class: "parallel-axes" }, svg);
      axes.forEach((axis, i) => {
        const x = xOf(i);
        const g = node("g", { class: `parallel-axis${axis.metric ? " is-metric" : ""}`, "data-axis": axis.name }, axesGroup);
        node("line", { x1: x, x2: x, y1: yOf(1), y2: yOf(0) }, g);
        const anchor = i === 0 && axes.length > 1 ? "start" : i === axes.length - 1 && axes.length > 1 ? "end" : "middle";
        const nameX = anchor === "start" ? x - 8 : anchor === "end" ? x + 8 : x;
        node("text", { x: nameX, y: PAD.top - 22, "text-anchor": anchor, class: "parallel-name" }, g, axis.name);
        if (axis.metric) node("text", { x: nameX, y: PAD.top - 9, "text-anchor": anchor, class: "parallel-hint" }, g,
          axis.invert ? "↓ lower is better" : "↑ higher is better");
        else if (axis.log) node("text", { x: nameX, y: PAD.top - 9, "text-anchor": anchor, class: "parallel-hint" }, g, "log");
        const side = axis.metric && axes.length > 1 ? 1 : -1; // the last axis's labels go outside, on its right
        for (const tick of ticksOf(axis, this.format)) {
          const t = positionOn(axis, tick.value);
          if (t == null) continue;
          const y = yOf(t);
          node("line", { x1: x + 4 * side, x2: x, y1: y, y2: y }, g);
          node("text", { x: x + 7 * side, y: y + 4, "text-anchor": side > 0 ? "start" : "end", class: "parallel-tick" },
            g, tick.label);
        }
      });
      this.container.replaceChildren(svg);
      this.container.dataset.lineCount = String(lines.childElementCount);
      if (this.highlighted != null) this.highlight(this.highlighted);
    }

    label(value) {
      if (value == null) return "—";
      return typeof value === "number" ? this.format(value) : String(value);
    }

    /** Bring one trial's line forward (hovering its row in the table); null: none. */
    highlight(number) {
      this.highlighted = number;
      for (const path of this.container.querySelectorAll(".parallel-line")) {
        const on = number != null && path.dataset.number === String(number);
        path.classList.toggle("is-highlighted", on);
        if (on) path.parentNode.appendChild(path);
      }
      this.container.classList.toggle("has-highlight", number != null);
    }
  }

  T.ParallelCoordinates = ParallelCoordinates;
})();
