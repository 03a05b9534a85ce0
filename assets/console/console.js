// Graviton operator console. Polls GET /v1/admin/console with the admin token every two
// seconds and renders it. No external resources; the token stays in sessionStorage.
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const KEY = "graviton.console.token";
  // Colour-blind-safe palette (Okabe-Ito) plus greys; unassigned shards are white.
  const COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000", "#999999"];
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let previous = null;
  let lastHealth = null;
  const transitions = [];

  function token() { return sessionStorage.getItem(KEY); }

  function text(el, value) { el.textContent = value; return el; }
  function cell(row, value) { const td = document.createElement("td"); td.textContent = value; row.appendChild(td); return td; }
  function badge(value) { const s = document.createElement("span"); s.className = "badge " + value; s.textContent = value; return s; }
  // One time format everywhere: UTC, ISO 8601, to the second ("2026-12-05T07:52:35Z").
  function iso(ms) { return new Date(Number(ms)).toISOString().replace(/\.\d+Z$/, "Z"); }
  function time(ms) { return ms ? iso(ms) : "never"; }
  // Admission's policy version is max(previous + 1, Redis time in ms) (docs/admission.md):
  // shown as the time of the last policy change; 0 means no override was ever set.
  function policy(v) {
    const n = Number(v);
    if (!n) return "default limits (no override set yet)";
    if (n > 1e12) return "last changed " + iso(n);
    return "version " + n;
  }
  function age(ms) { return ms < 1000 ? ms + " ms" : (ms / 1000).toFixed(1) + " s"; }
  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0; let v = Number(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : v) + " " + units[i];
  }

  function signedIn(on) {
    $("login").hidden = on;
    $("console").hidden = !on;
  }

  function signOut(message) {
    sessionStorage.removeItem(KEY);
    if (timer) clearTimeout(timer);
    timer = null; previous = null;
    signedIn(false);
    text($("status-line"), message || "Signed out.");
  }

  async function refresh() {
    timer = null;
    const t = token();
    if (!t) { signOut("Not signed in."); return; }
    try {
      const response = await fetch("/v1/admin/console", { headers: { Authorization: "Bearer " + t }, cache: "no-store" });
      if (response.status === 401 || response.status === 403) {
        const body = await response.json().catch(() => ({}));
        signOut("Sign-in refused: " + (body.message || response.status));
        return;
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const data = await response.json();
      signedIn(true);
      render(data);
      text($("status-line"), "Updated " + iso(Date.now()) + " from " + data.node + "; refreshes every 2 s.");
    } catch (err) {
      text($("status-line"), "Refresh failed (" + err.message + "); retrying.");
    }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  // The 5xx share of this node's requests between two refreshes (null before the second).
  function recent5xx(d) {
    if (!previous || previous.node !== d.node) return null;
    const requests = d.summary.http.requests - previous.http.requests;
    const errors = d.summary.http.errors_5xx - previous.http.errors_5xx;
    const seconds = (performance.now() - previous.at) / 1000;
    return { requests: Math.max(0, requests), errors: Math.max(0, errors), seconds };
  }

  function renderSummary(d) {
    const sum = d.summary;
    let shown = sum.status;
    const problems = sum.problems.map((p) => ({ text: p, level: /dead|down|fenced|not ready|unassigned/.test(p) ? "bad" : "warn" }));
    const recent = recent5xx(d);
    let http = "HTTP 5xx on this node: " + sum.http.errors_5xx + " of " + sum.http.requests + " requests since start";
    if (recent) {
      const share = recent.requests ? recent.errors / recent.requests : 0;
      http += "; " + (recent.errors / Math.max(recent.seconds, 0.001)).toFixed(2) + "/s, " + (100 * share).toFixed(1) +
        "% of " + recent.requests + " requests in the last " + recent.seconds.toFixed(0) + " s";
      // The same threshold as the GravitonHighErrorRate alert (5%).
      if (recent.errors > 0 && share > 0.05) {
        problems.push({ text: (100 * share).toFixed(1) + "% of requests answered 5xx in the last " + recent.seconds.toFixed(0) + " s", level: "bad" });
        if (shown === "healthy" || shown === "rebalancing") shown = "degraded";
      }
    }
    text($("summary-http"), http + ".");
    const badgeEl = $("summary-status"); badgeEl.className = "badge " + shown; badgeEl.textContent = shown;
    badgeEl.dataset.status = shown;
    const ul = $("summary-problems"); ul.replaceChildren();
    if (!problems.length) {
      const li = document.createElement("li"); li.className = "none";
      li.textContent = "No problem: " + sum.nodes.active + " of " + sum.nodes.total + " nodes active, every dependency up.";
      ul.appendChild(li);
    }
    for (const p of problems) { const li = document.createElement("li"); li.className = p.level; li.textContent = p.text; ul.appendChild(li); }
    return shown;
  }

  function render(d) {
    text($("node-name"), "· node " + d.node);
    const shown = renderSummary(d);
    const h = d.health;
    const status = $("health-status"); status.className = "badge " + h.status; status.textContent = h.status;
    status.dataset.status = h.status;
    text($("health-detail"), (d.ready ? "ready" : "not ready") + (d.fenced ? ", self-fenced" : "") + ": " + h.detail);
    const deps = $("health-dependencies"); deps.replaceChildren();
    const entries = Object.entries(d.dependencies);
    if (!entries.length) { const li = document.createElement("li"); li.textContent = "none probed"; deps.appendChild(li); }
    for (const [name, s] of entries) {
      const li = document.createElement("li"); li.dataset.dependency = name; li.dataset.up = s.up;
      li.append(badge(s.up ? "up" : "down"), " " + name + " at " + s.address + (s.up ? "" : ": " + (s.error || "no answer")));
      deps.appendChild(li);
    }
    text($("health-checked"), time(h.checked_at_ms));
    text($("health-success"), time(h.last_successful_at_ms));
    if (lastHealth !== shown) {
      transitions.unshift(iso(Date.now()) + ": " + (lastHealth || "(page opened)") + " → " + shown);
      transitions.length = Math.min(transitions.length, 20);
      lastHealth = shown;
      const ol = $("transitions"); ol.replaceChildren();
      for (const t of transitions) { const li = document.createElement("li"); li.textContent = t; ol.appendChild(li); }
    }
    const m = d.manager;
    text($("manager"), d.mode === "embedded" ? "none (embedded mode)" :
      "term " + m.term + " on " + (m.node || "unknown") + (m.this_node ? " (this node)" : ""));
    text($("mode"), d.mode + ", " + d.version + ", up " + age(d.uptime_seconds * 1000));

    // nodes
    const rows = $("node-rows"); rows.replaceChildren();
    d.nodes.forEach((n, i) => {
      const tr = document.createElement("tr");
      tr.dataset.node = n.id; tr.dataset.state = n.state; tr.dataset.shards = n.shards;
      const th = document.createElement("th"); th.scope = "row";
      const sw = document.createElement("span"); sw.className = "swatch"; sw.style.background = COLOURS[i % COLOURS.length];
      sw.setAttribute("aria-hidden", "true");
      th.append(sw, n.id); tr.appendChild(th);
      cell(tr, "").appendChild(badge(n.state));
      cell(tr, age(n.heartbeat_age_ms)).className = "num";
      cell(tr, n.incarnation).className = "num";
      cell(tr, n.version);
      cell(tr, n.shards).className = "num shards";
      cell(tr, n.incoming).className = "num";
      rows.appendChild(tr);
    });

    // shard map: one square per shard, coloured by owner; moving shards are outlined
    const s = d.shards;
    const canvas = $("shard-map");
    const cols = Math.ceil(Math.sqrt(s.count * 4));
    const size = Math.max(2, Math.floor(640 / cols));
    const rowsN = Math.ceil(s.count / cols);
    canvas.width = cols * size; canvas.height = rowsN * size;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    const moving = new Set(s.moving);
    s.owners.forEach((owner, shard) => {
      const x = (shard % cols) * size, y = Math.floor(shard / cols) * size;
      ctx.fillStyle = owner < 0 ? "#ffffff" : COLOURS[owner % COLOURS.length];
      ctx.fillRect(x, y, size - (size > 3 ? 1 : 0), size - (size > 3 ? 1 : 0));
      if (moving.has(shard)) { ctx.strokeStyle = "#a30d0d"; ctx.lineWidth = 1; ctx.strokeRect(x + 0.5, y + 0.5, size - 2, size - 2); }
    });
    const unassigned = s.owners.filter((o) => o < 0).length;
    const summary = s.count + " shards: " + d.nodes.map((n) => n.id + " " + n.shards).join(", ") +
      "; " + unassigned + " unassigned; " + s.moving.length + " moving.";
    text($("shard-summary"), summary);
    canvas.setAttribute("aria-label", "Shard map. " + summary);
    const legend = $("shard-legend"); legend.replaceChildren();
    d.nodes.forEach((n, i) => {
      const li = document.createElement("li");
      const sw = document.createElement("span"); sw.className = "swatch"; sw.style.background = COLOURS[i % COLOURS.length];
      sw.setAttribute("aria-hidden", "true");
      li.append(sw, n.id + ": " + n.shards + " (" + (s.count ? Math.round(100 * n.shards / s.count) : 0) + "%)");
      legend.appendChild(li);
    });

    // admission occupancy against each ceiling
    const occ = $("occupancy"); occ.replaceChildren();
    const bar = (label, used, limit, fmt) => {
      const row = document.createElement("div"); row.className = "bar-row";
      const id = "bar-" + label.replace(/\W+/g, "-").toLowerCase();
      const l = document.createElement("label"); l.htmlFor = id; l.textContent = label;
      const meter = document.createElement("meter"); meter.id = id; meter.min = 0; meter.max = Math.max(1, limit); meter.value = used;
      meter.high = 0.8 * limit;
      const v = document.createElement("span"); v.textContent = fmt(used) + " of " + fmt(limit);
      row.append(l, meter, v); occ.appendChild(row);
    };
    bar("Hot sessions", d.sessions.hot, d.sessions.capacity, String);
    bar("Uploading sessions", d.sessions.active, d.sessions.capacity, String);
    const a = d.admission;
    if (a.snapshot) {
      const l = a.snapshot.local;
      bar("Local transfer bytes", l.process_bytes_capacity - l.process_bytes_available, l.process_bytes_capacity, bytes);
      if (a.snapshot.cluster) {
        const c = a.snapshot.cluster.occupancy;
        const p = document.createElement("p");
        p.textContent = "Cluster (Redis): " + bytes(c.service_bytes) + " admitted in " + c.service_transfers +
          " transfers; " + a.snapshot.cluster.waiters + " waiting; policy: " + policy(a.snapshot.cluster.policy_version) + ".";
        occ.appendChild(p);
      } else {
        const p = document.createElement("p"); p.className = "muted"; p.textContent = "Cluster admission (Redis) is not configured on this node.";
        occ.appendChild(p);
      }
    } else {
      const p = document.createElement("p"); p.textContent = "Admission: " + (a.error || "unavailable"); occ.appendChild(p);
    }

    const ev = $("event-rows"); ev.replaceChildren();
    if (!d.events.length) {
      const tr = document.createElement("tr"); const td = cell(tr, "no events (or no Redis admission)"); td.colSpan = 5; ev.appendChild(tr);
    }
    for (const e of d.events.slice().reverse()) {
      const tr = document.createElement("tr"); tr.className = "event";
      // at_ms is in milliseconds; older streams wrote seconds.
      const at = Number(e.at_ms);
      cell(tr, e.at_ms ? iso(at * (at < 1e11 ? 1000 : 1)) : "").className = "time";
      // kind and outcome are usually the same word; show the outcome only when it differs.
      const kind = e.kind || "";
      cell(tr, kind + (e.outcome && e.outcome !== kind ? " (" + e.outcome + ")" : ""));
      cell(tr, e.operation || "");
      cell(tr, e.bytes ? bytes(e.bytes) : "").className = "num";
      cell(tr, e.tenant || "").className = "tenant";
      ev.appendChild(tr);
    }

    const now = performance.now();
    const cr = $("counter-rows"); cr.replaceChildren();
    for (const [name, value] of Object.entries(d.counters)) {
      const tr = document.createElement("tr"); tr.dataset.counter = name;
      cell(tr, name.replace(/_/g, " "));
      cell(tr, name.endsWith("bytes") ? bytes(value) : value).className = "num";
      let rate = "";
      if (previous && previous.node === d.node && name in previous.counters) {
        const dt = (now - previous.at) / 1000;
        const r = Math.max(0, value - previous.counters[name]) / dt;
        rate = name.endsWith("bytes") ? bytes(Math.round(r)) + "/s" : r.toFixed(2);
      }
      cell(tr, rate).className = "num";
      cr.appendChild(tr);
    }
    previous = { node: d.node, at: now, counters: d.counters, http: d.summary.http };
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (e) => {
      e.preventDefault();
      sessionStorage.setItem(KEY, $("token").value);
      $("token").value = "";
      text($("status-line"), "Signing in…");
      if (timer) clearTimeout(timer);
      refresh();
    });
    $("sign-out").addEventListener("click", () => signOut());
    if (token()) refresh(); else signedIn(false);
  });
})();
