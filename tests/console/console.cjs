// Drives the operator console in headless Debian chromium (playwright-core) against a
// live 3-node cluster started by tests/console_browser.rs. Checks content, not only that
// the page loads: sign-in, three active nodes whose shards add up to the shard count, a
// drained node that shows zero shards, a killed node that turns dead, a Redis server shut
// down, and a health summary that names both; the page fits 1280 and 1920 px wide
// windows (no horizontal overflow) in both states; one time format. Screenshots go to
// $SCREENSHOTS. Exit status 0 only when every check passed.
//
// Environment: PLAYWRIGHT_CORE (module directory), CONSOLE_URL (a node that stays up),
// ADMIN_TOKEN, SHARDS, DRAIN_NODE, KILL_NODE, KILL_PID, REDIS_PORT, SCREENSHOTS.
"use strict";
const net = require("net");
const { chromium } = require(process.env.PLAYWRIGHT_CORE);
const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(name + " is not set");
  return v;
};
const url = env("CONSOLE_URL");
const token = env("ADMIN_TOKEN");
const shards = Number(env("SHARDS"));
const drainNode = env("DRAIN_NODE");
const killNode = env("KILL_NODE");
const killPid = Number(env("KILL_PID"));
const shots = env("SCREENSHOTS");
const rawTenant = env("RAW_TENANT");
const redisPort = Number(env("REDIS_PORT"));
const WIDTHS = [1280, 1920];
// Upper bound for a state to appear (the page polls every 2 s); not a pass criterion.
const WAIT = 60000;

function check(cond, message) {
  if (!cond) throw new Error("check failed: " + message);
  console.log("ok: " + message);
}

// Shut the Redis server down for real (SHUTDOWN NOSAVE ends its process).
function shutdownRedis(port) {
  return new Promise((resolve) => {
    const socket = net.connect(port, "127.0.0.1", () => socket.write("SHUTDOWN NOSAVE\r\n"));
    socket.on("close", resolve);
    socket.on("error", resolve);
  });
}

// Wait for the next refresh (the status line changes), then measure the page's width.
async function refreshed(page) {
  const before = await page.textContent("#status-line");
  await page.waitForFunction((b) => document.getElementById("status-line").textContent !== b, before, { timeout: WAIT });
}

async function fitsEveryWidth(page, state) {
  for (const width of WIDTHS) {
    await page.setViewportSize({ width, height: 900 });
    await refreshed(page);
    const m = await page.evaluate(() => ({ scroll: document.documentElement.scrollWidth, inner: window.innerWidth }));
    check(m.scroll <= m.inner, state + ": no horizontal overflow at " + width + " px (scrollWidth " + m.scroll + ", innerWidth " + m.inner + ")");
  }
}

// Every time on the page is UTC ISO 8601 to the second; no locale format.
async function oneTimeFormat(page) {
  const texts = await page.$$eval("#event-rows td.time, #health-checked, #health-success, #transitions li, #status-line",
    (els) => els.map((e) => e.textContent));
  const stamps = texts.join(" ").match(/\d{4}-\d{2}-\d{2}[T ][^ ]*/g) || [];
  const bad = stamps.filter((t) => !/^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z:?;?$/.test(t));
  const locale = texts.filter((t) => /\b(AM|PM)\b|\d{1,2}\/\d{1,2}\/\d{4}/.test(t));
  check(stamps.length >= 4 && bad.length === 0 && locale.length === 0,
    "one time format, UTC ISO 8601: " + JSON.stringify({ stamps: stamps.slice(0, 6), bad, locale }));
}

async function rows(page) {
  return page.$$eval("#node-rows tr", (trs) =>
    trs.map((tr) => ({ node: tr.dataset.node, state: tr.dataset.state, shards: Number(tr.dataset.shards) })));
}

