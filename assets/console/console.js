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
  function time(ms) { return ms ? new Date(Number(ms)).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC") : "never"; }
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
      text($("status-line"), "Updated " + new Date().toLocaleTimeString() + " from " + data.node + "; refreshes every 2 s.");
    } catch (err) {
      text($("status-line"), "Refresh failed (" + err.message + "); retrying.");
    }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  function render(d) {
    text($("node-name"), "· node " + d.node);
    const h = d.health;
    // A healthy placement with a failing dependency is "degraded" (as /readyz says).
    const shown = h.status === "healthy" && d.degraded.length > 0 ? "degraded" : h.status;
    const status = $("health-status"); status.className = "badge " + shown; status.textContent = shown;
    status.dataset.status = shown;
    text($("health-detail"), (d.ready ? "ready" : "not ready") + (d.fenced ? ", self-fenced" : "") + ": " + h.detail +
      (d.degraded.length > 0 ? "; unreachable: " + d.degraded.join(", ") : ""));
    text($("health-dependencies"), Object.entries(d.dependencies).map(([name, s]) =>
      name + " " + (s.up ? "up" : "down (" + (s.error || "no answer") + ")") + " at " + s.address).join("; ") || "none probed");
    text($("health-checked"), time(h.checked_at_ms));
    text($("health-success"), time(h.last_successful_at_ms));
    if (lastHealth !== shown) {
      transitions.unshift(new Date().toLocaleTimeString() + ": " + (lastHealth || "(page opened)") + " → " + shown);
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
      cell(tr, age(n.heartbeat_age_ms));
      cell(tr, n.incarnation);
      cell(tr, n.version);
      cell(tr, n.shards).className = "shards";
      cell(tr, n.incoming);
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
          " transfers; " + a.snapshot.cluster.waiters + " waiting; policy version " + a.snapshot.cluster.policy_version + ".";
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
      const tr = document.createElement("tr"); const td = cell(tr, "no events (or no Redis admission)"); td.colSpan = 6; ev.appendChild(tr);
    }
    for (const e of d.events.slice().reverse()) {
      const tr = document.createElement("tr");
      cell(tr, e.at_ms ? time(Number(e.at_ms) * (Number(e.at_ms) < 1e11 ? 1000 : 1)) : "");
      cell(tr, e.kind || ""); cell(tr, e.operation || ""); cell(tr, e.outcome || "");
      cell(tr, e.bytes ? bytes(e.bytes) : ""); cell(tr, e.tenant || "");
      ev.appendChild(tr);
    }

    const now = performance.now();
    const cr = $("counter-rows"); cr.replaceChildren();
    for (const [name, value] of Object.entries(d.counters)) {
      const tr = document.createElement("tr"); tr.dataset.counter = name;
      cell(tr, name.replace(/_/g, " "));
      cell(tr, name.endsWith("bytes") ? bytes(value) : value);
      let rate = "";
      if (previous && previous.node === d.node && name in previous.counters) {
        const dt = (now - previous.at) / 1000;
        const r = Math.max(0, value - previous.counters[name]) / dt;
        rate = name.endsWith("bytes") ? bytes(Math.round(r)) + "/s" : r.toFixed(2);
      }
      cell(tr, rate);
      cr.appendChild(tr);
    }
    previous = { node: d.node, at: now, counters: d.counters };
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
