// Drives the operator console in headless Debian chromium (playwright-core) against a
// live 3-node cluster started by tests/console_browser.rs. Checks content, not only that
// the page loads: sign-in, three active nodes whose shards add up to the shard count, a
// drained node that shows zero shards, a killed node that turns dead. Screenshots go to
// $SCREENSHOTS. Exit status 0 only when every check passed.
//
// Environment: PLAYWRIGHT_CORE (module directory), CONSOLE_URL (a node that stays up),
// ADMIN_TOKEN, SHARDS, DRAIN_NODE, KILL_NODE, KILL_PID, SCREENSHOTS.
"use strict";
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
// Upper bound for a state to appear (the page polls every 2 s); not a pass criterion.
const WAIT = 60000;

function check(cond, message) {
  if (!cond) throw new Error("check failed: " + message);
  console.log("ok: " + message);
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
    const context = await browser.newContext({ viewport: { width: 1366, height: 900 } });
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
    await page.waitForFunction(() => [...document.querySelectorAll("#event-rows tr")].some((tr) => tr.cells.length === 6), null, { timeout: WAIT });
    const tenants = await page.$$eval("#event-rows tr", (trs) => trs.filter((tr) => tr.cells.length === 6).map((tr) => tr.cells[5].textContent));
    const html = await page.content();
    check(tenants.length > 0 && tenants.every((t) => /^[0-9a-f]{12}$/.test(t)) && !html.includes(rawTenant),
      "decision events show a tenant hash, never the raw tenant id: " + JSON.stringify(tenants));
    check(!html.includes(token), "the admin token is not in the page");
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