(async () => {
  const browser = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const requests = [];
  try {
    const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
    const page = await context.newPage();
    page.on("request", (r) => requests.push(r.url()));
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });

    await page.goto(url + "/console");
    check(await page.isVisible("#login"), "the page asks for the admin token first");
    check(!(await page.isVisible("#console")), "no cluster data before sign-in");

    await page.fill("#token", "wrong-token-wrong-token");
    await page.click("#login-form button");
    await page.waitForFunction(() => /refused/.test(document.getElementById("status-line").textContent), null, { timeout: WAIT });
    check(await page.isVisible("#login"), "a wrong token is refused");
    errors.length = 0; // the refused sign-in logged its 401; count errors from here on

    await page.fill("#token", token);
    await page.click("#login-form button");
    await page.waitForFunction((n) => {
      const trs = [...document.querySelectorAll("#node-rows tr")];
      const sum = trs.reduce((a, tr) => a + Number(tr.dataset.shards), 0);
      return trs.length === 3 && trs.every((tr) => tr.dataset.state === "active") && sum === n;
    }, shards, { timeout: WAIT });
    let r = await rows(page);
    check(r.length === 3 && r.every((x) => x.shards > 0), "three active nodes, each owning shards: " + JSON.stringify(r));
    check(/healthy|rebalancing/.test(await page.textContent("#health-status")), "health state shown");
    check(/term \d+ on node-/.test(await page.textContent("#manager")), "manager, term and node shown: " + await page.textContent("#manager"));
    check((await page.textContent("#shard-summary")).startsWith(shards + " shards"), "shard map summary");
    check(await page.isVisible("#shard-map"), "shard map drawn");
    await page.waitForFunction(() => document.querySelectorAll("#event-rows tr.event").length > 0, null, { timeout: WAIT });
    const tenants = await page.$$eval("#event-rows tr.event td.tenant", (tds) => tds.map((td) => td.textContent));
    const html = await page.content();
    check(tenants.length > 0 && tenants.every((t) => /^[0-9a-f]{12}$/.test(t)) && !html.includes(rawTenant),
      "decision events show a tenant hash, never the raw tenant id: " + JSON.stringify(tenants));
    check(!html.includes(token), "the admin token is not in the page");
    check(await page.textContent("#summary-status") === "healthy", "the summary says healthy with three active nodes and every dependency up");
    const policy = await page.textContent("#occupancy");
    check(/policy: (default limits|last changed \d{4}-\d{2}-\d{2}T)/.test(policy), "the policy version is readable: " + policy);
    const eventHeights = await page.$$eval("#event-rows tr.event", (trs) => trs.map((tr) => tr.getBoundingClientRect().height));
    const lineHeight = await page.$eval("#event-rows tr.event td", (td) => parseFloat(getComputedStyle(td).lineHeight) || 20);
    check(eventHeights.every((h) => h < 2 * lineHeight), "compact event rows, one line each: " + JSON.stringify({ eventHeights, lineHeight }));
    await fitsEveryWidth(page, "three nodes");
    await oneTimeFormat(page);
    await page.screenshot({ path: shots + "/console-1-three-nodes.png", fullPage: true });

    // drain one node through the admin API; the page must show it with zero shards
    const drained = await page.evaluate(async ([n, t]) => {
      const r = await fetch("/v1/admin/nodes/" + n + "/drain", { method: "POST", headers: { Authorization: "Bearer " + t } });
      return r.status;
    }, [drainNode, token]);
    check(drained === 202, "drain of " + drainNode + " accepted");
    await page.waitForFunction((n) => {
      const tr = document.querySelector('#node-rows tr[data-node="' + n + '"]');
      return tr && tr.dataset.shards === "0" && tr.dataset.state === "draining";
    }, drainNode, { timeout: WAIT });
    r = await rows(page);
    check(r.find((x) => x.node === drainNode).shards === 0, "the drained node shows zero shards: " + JSON.stringify(r));
    await page.screenshot({ path: shots + "/console-2-drained.png", fullPage: true });

    // kill another node; the page must show it dead
    process.kill(killPid, "SIGKILL");
    await page.waitForFunction((n) => {
      const tr = document.querySelector('#node-rows tr[data-node="' + n + '"]');
      return tr && tr.dataset.state === "dead";
    }, killNode, { timeout: WAIT });
    await page.waitForFunction((n) => {
      const tr = document.querySelector('#node-rows tr[data-node="' + n + '"]');
      return tr && tr.dataset.shards === "0";
    }, killNode, { timeout: WAIT });
    r = await rows(page);
    check(r.find((x) => x.node === killNode).state === "dead", "the killed node turns dead: " + JSON.stringify(r));

    // shut Redis down; the summary must name the dead node, the draining node and Redis
    await shutdownRedis(redisPort);
    await page.waitForFunction(() => {
      const items = [...document.querySelectorAll("#summary-problems li")].map((li) => li.textContent);
      return items.some((t) => /^redis down at /.test(t));
    }, null, { timeout: WAIT });
    const problems = await page.$$eval("#summary-problems li", (lis) => lis.map((li) => li.textContent));
    check(problems.some((t) => t === "1 of 3 nodes dead: " + killNode), "the health summary shows the dead node: " + JSON.stringify(problems));
    check(problems.some((t) => t === "1 of 3 nodes draining: " + drainNode), "the health summary shows the draining node: " + JSON.stringify(problems));
    check(problems.some((t) => /^redis down at redis:\/\/127\.0\.0\.1:\d+/.test(t)), "the health summary shows the failing dependency: " + JSON.stringify(problems));
    check(await page.textContent("#summary-status") === "degraded", "the summary status is degraded");
    check(/HTTP 5xx on this node: \d+ of \d+ requests since start; [\d.]+\/s, [\d.]+% of \d+ requests in the last \d+ s/.test(await page.textContent("#summary-http")),
      "the summary shows the 5xx rate: " + await page.textContent("#summary-http"));
    check(await page.getAttribute('#health-dependencies li[data-dependency="redis"]', "data-up") === "false", "the dependency list shows redis down");
    await fitsEveryWidth(page, "dead node and Redis down");
    await oneTimeFormat(page);
    await page.setViewportSize({ width: 1280, height: 900 });
    await refreshed(page);
    await page.screenshot({ path: shots + "/console-3-killed.png", fullPage: true });

    const external = requests.filter((u) => !u.startsWith(url));
    check(external.length === 0, "no request leaves the node (no CDN): " + JSON.stringify(external));
    check(errors.length === 0, "no script errors: " + JSON.stringify(errors));
  } finally {
    await browser.close();
  }
})().catch((e) => {
  console.error(e && e.stack ? e.stack : String(e));
  process.exit(1);
});
