// fencepost dashboard: plain JavaScript, no build step, nothing fetched from outside.
"use strict";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
let skew = 0; // server clock minus this browser's clock, ms

function serverNow() { return Date.now() + skew; }
function noteNow(serverMs) { if (serverMs) skew = serverMs - Date.now(); }

function pad(n) { return String(n).padStart(2, "0"); }
function localTime(ms) {
  if (ms === null || ms === undefined) return "–";
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}
function duration(ms) {
  const s = Math.floor(Math.max(0, ms) / 1000);
  if (ms < 1000) return `${Math.max(0, Math.round(ms))}ms`;
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${pad(s % 60)}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${pad(Math.floor(s % 3600 / 60))}m`;
  return `${Math.floor(s / 86400)}d${pad(Math.floor(s % 86400 / 3600))}h`;
}
function ago(ms) { return `${duration(serverNow() - ms)} ago`; }

// "live" | "lock-delay" | "expired" | "" (no lease), and the text for it
function leaseState(run, now) {
  const le = run.lease;
  if (!le) return { state: "", text: "–" };
  const left = le.expires_at - now;
  if (left > 0) return { state: "live", text: `${duration(left)} left` };
  const delayLeft = left + le.lock_delay_ms;
  if (delayLeft > 0) {
    return { state: "lock-delay", text: `expired; lock-delay ${duration(delayLeft)} left`,
             short: `${duration(delayLeft)} left` };
  }
  return { state: "expired", text: `expired ${duration(-left)} ago`, short: `${duration(-left)} ago` };
}

// Renewals are answered from memory and make no change event (docs/SPEC.md §5.2):
// a running lease shown as (nearly) run out is read again: every 0.5 s around its
// shown expiry, every 5 s once it has looked expired for long.
function recheckDue(runs, now, last) {
  let wait = Infinity;
  for (const run of runs) {
    if (run.status !== "running" || !run.lease) continue;
    const left = run.lease.expires_at - now;
    if (left < 1000) wait = Math.min(wait, left > -5000 ? 500 : 5000);
  }
  return now - (last || 0) >= wait;
}

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);
  return e;
}

function toast(text, isError) {
  const t = document.getElementById("toast");
  t.textContent = text;
  t.className = isError ? "toast error" : "toast";
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, isError ? 6000 : 3000);
}

// -- token (sent as a bearer token with every request; kept for this tab only) ----------

function setupToken() {
  const input = document.getElementById("token");
  input.value = sessionStorage.getItem("fencepost-token") || "";
  input.addEventListener("change", () => {
    sessionStorage.setItem("fencepost-token", input.value);
    location.reload();  // every read and the live feed again, with the new token
  });
}
function authHeaders() {
  const token = sessionStorage.getItem("fencepost-token") || document.getElementById("token").value;
  return token ? { authorization: `Bearer ${token}` } : {};
}

async function getJSON(url) {
  const resp = await fetch(url, { headers: authHeaders() });
  const doc = await resp.json();
  if (!resp.ok) throw new Error(doc.error ? `${doc.error.code}: ${doc.error.message}` : resp.statusText);
  noteNow(doc.now);
  return doc;
}

async function act(action, runId, extra) {
  const resp = await fetch(`/api/${action}`, {
    method: "POST",
    headers: { "content-type": "application/json", ...authHeaders() },
    body: JSON.stringify({ run_id: runId, ...(extra || {}) }),
  });
  const doc = await resp.json();
  if (!resp.ok) {
    toast(`${action} ${runId}: ${doc.error.code}: ${doc.error.message}`, true);
    return null;
  }
  toast(`${action === "cancel" ? "cancelled" : "resumed"} ${runId}`);
  return doc.run;
}

// A button that asks once more before it acts (no modal dialog).
function actionButton(label, action, run, danger) {
  const b = el("button", { type: "button", class: danger ? "act danger" : "act",
                            "data-action": action, "data-run": run.run_id }, label);
  b.addEventListener("click", async (e) => {
    e.stopPropagation();
    if (danger && !b.classList.contains("armed")) {
      b.classList.add("armed");
      b.textContent = `confirm ${label.toLowerCase()}`;
      setTimeout(() => { b.classList.remove("armed"); b.textContent = label; }, 4000);
      return;
    }
    b.disabled = true;
    const extra = action === "cancel" ? { message: "cancelled from the dashboard" } : {};
    await act(action, run.run_id, extra);
    b.disabled = false;
  });
  return b;
}

function actionsFor(run, now) {
  const out = [];
  if (TERMINAL.has(run.status)) return out;
  const ls = leaseState(run, now).state;
  if (run.status === "suspended" || (run.status === "running" && ls === "expired"))
    out.push(actionButton("Resume", "resume", run, false));
  out.push(actionButton("Cancel", "cancel", run, true));
  return out;
}

function statusBadge(status) { return el("span", { class: `st st-${status}` }, status); }

// -- live updates (server-sent events fed by the change feed) ----------------------

function liveUpdates(query, onChanges, onReset) {
  // fetch, not EventSource: it can send the token (authorization: Bearer).
  const badge = document.getElementById("live");
  const handlers = {
    hello: (doc) => {
      noteNow(doc.now);
      badge.className = "live on"; badge.textContent = "live";
      onReset();
    },
    changes: (doc) => { noteNow(doc.now); onChanges(doc.changes); },
    reset: () => { onReset(); },
  };
  let controller = null;
  function off(text) { badge.className = "live off"; badge.textContent = text; }
  async function connect() {
    controller = new AbortController();
    let retryMs = 1000;
    try {
      const resp = await fetch(`/api/events${query}`,
                               { headers: authHeaders(), signal: controller.signal });
      if (!resp.ok) {
        const doc = await resp.json().catch(() => ({}));
        off(doc.error ? `live off: ${doc.error.code}` : "reconnecting…");
        badge.title = doc.error ? doc.error.message : "";
        retryMs = 5000;
        onReset();  // no live feed (refused): load anyway, every retry, and show why
      } else {
        const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            let name = "message", data = "";
            for (const line of block.split("\n")) {
              if (line.startsWith("event: ")) name = line.slice(7);
              else if (line.startsWith("data: ")) data += line.slice(6);
            }
            if (data && handlers[name]) handlers[name](JSON.parse(data));
          }
        }
        off("reconnecting…");
      }
    } catch (e) {
      if (controller.signal.aborted) return;
      off("reconnecting…");
    }
    setTimeout(connect, retryMs);
  }
  connect();
  window.addEventListener("beforeunload", () => controller && controller.abort());
}

// -- the runs page ----------------------------------------------------------------

const runsPage = {
  filters: { status: "", owner: "", prefix: "", limit: 50 },
  cursor: {},            // {after} or {before}: where the page starts / ends
  rows: new Map(),       // run_id -> {run, tr}
  hasPrev: false, hasNext: false, pending: null,

  init() {
    const q = new URLSearchParams(location.search);
    if (q.get("view") === "engine") return enginePage.init();
    if (q.get("view") === "shards") return shardsPage.init();
    document.getElementById("nav-runs").classList.add("active");
    this.filters.status = q.get("status") || "";
    this.filters.owner = q.get("owner") || "";
    this.filters.prefix = q.get("prefix") || "";
    this.filters.limit = Number(q.get("limit")) || 50;
    if (q.get("after") !== null) this.cursor = { after: q.get("after") };
    else if (q.get("before") !== null) this.cursor = { before: q.get("before") };
    document.getElementById("f-status").value = this.filters.status;
    document.getElementById("f-owner").value = this.filters.owner;
    document.getElementById("f-prefix").value = this.filters.prefix;
    document.getElementById("f-limit").value = String(this.filters.limit);
    document.getElementById("filters").addEventListener("submit", (e) => {
      e.preventDefault();
      this.filters = {
        status: document.getElementById("f-status").value,
        owner: document.getElementById("f-owner").value.trim(),
        prefix: document.getElementById("f-prefix").value.trim(),
        limit: Number(document.getElementById("f-limit").value),
      };
      this.cursor = {};
      this.load();
    });
    document.getElementById("f-clear").addEventListener("click", () => {
      for (const id of ["f-status", "f-owner", "f-prefix"]) document.getElementById(id).value = "";
      document.getElementById("filters").requestSubmit();
    });
    document.getElementById("prev").addEventListener("click", () => {
      const first = this.order[0];
      this.cursor = first === undefined ? {} : { before: first };
      this.load();
    });
    document.getElementById("next").addEventListener("click", () => {
      const last = this.order[this.order.length - 1];
      this.cursor = last === undefined ? {} : { after: last };
      this.load();
    });
    liveUpdates("", (changes) => this.onChanges(changes), () => this.load());
    setInterval(() => this.tick(), 250);
  },

  query() {
    const q = new URLSearchParams();
    const f = this.filters;
    if (f.status) q.set("status", f.status);
    if (f.owner) q.set("owner", f.owner);
    if (f.prefix) q.set("prefix", f.prefix);
    if (f.limit !== 50) q.set("limit", String(f.limit));
    if (this.cursor.after !== undefined) q.set("after", this.cursor.after);
    if (this.cursor.before !== undefined) q.set("before", this.cursor.before);
    return q;
  },

  async load() {
    const q = this.query();
    history.replaceState(null, "", q.toString() ? `/?${q}` : "/");
    if (!q.has("limit")) q.set("limit", String(this.filters.limit));
    let doc;
    try {
      doc = await getJSON(`/api/runs?${q}`);
    } catch (err) {
      toast(String(err.message || err), true);
      return;
    }
    this.render(doc);
  },

  render(doc) {
    const tbody = document.querySelector("#runs tbody");
    const old = this.rows;
    this.rows = new Map();
    this.order = doc.runs.map((r) => r.run_id);
    tbody.replaceChildren(...doc.runs.map((run) => {
      const tr = this.row(run, old.has(run.run_id) ? old.get(run.run_id).run : null, old.size > 0);
      this.rows.set(run.run_id, { run, tr });
      return tr;
    }));
    this.hasPrev = doc.has_prev; this.hasNext = doc.has_next;
    document.getElementById("prev").disabled = !doc.has_prev;
    document.getElementById("next").disabled = !doc.has_next;
    document.getElementById("empty").hidden = doc.runs.length > 0;
    const first = doc.runs[0], last = doc.runs[doc.runs.length - 1];
    document.getElementById("page-info").textContent = first
      ? `${first.run_id} … ${last.run_id}` : "";
    document.getElementById("summary").textContent =
      `${doc.runs.length} shown · ${doc.total.toLocaleString()} runs stored · revision ${doc.revision}`;
    this.tick();
  },

  row(run, before, flashNew) {
    const now = serverNow();
    const ls = leaseState(run, now);
    const tr = el("tr", { "data-run": run.run_id, class: ls.state === "live" ? "" : ls.state },
      el("td", { class: "id" }, el("a", { href: `/runs/${encodeURIComponent(run.run_id)}` }, run.run_id)),
      el("td", {}, statusBadge(run.status)),
      el("td", { class: "owner" }, run.lease ? run.lease.owner : "–"),
      el("td", { class: "num token" }, String(run.fencing_token)),
      el("td", { class: "num" }, String(run.attempt)),
      el("td", { class: "lease" }),
      el("td", { class: "updated", title: localTime(run.updated_at) }, localTime(run.updated_at)),
      el("td", { class: "acts" }, ...actionsFor(run, now)));
    if (flashNew && (!before || before.version !== run.version)) tr.classList.add("flash");
    return tr;
  },

  matches(run) {
    const f = this.filters;
    if (f.status && run.status !== f.status) return false;
    if (f.owner && !(run.lease && run.lease.owner === f.owner)) return false;
    return !f.prefix || run.run_id.startsWith(f.prefix);
  },

  // Would this run id fall inside the page shown (so a refetch would show it)?
  inWindow(runId) {
    const n = this.order.length;
    if (n === 0) return true;
    const first = this.order[0], last = this.order[n - 1];
    if (runId < first) return !this.hasPrev;
    if (runId > last) return !this.hasNext || n < this.filters.limit;
    return true;
  },

  onChanges(changes) {
    let refetch = false;
    for (const ch of changes) {
      const shown = this.rows.get(ch.run_id);
      if (ch.kind === "delete" || !ch.run) { if (shown) refetch = true; continue; }
      if (shown) {
        if (!this.matches(ch.run)) { refetch = true; continue; }
        const tr = this.row(ch.run, shown.run, true);
        shown.tr.replaceWith(tr);
        this.rows.set(ch.run_id, { run: ch.run, tr });
      } else if (this.matches(ch.run) && this.inWindow(ch.run_id)) {
        refetch = true;
      }
    }
    if (refetch && !this.pending) {
      this.pending = setTimeout(() => { this.pending = null; this.load(); }, 150);
    }
    this.tick();
  },

  tick() {
    const now = serverNow();
    for (const { run, tr } of this.rows.values()) {
      const ls = leaseState(run, now);
      const cell = tr.querySelector("td.lease");
      const tag = ls.state === "expired" ? el("span", { class: "tag expired" }, "EXPIRED")
        : ls.state === "lock-delay" ? el("span", { class: "tag lock-delay" }, "LOCK-DELAY") : null;
      cell.replaceChildren(...(tag ? [tag, " ", ls.short] : [ls.text]));
      tr.classList.toggle("expired", ls.state === "expired");
      tr.classList.toggle("lock-delay", ls.state === "lock-delay");
    }
    const shown = [...this.rows.values()].map(({ run }) => run);
    if (!this.pending && recheckDue(shown, now, this.rechecked)) {
      this.rechecked = now;
      this.load();
    }
  },
};

// -- the engine store's runs --------------------------------------------------------

const enginePage = {
  offset: 0, limit: 50,
  init() {
    document.getElementById("nav-engine").classList.add("active");
    document.getElementById("ledger-view").hidden = true;
    document.getElementById("engine-view").hidden = false;
    document.getElementById("live").textContent = "refreshing every 2s";
    document.getElementById("e-filters").addEventListener("submit", (e) => {
      e.preventDefault(); this.offset = 0; this.load();
    });
    document.getElementById("e-prev").addEventListener("click", () => {
      this.offset = Math.max(0, this.offset - this.limit); this.load();
    });
    document.getElementById("e-next").addEventListener("click", () => {
      this.offset += this.limit; this.load();
    });
    this.load();
    setInterval(() => this.load(), 2000);
  },
  async load() {
    const q = new URLSearchParams({ offset: String(this.offset), limit: String(this.limit) });
    const status = document.getElementById("e-status").value.trim();
    const agent = document.getElementById("e-agent").value.trim();
    if (status) q.set("status", status);
    if (agent) q.set("agent", agent);
    let doc;
    try { doc = await getJSON(`/api/engine/runs?${q}`); } catch (err) { toast(String(err.message), true); return; }
    const now = doc.now;
    document.querySelector("#engine tbody").replaceChildren(...doc.runs.map((r) => {
      let claim = "–", cls = "";
      if (r.claim) {
        const left = r.claim.expires_at - now;
        claim = left > 0 ? `${duration(left)} left` : `expired ${duration(-left)} ago`;
        if (left <= 0) cls = "expired";
      }
      return el("tr", { class: cls, "data-run": r.id },
        el("td", { class: "id" }, r.id), el("td", {}, r.agent), el("td", {}, statusBadge(r.status)),
        el("td", {}, r.claim ? r.claim.owner : "–"), el("td", {}, claim),
        el("td", {}, localTime(r.created_at)), el("td", {}, localTime(r.updated_at)));
    }));
    document.getElementById("e-summary").textContent =
      `${doc.runs.length} shown of ${doc.total.toLocaleString()} matching`;
    document.getElementById("e-prev").disabled = this.offset === 0;
    document.getElementById("e-next").disabled = this.offset + doc.runs.length >= doc.total;
    document.getElementById("e-page-info").textContent = doc.total
      ? `${this.offset + 1}–${this.offset + doc.runs.length}` : "";
  },
};

// -- shards: who leads each, and what is in those led here ------------------------------

const shardsPage = {
  init() {
    document.getElementById("nav-shards").classList.add("active");
    document.getElementById("ledger-view").hidden = true;
    document.getElementById("shards-view").hidden = false;
    document.getElementById("live").textContent = "refreshing every 2s";
    this.load();
    setInterval(() => this.load(), 2000);
  },
  async load() {
    let doc;
    try { doc = await getJSON("/api/shards"); } catch (err) { toast(String(err.message), true); return; }
    const here = doc.shards.filter((s) => s.owner !== "");
    const sum = (key) => here.reduce((n, s) => n + s[key], 0);
    document.querySelector("#shards tbody").replaceChildren(...doc.shards.map((s) => {
      const num = (v) => el("td", { class: "num" }, s.owner ? v.toLocaleString() : "–");
      return el("tr", { class: s.owner ? "" : "elsewhere", "data-shard": String(s.index) },
        el("td", { class: "num" }, String(s.index)),
        el("td", {}, s.owner || "another coordinator"), el("td", {}, s.address || "unknown"),
        el("td", { class: "num" }, String(s.epoch)), num(s.runs), num(s.leases));
    }));
    document.getElementById("s-summary").textContent =
      `${doc.shard_count} shards, ${here.length} led by this coordinator: ` +
      `${sum("runs").toLocaleString()} runs, ${sum("leases").toLocaleString()} live leases`;
  },
};

// -- one run ----------------------------------------------------------------------

const runPage = {
  runId: "", run: null, pending: null,
  init() {
    this.runId = decodeURIComponent(location.pathname.slice("/runs/".length));
    document.title = `fencepost · ${this.runId}`;
    document.getElementById("run-id").textContent = this.runId;
    document.getElementById("crumb").textContent = this.runId;
    liveUpdates(`?run=${encodeURIComponent(this.runId)}`, () => {
      if (!this.pending) this.pending = setTimeout(() => { this.pending = null; this.load(); }, 100);
    }, () => this.load());
    setInterval(() => this.tick(), 250);
  },
  async load() {
    let doc;
    try { doc = await getJSON(`/api/runs/${encodeURIComponent(this.runId)}`); } catch (err) {
      document.getElementById("missing").hidden = false;
      document.getElementById("missing").textContent = String(err.message || err);
      return;
    }
    this.run = doc.run;
    this.render(doc);
  },
  cell(key, value, cls) {
    return el("div", { class: `cell ${cls || ""}`, "data-key": key },
      el("div", { class: "k" }, key), el("div", { class: "v" }, value));
  },
  render(doc) {
    const run = doc.run, now = serverNow();
    const badge = document.getElementById("run-status");
    if (!run) {
      badge.className = "badge"; badge.textContent = "deleted";
      document.getElementById("details").replaceChildren();
      document.getElementById("actions").replaceChildren();
    } else {
      badge.className = `st st-${run.status}`; badge.textContent = run.status;
      const le = run.lease;
      const cells = [
        this.cell("owner", le ? le.owner : "–"),
        this.cell("fencing token", String(run.fencing_token)),
        this.cell("attempt", String(run.attempt)),
        this.cell("lease", "–", "lease"),
        this.cell("lease ttl", le ? `${duration(le.ttl_ms)}${le.lock_delay_ms ? `, lock-delay ${duration(le.lock_delay_ms)}` : ""}` : "–"),
        this.cell("checkpoint", run.checkpoint_ref ? `${run.checkpoint_ref.key} v${run.checkpoint_ref.snapshot_version}` : "–"),
        this.cell("outcome", run.outcome ? `${run.outcome.code}${run.outcome.message ? ` — ${run.outcome.message}` : ""}` : "–"),
        this.cell("created", localTime(run.created_at)),
        this.cell("updated", `${localTime(run.updated_at)}`),
        this.cell("version / revision", `${run.version} / ${run.revision}`),
      ];
      if (run.suspension) cells.push(this.cell("waiting for", run.suspension.pending_approval_ids.join(", ") || "–"));
      document.getElementById("details").replaceChildren(...cells);
      document.getElementById("actions").replaceChildren(...actionsFor(run, now));
    }
    const items = doc.timeline.slice().reverse().map((t) => el("li",
      { class: `ev-${t.event.replace(/ /g, "-")}`, "data-event": t.event },
      el("span", { class: "when", title: t.at ? new Date(t.at).toISOString() : "" },
        t.count > 1 ? `${localTime(t.at)} → ${localTime(t.last_at).slice(11)}` : localTime(t.at)),
      el("span", { class: "what" }, t.count > 1 ? `${t.event} ×${t.count}` : t.event),
      el("span", {}, t.who ? el("span", { class: "who" }, t.who) : null, t.who && t.detail ? " · " : "",
        t.detail || ""),
      el("span", { class: "meta" }, `token ${t.fencing_token ?? "–"} · rev ${t.revision}`)));
    if (doc.truncated) items.push(el("li", { class: "ev-more" }, el("span", { class: "muted" }, "older changes not shown")));
    document.getElementById("timeline").replaceChildren(...items);
    this.tick();
  },
  tick() {
    if (!this.run) return;
    const ls = leaseState(this.run, serverNow());
    const cell = document.querySelector('#details .cell[data-key="lease"]');
    if (!cell) return;
    cell.classList.toggle("expired", ls.state === "expired");
    cell.classList.toggle("lock-delay", ls.state === "lock-delay");
    cell.querySelector(".v").textContent = ls.text;
    const now = serverNow();
    if (!this.pending && recheckDue([this.run], now, this.rechecked)) {
      this.rechecked = now;
      this.load();
    }
  },
};

document.addEventListener("DOMContentLoaded", () => {
  setupToken();
  if (document.body.dataset.page === "run") runPage.init();
  else runsPage.init();
});
