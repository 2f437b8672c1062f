/* The job page's log: every line kept in memory, only the rows on screen in the DOM.
 *
 * A 100,000-line log is 100,000 small objects (a few MB) but would be 100,000 DOM rows, which no
 * browser scrolls smoothly; so rows have one fixed height and the view renders just the window
 * the reader looks at (plus a margin), inside a spacer as tall as all the lines that pass the
 * filters. Filters (learner, stream, "only matches") change which lines are in the view; search
 * highlights and steps through matches; "follow" keeps the newest line in sight.
 */
(function () {
  "use strict";
  const T = window.Trainyard;

  const ROW_PX = 19; // must match .log-row's height in app.css
  const OVERSCAN_ROWS = 30;
  const MAX_LINES = 1_000_000; // beyond this the oldest lines are dropped (the download has them all)
  const FETCH_LIMIT = 10000; // the REST API's own maximum per request
  const ERROR_PATTERN = /\b(error|exception|traceback|fatal|killed|panic)\b/i;

  class LogView {
    constructor(root, { jobId, learners }) {
      this.jobId = jobId;
      this.el = root.querySelector("[data-testid=log]");
      this.spacer = this.el.querySelector(".log-spacer");
      this.rowsEl = this.el.querySelector(".log-rows");
      this.emptyNote = this.el.querySelector(".log-empty");
      this.summary = root.querySelector("[data-testid=log-summary]");
      this.followBox = root.querySelector("[data-testid=log-follow]");
      this.learnerSelect = root.querySelector("[data-testid=log-learner]");
      this.streamSelect = root.querySelector("[data-testid=log-stream]");
      this.searchBox = root.querySelector("[data-testid=log-search]");
      this.searchCount = root.querySelector("[data-testid=log-search-count]");
      this.onlyMatches = root.querySelector("[data-testid=log-only-matches]");
      this.earlierButton = root.querySelector("[data-testid=log-earlier]");
      this.showLearner = learners > 1;

      this.lines = []; // {seq, learner, stream, line, err}
      this.view = []; // indexes into this.lines that pass the filters, in order
      this.matches = []; // positions in this.view whose line matches the search
      this.current = -1; // position in this.matches of the highlighted match
      this.highlighted = -1; // view position marked "current", by a search or by "First error"
      this.highlightIsMatch = false; // clearing the search clears only a highlight the search made
      this.pattern = null;
      this.learnersSeen = new Set();
      this.frame = 0;
      this.lastUserIntent = 0;
      this.rendered = { first: -1, last: -1, version: -1 };
      this.version = 0; // bumps when lines or filters change, so the window is redrawn
      this.firstSeq = null; // lowest seq held; earlier lines can be loaded over REST

      this.wire(root);
    }

    wire(root) {
      this.followBox.addEventListener("change", () => { if (this.following) this.scrollToBottom(); });
      this.learnerSelect.addEventListener("change", () => this.refilter());
      this.streamSelect.addEventListener("change", () => this.refilter());
      this.onlyMatches.addEventListener("change", () => this.refilter());
      let searchTimer = 0;
      this.searchBox.addEventListener("input", () => {
        clearTimeout(searchTimer);
        searchTimer = setTimeout(() => this.search(this.searchBox.value), 150);
      });
      this.searchBox.addEventListener("keydown", (event) => {
        if (event.key === "Enter") { event.preventDefault(); this.step(event.shiftKey ? -1 : 1); }
        if (event.key === "Escape") { this.searchBox.value = ""; this.search(""); }
      });
      root.querySelector("[data-testid=log-search-next]").addEventListener("click", () => this.step(1));
      root.querySelector("[data-testid=log-search-prev]").addEventListener("click", () => this.step(-1));
      root.querySelector("[data-testid=log-first-error]").addEventListener("click", () => this.jumpToFirstError());
      this.earlierButton.addEventListener("click", () => this.loadEarlier());

      // Only input from the reader may switch following; our own scrolling must not.
      const noteIntent = () => { this.lastUserIntent = Date.now(); };
      this.el.addEventListener("wheel", (event) => {
        noteIntent();
        if (event.deltaY < 0) this.setFollow(false); // before the next append scrolls it back down
      }, { passive: true });
      for (const type of ["touchmove", "pointerdown", "keydown"]) this.el.addEventListener(type, noteIntent, { passive: true });
      this.el.addEventListener("pointermove", (event) => { if (event.buttons) noteIntent(); }); // scrollbar drags
      this.el.addEventListener("scroll", () => {
        if (Date.now() - this.lastUserIntent < 500) this.setFollow(this.isAtBottom());
        this.schedule();
      }, { passive: true });
      new ResizeObserver(() => { if (this.following) this.scrollToBottom(); this.schedule(); }).observe(this.el);
    }

    get following() { return this.followBox.checked; }

    setFollow(on) { if (this.followBox.checked !== on) this.followBox.checked = on; }

    isAtBottom() { return this.el.scrollHeight - this.el.scrollTop - this.el.clientHeight < ROW_PX; }

    scrollToBottom() { this.el.scrollTop = this.el.scrollHeight; }

    /* ---------------------------------------------------------------- data ---------------- */

    passes(line) {
      const learner = this.learnerSelect.value;
      const stream = this.streamSelect.value;
      if (learner !== "" && String(line.learner) !== learner) return false;
      if (stream && line.stream !== stream) return false;
      if (this.onlyMatches.checked && this.pattern && !this.pattern.test(line.line)) return false;
      return true;
    }

    /** Lines newer than everything held, in seq order (LogIntake guarantees it). */
    append(batch) {
      if (!batch.length) return;
      if (this.firstSeq == null) this.firstSeq = batch[0].seq;
      for (const raw of batch) {
        const line = this.intern(raw);
        const index = this.lines.push(line) - 1;
        if (this.passes(line)) {
          this.view.push(index);
          if (this.pattern && this.pattern.test(line.line)) this.matches.push(this.view.length - 1);
        }
      }
      if (this.lines.length > MAX_LINES) this.dropOldest(this.lines.length - MAX_LINES);
      this.changed();
    }

    /** Lines older than everything held (loaded on request), in seq order. */
    prepend(batch) {
      if (!batch.length) return;
      this.lines = batch.map((raw) => this.intern(raw)).concat(this.lines);
      this.firstSeq = this.lines[0].seq;
      const keepPosition = !this.following;
      const before = this.view.length;
      this.rebuildView();
      if (keepPosition) this.el.scrollTop += (this.view.length - before) * ROW_PX;
      this.changed();
    }

    intern(raw) {
      if (!this.learnersSeen.has(raw.learner)) {
        this.learnersSeen.add(raw.learner);
        this.addLearnerOption(raw.learner);
      }
      return { seq: raw.seq, learner: raw.learner, stream: raw.stream, line: raw.line,
        err: raw.stream === "stderr" && ERROR_PATTERN.test(raw.line) };
    }

    addLearnerOption(learner) {
      const option = document.createElement("option");
      option.value = String(learner);
      option.textContent = `learner ${learner}`;
      const options = [...this.learnerSelect.options].slice(1);
      const after = options.find((o) => Number(o.value) > learner);
      this.learnerSelect.insertBefore(option, after || null);
    }

    dropOldest(count) {
      this.lines.splice(0, count);
      this.firstSeq = this.lines.length ? this.lines[0].seq : null;
      this.rebuildView();
    }

    rebuildView() {
      this.view = [];
      this.matches = [];
      for (let i = 0; i < this.lines.length; i += 1) {
        const line = this.lines[i];
        if (!this.passes(line)) continue;
        this.view.push(i);
        if (this.pattern && this.pattern.test(line.line)) this.matches.push(this.view.length - 1);
      }
      this.current = Math.min(this.current, this.matches.length - 1);
    }

    refilter() {
      this.rebuildView();
      this.changed();
      if (this.following) this.scrollToBottom();
    }

    changed() {
      this.version += 1;
      this.el.dataset.lineCount = String(this.lines.length);
      this.el.dataset.viewCount = String(this.view.length);
      this.schedule();
    }

    /* ---------------------------------------------------------------- search -------------- */

    static compile(text) {
      if (!text) return null;
      const regex = text.length > 2 && text.startsWith("/") && text.endsWith("/");
      try {
        return new RegExp(regex ? text.slice(1, -1) : text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"), "i");
      } catch (err) {
        return undefined; // an unfinished regex: keep the previous results
      }
    }

    search(text) {
      const pattern = LogView.compile(text);
      if (pattern === undefined) { this.searchCount.textContent = "bad regex"; return; }
      this.pattern = pattern;
      this.current = -1;
      if (!pattern && this.highlightIsMatch) this.highlighted = -1;
      this.rebuildView();
      this.changed();
      if (this.matches.length) this.step(1);
      else this.renderSearchCount();
    }

    step(direction) {
      if (!this.matches.length) { this.renderSearchCount(); return; }
      const n = this.matches.length;
      this.current = this.current < 0 ? (direction > 0 ? 0 : n - 1) : (this.current + direction + n) % n;
      this.reveal(this.matches[this.current], { isMatch: true });
      this.renderSearchCount();
    }

    renderSearchCount() {
      if (!this.pattern) { this.searchCount.textContent = ""; return; }
      const n = this.matches.length;
      this.searchCount.textContent = n ? `${this.current + 1}/${n.toLocaleString()}` : "no match";
    }

    jumpToFirstError() {
      let position = this.view.findIndex((i) => this.lines[i].err);
      if (position < 0) position = this.view.findIndex((i) => this.lines[i].stream === "stderr");
      if (position < 0) { this.flashSummary("no error in the lines shown"); return; }
      this.reveal(position);
    }

    /** Scroll a view position into the middle of the pane, marked, and stop following. */
    reveal(position, { isMatch = false } = {}) {
      this.setFollow(false);
      this.highlighted = position;
      this.highlightIsMatch = isMatch;
      this.el.scrollTop = Math.max(0, position * ROW_PX - this.el.clientHeight / 2);
      this.version += 1;
      this.schedule();
    }

    flashSummary(text) {
      this.summary.textContent = text;
      setTimeout(() => this.renderSummary(), 2500);
    }

    /* ---------------------------------------------------------------- earlier lines -------- */

    setEarlierAvailable(available) {
      this.earlierButton.hidden = !available;
    }

    /** Fetch every line before the first one held, oldest first, then prepend them at once. */
    async loadEarlier() {
      if (this.firstSeq == null || this.firstSeq <= 1) { this.setEarlierAvailable(false); return; }
      this.earlierButton.disabled = true;
      const upTo = this.firstSeq;
      const older = [];
      let since = 0;
      try {
        while (since < upTo - 1) {
          const page = await T.getJson(`/api/v1/jobs/${encodeURIComponent(this.jobId)}/logs/?since=${since}&limit=${FETCH_LIMIT}`);
          const lines = (page.results || []).filter((l) => l.seq < upTo);
          older.push(...lines);
          if (!page.results || !page.results.length || lines.length < page.results.length) break;
          since = page.next_since;
          this.earlierButton.textContent = `Loading… ${older.length.toLocaleString()}`;
        }
        this.prepend(older);
        this.setEarlierAvailable(false);
      } catch (err) {
        this.flashSummary(`could not load earlier lines: ${err.message}`);
      } finally {
        this.earlierButton.disabled = false;
        this.earlierButton.textContent = "Load earlier lines";
      }
    }

    /* ---------------------------------------------------------------- rendering ----------- */

    schedule() {
      if (!this.frame) this.frame = requestAnimationFrame(() => { this.frame = 0; this.render(); });
    }

    render() {
      const total = this.view.length;
      this.spacer.style.height = `${total * ROW_PX}px`;
      this.emptyNote.hidden = this.lines.length > 0;
      if (this.following) this.scrollToBottom();
      const top = this.el.scrollTop;
      const first = Math.max(0, Math.floor(top / ROW_PX) - OVERSCAN_ROWS);
      const last = Math.min(total, Math.ceil((top + this.el.clientHeight) / ROW_PX) + OVERSCAN_ROWS);
      const r = this.rendered;
      if (r.first !== first || r.last !== last || r.version !== this.version) {
        this.rowsEl.style.transform = `translateY(${first * ROW_PX}px)`;
        const fragment = document.createDocumentFragment();
        for (let position = first; position < last; position += 1) fragment.appendChild(this.renderRow(position));
        this.rowsEl.replaceChildren(fragment);
        this.rendered = { first, last, version: this.version };
      }
      this.renderSummary();
    }

    renderRow(position) {
      const line = this.lines[this.view[position]];
      const row = document.createElement("div");
      row.className = "log-row";
      if (line.stream === "stderr") row.classList.add("stderr");
      if (line.err) row.classList.add("err");
      if (position === this.highlighted) row.classList.add("current");
      const seq = document.createElement("span");
      seq.className = "ln";
      seq.textContent = line.seq;
      row.appendChild(seq);
      if (this.showLearner || this.learnersSeen.size > 1) {
        const prefix = document.createElement("span");
        prefix.className = "lp";
        prefix.textContent = `[${line.learner}] `;
        row.appendChild(prefix);
      }
      const text = document.createElement("span");
      text.className = "lt";
      this.fillText(text, line.line);
      row.appendChild(text);
      return row;
    }

    /** The line's text, with search matches marked. */
    fillText(el, text) {
      if (!this.pattern) { el.textContent = text; return; }
      const global = new RegExp(this.pattern.source, "gi");
      let at = 0;
      for (const match of text.matchAll(global)) {
        if (!match[0]) break;
        el.append(text.slice(at, match.index));
        const mark = document.createElement("mark");
        mark.textContent = match[0];
        el.appendChild(mark);
        at = match.index + match[0].length;
      }
      el.append(text.slice(at));
    }

    renderSummary() {
      const all = this.lines.length;
      const shown = this.view.length;
      let text = `${all.toLocaleString()} line${all === 1 ? "" : "s"}`;
      if (shown !== all) text += `, ${shown.toLocaleString()} shown`;
      if (this.firstSeq > 1) text += ` (from line ${this.firstSeq.toLocaleString()})`;
      if (!this.following && all) text += " · paused";
      this.summary.textContent = text;
    }
  }

  /**
   * Puts lines in seq order into the view, exactly once. Batches are handled one after another
   * (a gap fetch is async and must finish before later lines go in).
   */
  class LogIntake {
    constructor(view, jobId) {
      this.view = view;
      this.jobId = jobId;
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
          // A fresh page gets only the tail of a long log from the backlog; the rest loads on request.
          this.view.setEarlierAvailable(true);
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
      while (this.lastSeq < nextSeq - 1) {
        const since = this.lastSeq;
        const url = `/api/v1/jobs/${encodeURIComponent(this.jobId)}/logs/?since=${since}&limit=${FETCH_LIMIT}`;
        try {
          this.accept(((await T.getJson(url)).results || []).filter((l) => l.seq < nextSeq));
        } catch (err) {
          console.warn(`trainyard: lines ${since + 1}-${nextSeq - 1} could not be loaded`, err);
          return;
        }
        if (this.lastSeq === since) return; // nothing newer stored: the gap is permanent
      }
    }
  }

  T.LogView = LogView;
  T.LogIntake = LogIntake;
})();
