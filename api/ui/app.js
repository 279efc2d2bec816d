/* spliceway dashboard: plain JavaScript, no build step, no third-party code.
 *
 * Everything comes from this engine's control API (../api/v1 from /ui/, same origin):
 * - the event stream (GET /api/v1/events/stream), read with fetch() and a streaming
 *   body reader rather than EventSource, so it can carry the Authorization header;
 *   frames are parsed here and a dropped stream resumes with Last-Event-ID;
 * - active flows: the stream's flow.snapshot is the baseline, then every flow event's
 *   record is merged keeping the highest revision per flow_id; a completed record
 *   removes the flow (docs/events.md, interface 4.3);
 * - only flow.* events carry flow records: nothing else (ipc.*, engine.*) ever makes a row;
 * - throughput from stats.sampled; a flow's speed from its record's throughput (fed by
 *   flow.updated), dropped to zero once no sample has come for it;
 * - policies (each member's health engine-wide: member_health), sinks, config (mode,
 *   rules) and capabilities from queries; the engine's log from GET /api/v1/logs, polled;
 *   actions through POST /api/v1/commands.
 * The API key, when the engine needs one, is asked for on a 401 and kept only in
 * sessionStorage (this tab). All text reaches the DOM through textContent.
 */
"use strict";

(() => {
  // Relative to the page (/ui/), so the page also works behind a reverse proxy that
  // serves the engine under a path prefix.
  const API = "../api/v1";
  const KEY_STORAGE = "spliceway.dashboard.apiKey";
  /** How many past events the first connection replays from the ring. */
  const BACKFILL = 200;
  const EVENT_BUFFER = 500;
  const EVENTS_SHOWN = 100;
  const FLOW_ROWS_MAX = 500;
  const ENDED_MEMORY = 4096;
  const CHART_WINDOW_MS = 120000;
  const SINKS_EVERY_MS = 3000;
  const CONFIG_EVERY_MS = 10000;
  const POLICIES_EVERY_MS = 15000;
  const LOGS_EVERY_MS = 2000;
  const LOG_BUFFER = 500;
  const LOGS_SHOWN = 200;
  /** Flows whose rule this page has counted (bounded: the oldest are forgotten). */
  const RULE_MEMORY = 4096;
  /** A stream silent this long (keep-alives come every 10 s) is considered dead. */
  const STREAM_SILENCE_MS = 35000;
  const FREQUENT = new Set(["stats.sampled", "flow.updated"]);
  const IPC_EVENTS = new Set(["ipc.connected", "ipc.disconnected"]);
  /** The only events whose payload.record is a flow record (docs/events.md). */
  const FLOW_EVENTS = new Set(["flow.started", "flow.routed", "flow.updated", "flow.completed"]);
  const LEVEL_RANK = { debug: 0, info: 1, warn: 2, error: 3 };

  const $ = (id) => document.getElementById(id);

  // ---------------------------------------------------------------- DOM helpers

  /** An element with attributes (`text` sets textContent, `data` dataset, `on` listeners). */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") node.textContent = value;
      else if (name === "class") node.className = value;
      else if (name === "data") Object.assign(node.dataset, value);
      else if (name === "on")
        for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
      else if (value === true) node.setAttribute(name, "");
      else node.setAttribute(name, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setText(node, text) {
    const value = String(text);
    if (node.textContent !== value) node.textContent = value;
  }

  /** Calls `fn` once on the next animation frame however often it is scheduled. */
  function throttled(fn) {
    let queued = false;
    return () => {
      if (queued) return;
      queued = true;
      requestAnimationFrame(() => {
        queued = false;
        fn();
      });
    };
  }

  function debounced(fn, ms) {
    let timer = null;
    return () => {
      clearTimeout(timer);
      timer = setTimeout(fn, ms);
    };
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // ---------------------------------------------------------------- formatting

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    if (n < 1024) return `${n} B`;
    const units = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let value = n / 1024;
    let i = 0;
    while (value >= 1024 && i < units.length - 1) {
      value /= 1024;
      i += 1;
    }
    return `${value.toFixed(value < 10 ? 2 : 1)} ${units[i]}`;
  }

  const fmtRate = (bytesPerSecond) => `${fmtBytes(Math.round(bytesPerSecond))}/s`;

  /** A chart axis label: a rate with at most three significant digits, no trailing zeros. */
  function fmtAxis(bytesPerSecond) {
    const units = ["B/s", "KiB/s", "MiB/s", "GiB/s", "TiB/s"];
    let value = bytesPerSecond;
    let i = 0;
    while (value >= 1024 && i < units.length - 1) {
      value /= 1024;
      i += 1;
    }
    return `${Number(value.toPrecision(3))} ${units[i]}`;
  }

  function fmtAge(ms) {
    const s = Math.max(0, Math.floor(ms / 1000));
    if (s < 60) return `${s} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min ${s % 60} s`;
    const h = Math.floor(m / 60);
    if (h < 48) return `${h} h ${m % 60} min`;
    return `${Math.floor(h / 24)} d ${h % 24} h`;
  }

  function fmtTime(ms) {
    if (!ms) return "–";
    return new Date(ms).toLocaleTimeString([], { hour12: false });
  }

  function fmtDateTime(ms) {
    if (!ms) return "–";
    return new Date(ms).toLocaleString([], { hour12: false });
  }

  const fmtCount = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString());

  function hostPort(host, port) {
    if (host === null || host === undefined) return "–";
    const h = String(host).includes(":") ? `[${host}]` : String(host);
    return port === null || port === undefined ? h : `${h}:${port}`;
  }

  const fmtLatency = (ms) => (ms === null || ms === undefined ? "–" : `${Math.round(ms)} ms`);

  // ---------------------------------------------------------------- status line

  const statusLine = $("status");
  let statusSource = null;

  /** Show a message; `kind` is "info" or "error"; `source` lets a later success clear it. */
  function setStatus(message, kind = "info", source = null) {
    statusLine.textContent = message;
    statusLine.dataset.kind = kind;
    statusSource = source;
  }

  function clearStatus(source) {
    if (source !== null && statusSource === source) setStatus("", "info", null);
  }

  function describe(error) {
    if (error instanceof ApiError) return `${error.message} (${error.code})`;
    if (error && error.name === "TypeError") return `cannot reach the engine (${error.message})`;
    return String((error && error.message) || error);
  }

  function report(what, error, source = null) {
    setStatus(`${what}: ${describe(error)}`, "error", source);
  }

  // ---------------------------------------------------------------- the API key

  let memoryKey = null; // only when sessionStorage is unavailable

  function getKey() {
    try {
      return sessionStorage.getItem(KEY_STORAGE);
    } catch {
      return memoryKey;
    }
  }

  function storeKey(key) {
    try {
      sessionStorage.setItem(KEY_STORAGE, key);
    } catch {
      memoryKey = key;
    }
    updateKeyButtons();
  }

  function clearKey() {
    try {
      sessionStorage.removeItem(KEY_STORAGE);
    } catch {
      /* nothing stored */
    }
    memoryKey = null;
    updateKeyButtons();
  }

  function updateKeyButtons() {
    $("forget-key").hidden = !getKey();
  }

  const keyDialog = $("key-dialog");
  let keyWait = null; // {promise, resolve} while a key is awaited
  let keyReason = "";

  /** Resolves once the user has entered a key (every caller waits for the same one). */
  function askForKey(reason) {
    if (keyWait === null) {
      let resolve;
      const promise = new Promise((r) => {
        resolve = r;
      });
      keyWait = { promise, resolve };
    }
    keyReason = reason;
    openKeyDialog();
    return keyWait.promise;
  }

  function openKeyDialog() {
    $("key-reason").textContent = keyReason;
    $("enter-key").hidden = false;
    if (!keyDialog.open) keyDialog.showModal();
    $("key-input").focus();
  }

  function wireKeyDialog() {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = $("key-input");
      const key = input.value.trim();
      if (!key) {
        $("key-reason").textContent =
          "Enter the key (api.control.api_key_env or one of api.control.keys).";
        input.focus();
        return;
      }
      storeKey(key);
      input.value = "";
      keyDialog.close();
      $("enter-key").hidden = true;
      setStatus("Key stored in this tab's session storage.", "info", "key");
      const waiting = keyWait;
      keyWait = null;
      if (waiting) waiting.resolve();
    });
    const postpone = () => {
      if (keyWait)
        setStatus("The engine needs an API key: use “Enter API key” to give it.", "error", "key");
    };
    $("key-cancel").addEventListener("click", () => {
      keyDialog.close();
      postpone();
    });
    keyDialog.addEventListener("cancel", postpone);
    $("enter-key").addEventListener("click", openKeyDialog);
    $("forget-key").addEventListener("click", () => {
      clearKey();
      // Start over without the key: nothing shown stays on the page, and the first
      // call asks again.
      location.reload();
    });
  }

  // ---------------------------------------------------------------- requests

  class ApiError extends Error {
    constructor(code, message, status) {
      super(message);
      this.name = "ApiError";
      this.code = code;
      this.status = status;
    }
  }

  async function errorOf(resp) {
    try {
      const body = await resp.json();
      if (body && body.error) return new ApiError(body.error.code, body.error.message, resp.status);
    } catch {
      /* not an envelope */
    }
    return new ApiError(
      `http_${resp.status}`,
      `HTTP ${resp.status} ${resp.statusText}`,
      resp.status,
    );
  }

  /** fetch() with the key; on 401 asks for a key and tries again with it. */
  async function request(path, init = {}) {
    for (;;) {
      const key = getKey();
      const headers = new Headers(init.headers || {});
      if (key) headers.set("Authorization", `Bearer ${key}`);
      const resp = await fetch(path, { ...init, headers, cache: "no-store", credentials: "omit" });
      if (resp.status !== 401) return resp;
      resp.body?.cancel().catch(() => {});
      if (getKey() !== key) continue; // another request already got a new key
      let reason = "This engine's control API needs a key.";
      if (key) {
        clearKey();
        reason = "The engine did not accept that key. Enter a valid one.";
      }
      await askForKey(reason);
    }
  }

  async function api(path) {
    const resp = await request(API + path);
    if (!resp.ok) throw await errorOf(resp);
    const body = await resp.json();
    if (!body.ok) throw new ApiError(body.error.code, body.error.message, resp.status);
    return body.result;
  }

  async function command(method, params) {
    const resp = await request(`${API}/commands`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ method, params }),
    });
    if (!resp.ok) throw await errorOf(resp);
    const body = await resp.json();
    if (!body.ok) throw new ApiError(body.error.code, body.error.message, resp.status);
    return body.result;
  }

  // ---------------------------------------------------------------- capabilities

  let permissions = null; // Set of what this caller may do; null until known
  const commandPermission = new Map();

  async function loadCapabilities() {
    const caps = await api("/capabilities");
    permissions = new Set(caps.permissions || []);
    for (const c of caps.commands || []) commandPermission.set(c.method, c.permission);
  }

  /** Whether this caller's key may run `method` (true while unknown). */
  function can(method) {
    if (permissions === null) return true;
    return permissions.has("admin") || permissions.has(commandPermission.get(method) || "admin");
  }

  function needs(method) {
    return `Your key lacks the ${commandPermission.get(method) || "admin"} permission for ${method}.`;
  }

  // ---------------------------------------------------------------- engine and stats

  /** When the engine this page follows started (from health or engine.started). */
  let engineStartedAt = null;

  async function loadHealth() {
    const health = await api("/health");
    engineStartedAt = Math.max(engineStartedAt || 0, health.started_at_unix_ms || 0);
    setText(
      $("engine-info"),
      `${health.engine_build_id} · started ${fmtDateTime(health.started_at_unix_ms)}`,
    );
  }

  function renderStats(s) {
    setText($("stat-active"), fmtCount(s.active_sessions));
    setText($("stat-started"), fmtCount(s.total_started));
    setText($("stat-completed"), fmtCount(s.completed_sessions));
    setText($("stat-failed"), fmtCount(s.failed_sessions));
    setText($("stat-blocked"), fmtCount(s.blocked_sessions));
    setText($("stat-up"), fmtBytes(s.bytes_up));
    setText($("stat-down"), fmtBytes(s.bytes_down));
  }

  async function loadStats() {
    renderStats(await api("/stats"));
  }

  // ---------------------------------------------------------------- active flows

  const flows = new Map(); // flow_id -> newest record of an open flow
  const ended = new Map(); // flow_id -> revision of its completed record (bounded)
  const rows = new Map(); // flow_id -> {tr, cells, button}
  /** Browser clock minus engine clock, estimated from stats.sampled (smallest seen). */
  let clockOffset = null;

  function mergeRecord(record) {
    if (!record || typeof record.flow_id !== "string" || !record.revision) return;
    countRule(record);
    const id = record.flow_id;
    const endedAt = ended.get(id);
    if (endedAt !== undefined && endedAt >= record.revision) return;
    const current = flows.get(id);
    if (current && current.revision >= record.revision) return;
    if (record.state === "completed") {
      flows.delete(id);
      ended.set(id, record.revision);
      if (ended.size > ENDED_MEMORY) ended.delete(ended.keys().next().value);
    } else {
      flows.set(id, record);
    }
    scheduleFlows();
  }

  /** A flow.snapshot: the baseline replaces the active set. */
  function replaceFlows(records) {
    flows.clear();
    for (const record of records || []) {
      if (!record || typeof record.flow_id !== "string") continue;
      countRule(record);
      if (record.state !== "completed") flows.set(record.flow_id, record);
    }
    scheduleFlows();
  }

  function engineNow() {
    return Date.now() - (clockOffset || 0);
  }

  function newRow(id) {
    const cells = {};
    const tr = el("tr", { data: { flowId: id, testid: "flow-row" } });
    for (const name of [
      "source",
      "destination",
      "inbound",
      "outbound",
      "rule",
      "up",
      "down",
      "speed",
      "age",
      "state",
    ]) {
      const numeric = ["up", "down", "speed", "age"].includes(name);
      cells[name] = el("td", { class: `col-${name}${numeric ? " num" : ""}`, data: { col: name } });
      tr.append(cells[name]);
    }
    const button = el("button", {
      type: "button",
      class: "small danger",
      text: "Close",
      data: { testid: "close-flow", flowId: id },
    });
    button.addEventListener("click", () => closeFlow(id, button));
    tr.append(el("td", { class: "col-actions" }, button));
    return { tr, cells, button, key: "" };
  }

  /** Fill a cell with a main line and an optional muted second line. */
  function twoLines(cell, main, sub) {
    const key = `${main}\u0000${sub || ""}`;
    if (cell.dataset.key === key) return;
    cell.dataset.key = key;
    cell.replaceChildren(el("span", { class: "main", text: main }));
    if (sub) cell.append(el("span", { class: "sub", text: sub }));
  }

  function updateRow(row, r) {
    const source = r.source || {};
    twoLines(row.cells.source, hostPort(source.ip, source.port), source.process_name || "");
    const target = r.target || {};
    const sniffed =
      target.sniffed_host && target.sniffed_host !== target.host
        ? `sniffed ${target.sniffed_host}`
        : "";
    const resolved =
      target.resolved_ip && target.resolved_ip !== target.host ? `→ ${target.resolved_ip}` : "";
    twoLines(
      row.cells.destination,
      hostPort(target.host, target.port),
      [sniffed, resolved].filter(Boolean).join(" "),
    );
    const inbound = r.inbound || {};
    twoLines(
      row.cells.inbound,
      inbound.tag || "–",
      `${inbound.protocol || ""}${r.network === "udp" ? " · udp" : ""}`,
    );
    const route = r.route || {};
    const path = r.path || {};
    const chain = route.selection_chain || [];
    let outbound = path.outbound
      ? path.outbound.tag
      : route.target
        ? `${route.target} (pending)`
        : "–";
    if (route.action === "block") outbound = "blocked";
    const via = chain.length > 1 ? chain.join(" › ") : (path.relay_chain || []).join(" › ");
    twoLines(row.cells.outbound, outbound, via);
    const [rule, ruleSub] = ruleOf(r);
    twoLines(row.cells.rule, rule, ruleSub);
    const traffic = r.traffic || {};
    setText(row.cells.up, fmtBytes(traffic.bytes_up || 0));
    setText(row.cells.down, fmtBytes(traffic.bytes_down || 0));
    updateAge(row, r);
    updateSpeed(row, r);
    setText(row.cells.state, r.state || "–");
    row.cells.state.dataset.state = r.state || "";
    row.button.setAttribute(
      "aria-label",
      `Close the flow from ${hostPort(source.ip, source.port)} to ${hostPort(target.host, target.port)}`,
    );
    const allowed = can("flows.close");
    if (!row.button.dataset.closing) row.button.disabled = !allowed;
    row.button.title = allowed ? "Close this flow (flows.close)" : needs("flows.close");
  }

  /** What decided a flow's route: the matched rule, the final route or the mode. */
  function ruleOf(r) {
    const route = r.route || {};
    const target = route.target ? `→ ${route.target}` : "";
    if (!route.mode || route.action === "pending") return ["–", ""];
    const block = route.action === "block" ? "→ block" : target;
    if (route.matched_rule)
      return [route.matched_rule.condition || "(any)", `rule #${route.matched_rule.index} ${block}`];
    if (route.mode === "rule") return ["final", block];
    return [`${route.mode} mode`, block];
  }

  /** The stats interval, from the last two stats.sampled (the engine's default until then). */
  let statsIntervalMs = 1000;

  /** A flow's rates in bytes per second: its record's last sample, or zero once that
   * sample is older than two intervals (flow.updated comes only while bytes move). */
  function speedOf(r) {
    const t = r.throughput || {};
    const at = t.sampled_at_unix_ms;
    if (!at || engineNow() - at > 2 * statsIntervalMs + 1000) return { up: 0, down: 0 };
    return { up: (t.upload_bps || 0) / 8, down: (t.download_bps || 0) / 8 };
  }

  function updateSpeed(row, r) {
    const { up, down } = speedOf(r);
    setText(row.cells.speed, `↑ ${fmtRate(up)} ↓ ${fmtRate(down)}`);
    row.cells.speed.dataset.moving = up > 0 || down > 0 ? "true" : "false";
  }

  /** Every text of a flow the filter box looks in, lower case. */
  function searchText(r) {
    const source = r.source || {};
    const target = r.target || {};
    const inbound = r.inbound || {};
    const route = r.route || {};
    const path = r.path || {};
    return [
      r.flow_id,
      r.network,
      r.state,
      r.principal_key,
      hostPort(source.ip, source.port),
      source.process_name,
      hostPort(target.host, target.port),
      target.sniffed_host,
      target.resolved_ip,
      inbound.tag,
      inbound.protocol,
      path.outbound && path.outbound.tag,
      route.target,
      route.action === "block" ? "blocked" : "",
      ...(route.selection_chain || []),
      ...(path.relay_chain || []),
      ...ruleOf(r),
    ]
      .filter((v) => v !== null && v !== undefined && v !== "")
      .join(" ")
      .toLowerCase();
  }

  function filterWords() {
    return $("flow-filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  }

  function updateAge(row, r) {
    const started = r.timing && r.timing.started_at_unix_ms;
    setText(row.cells.age, started ? fmtAge(engineNow() - started) : "–");
  }

  function renderFlows() {
    const body = $("flow-rows");
    const words = filterWords();
    const matching = words.length
      ? [...flows.values()].filter((r) => {
          const text = searchText(r);
          return words.every((w) => text.includes(w));
        })
      : [...flows.values()];
    const sorted = matching.sort(
      (a, b) =>
        (b.timing?.started_at_unix_ms || 0) - (a.timing?.started_at_unix_ms || 0) ||
        (a.flow_id < b.flow_id ? 1 : -1),
    );
    const visible = sorted.slice(0, FLOW_ROWS_MAX);
    const keep = new Set(visible.map((r) => r.flow_id));
    let lostFocus = false;
    for (const [id, row] of rows) {
      if (keep.has(id)) continue;
      if (row.tr.contains(document.activeElement)) lostFocus = true;
      row.tr.remove();
      rows.delete(id);
    }
    visible.forEach((record, i) => {
      let row = rows.get(record.flow_id);
      if (!row) {
        row = newRow(record.flow_id);
        rows.set(record.flow_id, row);
      }
      updateRow(row, record);
      const at = body.children[i];
      if (at !== row.tr) body.insertBefore(row.tr, at || null);
    });
    setText($("flow-count"), words.length ? `${sorted.length} of ${flows.size}` : flows.size);
    const empty = $("flows-empty");
    empty.hidden = sorted.length > 0;
    setText(
      empty,
      flows.size === 0 ? "No active flows." : `No active flow matches “${words.join(" ")}”.`,
    );
    const more = $("flows-more");
    more.hidden = sorted.length <= FLOW_ROWS_MAX;
    if (!more.hidden)
      setText(more, `Showing the newest ${FLOW_ROWS_MAX} of ${sorted.length} flows.`);
    if (lostFocus) $("flows-title").focus();
  }

  const scheduleFlows = throttled(renderFlows);

  function tickAges() {
    for (const [id, row] of rows) {
      const record = flows.get(id);
      if (record) {
        updateAge(row, record);
        updateSpeed(row, record);
      }
    }
  }

  async function closeFlow(id, button) {
    const record = flows.get(id);
    const target = record ? hostPort(record.target.host, record.target.port) : id;
    button.disabled = true;
    button.dataset.closing = "1";
    button.textContent = "Closing…";
    try {
      await command("flows.close", { flow_id: id });
      setStatus(`Closed the flow to ${target}.`, "info", "flows");
    } catch (error) {
      delete button.dataset.closing;
      button.disabled = false;
      button.textContent = "Close";
      if (error.code === "not_found")
        setStatus(`The flow to ${target} had already ended.`, "info", "flows");
      else report(`Could not close the flow to ${target}`, error, "flows");
    }
  }

  // ---------------------------------------------------------------- policy groups

  let policies = [];

  async function loadPolicies() {
    const result = await api("/policies");
    policies = result.policies || [];
    renderPolicies();
    clearStatus("policies-load");
  }

  const schedulePolicies = debounced(
    () => loadPolicies().catch((e) => report("Policy groups", e, "policies-load")),
    150,
  );

  /** A member's latest known health: the engine-wide newest check of it by any probing
   * group (member_health), else this group's own view once it has checked; null when no
   * group has checked it yet. */
  function latestHealth(group, member) {
    const known = (group.member_health || []).find((m) => m.member_tag === member);
    if (known && known.healthy !== null && known.healthy !== undefined) return known;
    const own = (group.url_test_members || []).find((m) => m.member_tag === member);
    if (own && own.last_checked_unix_ms) return { ...own, checked_by: group.tag };
    return null;
  }

  /** The member's state word: healthy, down, group (a nested group) or unknown. */
  function healthState(health, nested) {
    if (health) return health.healthy ? "healthy" : "down";
    return nested ? "group" : "unknown";
  }

  function healthCell(group, health, nested) {
    const by =
      health && health.checked_by && health.checked_by !== group.tag
        ? el("span", { class: "sub", text: `checked by ${health.checked_by}` })
        : null;
    if (health && health.healthy)
      return [el("span", { class: "badge ok", text: "healthy" }), by];
    if (health)
      return [el("span", { class: "badge bad", text: "down", title: health.last_error || "" }), by];
    if (nested)
      return [el("span", { class: "badge unknown", text: `group → ${nested.selected || "–"}` })];
    return [
      el("span", {
        class: "badge unknown",
        text: "not probed yet",
        title: "No url_test, fallback or load_balance group has checked it yet.",
      }),
    ];
  }

  function renderPolicies() {
    const box = $("policies");
    const focusKey = document.activeElement?.dataset?.focusKey;
    const byTag = new Map(policies.map((p) => [p.tag, p]));
    if (policies.length === 0) {
      box.replaceChildren(el("p", { class: "empty", text: "No policy groups configured." }));
      return;
    }
    const articles = policies.map((group) => {
      const headingId = `policy-${group.tag}`;
      const header = el(
        "div",
        { class: "group-head" },
        el(
          "h3",
          { id: headingId },
          group.tag,
          " ",
          el("span", { class: "badge kind", text: group.kind }),
        ),
        el(
          "p",
          { class: "muted" },
          "selected ",
          el("strong", { text: group.selected || "–", data: { testid: `selected-${group.tag}` } }),
          group.latency_ms !== null && group.latency_ms !== undefined
            ? ` · ${fmtLatency(group.latency_ms)}`
            : "",
          group.last_checked_unix_ms ? ` · checked ${fmtTime(group.last_checked_unix_ms)}` : "",
        ),
      );
      if (group.kind === "url_test") {
        const allowed = can("policies.probe");
        header.append(
          el("button", {
            type: "button",
            class: "small secondary",
            text: "Run probe",
            disabled: !allowed,
            title: allowed
              ? `Probe every member of ${group.tag} now (policies.probe)`
              : needs("policies.probe"),
            data: { testid: `probe-${group.tag}`, focusKey: `probe:${group.tag}` },
            on: { click: (e) => probe(group.tag, e.currentTarget) },
          }),
        );
      }
      const isSelector = group.kind === "selector";
      const head = el(
        "tr",
        {},
        el("th", { scope: "col", text: "Member" }),
        el("th", { scope: "col", text: "Health" }),
        el("th", { scope: "col", class: "num", text: "Latency" }),
        el("th", { scope: "col", text: "Checked" }),
        isSelector
          ? el("th", { scope: "col" }, el("span", { class: "visually-hidden", text: "Select" }))
          : null,
      );
      const memberRows = (group.outbounds || []).map((member) => {
        const nested = byTag.get(member);
        const health = latestHealth(group, member);
        const latency = health ? health.latency_ms : nested ? nested.latency_ms : null;
        const checked = health ? health.last_checked_unix_ms : null;
        const isSelected = group.selected === member;
        const tr = el(
          "tr",
          {
            class: isSelected ? "selected" : "",
            data: { member, health: healthState(health, nested), testid: "member-row" },
          },
          el(
            "td",
            {},
            el("span", { text: member }),
            isSelected ? el("span", { class: "sub", text: "in use" }) : null,
          ),
          el("td", { data: { col: "health" } }, ...healthCell(group, health, nested)),
          el("td", { class: "num", text: fmtLatency(latency) }),
          el("td", { text: fmtTime(checked), title: health?.last_error || "" }),
        );
        if (isSelector) {
          const allowed = can("policies.select");
          tr.append(
            el(
              "td",
              { class: "col-actions" },
              el("button", {
                type: "button",
                class: "small",
                text: isSelected ? "Selected" : "Select",
                "aria-pressed": isSelected ? "true" : "false",
                "aria-label": `Select ${member} in ${group.tag}`,
                disabled: isSelected || !allowed,
                title: allowed
                  ? `Give new flows of ${group.tag} to ${member} (policies.select)`
                  : needs("policies.select"),
                data: {
                  testid: `select-${group.tag}-${member}`,
                  focusKey: `select:${group.tag}:${member}`,
                },
                on: { click: (e) => selectMember(group.tag, member, e.currentTarget) },
              }),
            ),
          );
        }
        return tr;
      });
      return el(
        "article",
        {
          class: "group",
          "aria-labelledby": headingId,
          data: { policyTag: group.tag, testid: `policy-${group.tag}` },
        },
        header,
        el(
          "table",
          { class: "data compact" },
          el("thead", {}, head),
          el("tbody", {}, ...memberRows),
        ),
      );
    });
    box.replaceChildren(...articles);
    if (focusKey) {
      const again = [...box.querySelectorAll("[data-focus-key]")].find(
        (n) => n.dataset.focusKey === focusKey,
      );
      if (again && !again.disabled) again.focus();
    }
  }

  async function selectMember(tag, member, button) {
    button.disabled = true;
    try {
      const result = await command("policies.select", { policy_tag: tag, target_tag: member });
      setStatus(
        `${result.policy_tag} now gives new flows to ${result.selected}.`,
        "info",
        "policies",
      );
    } catch (error) {
      report(`Could not select ${member} in ${tag}`, error, "policies");
    }
    schedulePolicies();
  }

  async function probe(tag, button) {
    button.disabled = true;
    try {
      const result = await command("policies.probe", { policy_tag: tag });
      setStatus(
        result.probe_triggered
          ? `Probing ${tag}… (results arrive as policy.probe.completed)`
          : `A probe round of ${tag} is already running.`,
        "info",
        "policies",
      );
    } catch (error) {
      report(`Could not probe ${tag}`, error, "policies");
    } finally {
      button.disabled = false;
    }
  }

  // ---------------------------------------------------------------- routing mode

  let config = null;
  let modeDirty = false; // the user changed the form and has not applied it yet

  async function loadConfig() {
    config = await api("/config");
    renderMode();
    renderRules();
    clearStatus("config-load");
  }

  // ---------------------------------------------------------------- rules

  const ruleHits = new Map(); // rule index, or "final" -> flows seen routed by it
  const ruleCounted = new Map(); // flow_id -> true, for the flows already counted (bounded)
  let rulesKey = null; // the rules the counts are of: a reload that changes them resets them

  /** Count a flow once for the rule (or final route) that decided it. */
  function countRule(record) {
    const route = record.route || {};
    if (!route.mode || route.action === "pending" || ruleCounted.has(record.flow_id)) return;
    let key = null;
    if (route.matched_rule) key = route.matched_rule.index;
    else if (route.mode === "rule") key = "final";
    ruleCounted.set(record.flow_id, true);
    if (ruleCounted.size > RULE_MEMORY) ruleCounted.delete(ruleCounted.keys().next().value);
    if (key === null) return; // global or direct mode: no rule decided
    ruleHits.set(key, (ruleHits.get(key) || 0) + 1);
    scheduleRules();
  }

  function renderRules() {
    const body = $("rule-rows");
    if (!config || !Array.isArray(config.rules)) {
      body.replaceChildren();
      $("rules-empty").hidden = false;
      return;
    }
    const key = JSON.stringify(config.rules);
    if (rulesKey !== null && rulesKey !== key) ruleHits.clear();
    rulesKey = key;
    const row = (id, index, condition, target, hits) =>
      el(
        "tr",
        { data: { rule: id, testid: "rule-row" } },
        el("td", { class: "num", text: index }),
        el("td", { data: { col: "condition" } }, el("code", { text: condition })),
        el("td", { data: { col: "target" }, text: target }),
        el("td", { class: "num", data: { col: "hits" }, text: fmtCount(hits || 0) }),
      );
    const rows = config.rules.map((r) =>
      row(
        String(r.index),
        r.index,
        r.condition,
        r.action === "block" ? "block" : r.outbound || "–",
        ruleHits.get(r.index),
      ),
    );
    rows.push(row("final", "–", "final (no rule matched)", config.final || "–", ruleHits.get("final")));
    body.replaceChildren(...rows);
    setText($("rule-count"), config.rules.length);
    $("rules-empty").hidden = true;
  }

  const scheduleRules = throttled(renderRules);

  // ---------------------------------------------------------------- the engine's log

  const logState = { since: null, buffer: [] };

  /** Fetch the log lines after the last one seen (the whole ring the first time). */
  async function loadLogs() {
    const query = logState.since === null ? "" : `?since=${logState.since}`;
    const result = await api(`/logs${query}`);
    if (logState.since !== null && result.latest_sequence < logState.since) {
      // A restarted engine numbers its lines from 1 again: start over.
      resetLogs();
      return;
    }
    const records = result.records || [];
    logState.buffer.push(...records);
    if (logState.buffer.length > LOG_BUFFER)
      logState.buffer.splice(0, logState.buffer.length - LOG_BUFFER);
    if (records.length) logState.since = records[records.length - 1].sequence;
    else if (logState.since === null) logState.since = result.latest_sequence;
    if (records.length) scheduleLogs();
    clearStatus("logs-load");
  }

  function resetLogs() {
    logState.since = null;
    logState.buffer.length = 0;
    scheduleLogs();
  }

  function renderLogs() {
    const floor = LEVEL_RANK[$("logs-level").value] || 0;
    const items = [];
    for (let i = logState.buffer.length - 1; i >= 0 && items.length < LOGS_SHOWN; i -= 1) {
      const r = logState.buffer[i];
      if ((LEVEL_RANK[r.level] ?? 0) < floor) continue;
      items.push(
        el(
          "li",
          { data: { level: r.level, sequence: r.sequence, testid: "log-line" } },
          el("time", {
            datetime: new Date(r.time_unix_ms).toISOString(),
            text: fmtTime(r.time_unix_ms),
          }),
          el("span", { class: `level level-${r.level}`, text: r.level }),
          el("code", { class: "logger", text: r.logger }),
          el("span", { class: "message", text: r.message }),
        ),
      );
    }
    $("logs").replaceChildren(...items);
    $("logs-empty").hidden = items.length > 0;
  }

  const scheduleLogs = throttled(renderLogs);

  function chosenMode() {
    const checked = document.querySelector('#mode-form input[name="mode"]:checked');
    return checked ? checked.value : null;
  }

  function renderMode() {
    if (!config) return;
    const mode = config.mode || {};
    setText(
      $("mode-current"),
      mode.kind === "global" ? `global → ${mode.outbound}` : mode.kind || "–",
    );
    const select = $("mode-outbound");
    const tags = [
      ...(config.outbounds || []).map((o) => o.tag),
      ...(config.outbound_groups || []).map((g) => g.tag),
    ];
    const previous = select.value;
    const options = tags.map((tag) => el("option", { value: tag, text: tag }));
    const sameOptions =
      select.options.length === tags.length &&
      tags.every((tag, i) => select.options[i].value === tag);
    if (!sameOptions) select.replaceChildren(...options);
    if (!modeDirty) {
      for (const radio of document.querySelectorAll('#mode-form input[name="mode"]')) {
        radio.checked = radio.value === mode.kind;
      }
      select.value = mode.outbound || previous || tags[0] || "";
    } else if (previous && tags.includes(previous)) {
      select.value = previous;
    }
    updateModeForm();
  }

  function updateModeForm() {
    const allowed = can("mode.set");
    $("mode-outbound").disabled = chosenMode() !== "global" || !allowed;
    $("mode-apply").disabled = !allowed || config === null;
    setText(
      $("mode-hint"),
      allowed ? "A switch applies to new flows; open flows keep their route." : needs("mode.set"),
    );
  }

  function wireModeForm() {
    const form = $("mode-form");
    form.addEventListener("change", () => {
      modeDirty = true;
      updateModeForm();
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const mode = chosenMode();
      if (!mode) return;
      const params = { mode };
      if (mode === "global") {
        params.outbound = $("mode-outbound").value;
        if (!params.outbound) {
          setStatus("Global mode needs an outbound.", "error", "mode");
          return;
        }
      }
      $("mode-apply").disabled = true;
      try {
        await command("mode.set", params);
        modeDirty = false;
        setStatus(
          `Routing mode is now ${mode}${params.outbound ? ` → ${params.outbound}` : ""} for new flows.`,
          "info",
          "mode",
        );
      } catch (error) {
        report("Could not switch the mode", error, "mode");
      }
      try {
        await loadConfig();
      } catch (error) {
        report("Configuration", error, "config-load");
      }
      updateModeForm();
    });
  }

  // ---------------------------------------------------------------- sinks

  async function loadSinks() {
    const result = await api("/sinks");
    renderSinks(result.sinks || []);
    clearStatus("sinks-load");
  }

  function renderSinks(sinks) {
    const box = $("sinks");
    if (sinks.length === 0) {
      box.replaceChildren(
        el("p", { class: "empty", text: "No event sinks configured (api.event_sinks)." }),
      );
      return;
    }
    const head = el(
      "tr",
      {},
      ...["Sink", "Backlog", "Delivered", "Failed", "Replay gaps", "Last success", "Status"].map(
        (t) =>
          el("th", {
            scope: "col",
            text: t,
            class: ["Backlog", "Delivered", "Failed", "Replay gaps"].includes(t) ? "num" : null,
          }),
      ),
    );
    const body = sinks.map((s) => {
      const storage = s.outbox_storage;
      let outbox = "in memory";
      if (storage)
        outbox = storage.write_blocked
          ? "writes blocked"
          : `${fmtBytes(storage.available_bytes)} free`;
      const delivery = s.delivery;
      const backlogNote = delivery
        ? [
            delivery.in_flight ? `${delivery.in_flight} in flight` : "",
            delivery.retry_pending ? `${delivery.retry_pending} retrying` : "",
          ]
            .filter(Boolean)
            .join(", ")
        : "";
      return el(
        "tr",
        { data: { sink: s.name, testid: "sink-row" } },
        el(
          "td",
          {},
          el("span", { class: "main", text: s.name }),
          el("span", { class: "sub", text: s.type || "" }),
        ),
        el(
          "td",
          { class: `num${s.pending > 0 ? " warn" : ""}`, data: { testid: "sink-backlog" } },
          el("span", { class: "main", text: fmtCount(s.pending) }),
          backlogNote ? el("span", { class: "sub", text: backlogNote }) : null,
        ),
        el("td", { class: "num", text: fmtCount(s.total_delivered) }),
        el("td", { class: "num", text: fmtCount(s.total_failed) }),
        el("td", { class: "num", text: fmtCount(s.replay_gaps) }),
        el("td", { text: fmtTime(s.last_success_at_unix_ms) }),
        el(
          "td",
          {
            class: `last-error${s.last_error || (storage && storage.write_blocked) ? " bad" : ""}`,
          },
          el("span", { class: "main", text: s.last_error || "no error" }),
          el("span", { class: "sub", text: `outbox ${outbox}` }),
        ),
      );
    });
    box.replaceChildren(
      el(
        "div",
        { class: "table-wrap" },
        el(
          "table",
          { class: "data compact sinks" },
          el("thead", {}, head),
          el("tbody", {}, ...body),
        ),
      ),
    );
  }

  // ---------------------------------------------------------------- throughput chart

  const samples = []; // {t, up, down}: bytes per second between two stats.sampled
  let lastTotals = null; // {t, up, down}: the previous sample's cumulative bytes

  function addSample(envelope) {
    const p = envelope.payload || {};
    const t = envelope.occurred_at_unix_ms;
    const offset = Date.now() - t;
    if (clockOffset === null || offset < clockOffset) clockOffset = offset;
    if (lastTotals && t <= lastTotals.t) return; // already seen
    if (lastTotals && p.bytes_up >= lastTotals.up && p.bytes_down >= lastTotals.down) {
      const seconds = (t - lastTotals.t) / 1000;
      statsIntervalMs = t - lastTotals.t;
      samples.push({
        t,
        up: (p.bytes_up - lastTotals.up) / seconds,
        down: (p.bytes_down - lastTotals.down) / seconds,
      });
    }
    // Counters going down: the engine restarted; start again from this sample.
    lastTotals = { t, up: p.bytes_up, down: p.bytes_down };
    while (samples.length && samples[0].t < t - CHART_WINDOW_MS) samples.shift();
    renderStats(p);
    scheduleChart();
  }

  /** A round scale top: 1, 2 or 5 times a power of ten, in the unit the value falls in. */
  function niceTop(value) {
    let unit = 1;
    while (value / unit >= 1024) unit *= 1024;
    const scaled = value / unit;
    const power = 10 ** Math.floor(Math.log10(scaled));
    for (const step of [1, 2, 5, 10]) {
      if (scaled <= step * power) return step * power * unit;
    }
    return 10 * power * unit;
  }

  function drawChart() {
    const canvas = $("chart");
    const ctx = canvas.getContext("2d");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    if (
      canvas.width !== Math.round(width * ratio) ||
      canvas.height !== Math.round(height * ratio)
    ) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const css = getComputedStyle(document.documentElement);
    const color = (name) => css.getPropertyValue(name).trim();
    const end = samples.length ? samples[samples.length - 1].t : engineNow();
    const start = end - CHART_WINDOW_MS;
    const peak = samples.reduce((m, s) => Math.max(m, s.up, s.down), 0);
    const top = niceTop(Math.max(peak * 1.1, 1024));
    const labels = [0, 1, 2, 3, 4].map((i) => fmtAxis((top * i) / 4));

    ctx.font = `12px ${css.getPropertyValue("--font-mono") || "monospace"}`;
    const labelWidth = Math.max(...labels.map((text) => ctx.measureText(text).width));
    const pad = { left: Math.ceil(labelWidth) + 14, right: 12, top: 10, bottom: 24 };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    ctx.fillStyle = color("--chart-text");
    ctx.strokeStyle = color("--chart-grid");
    ctx.lineWidth = 1;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let i = 0; i <= 4; i += 1) {
      const y = Math.round(pad.top + plotH - (plotH * i) / 4) + 0.5;
      ctx.beginPath();
      ctx.moveTo(pad.left, y);
      ctx.lineTo(pad.left + plotW, y);
      ctx.stroke();
      ctx.fillText(labels[i], pad.left - 8, y);
    }
    ctx.textBaseline = "top";
    for (const [fraction, label] of [
      [0, "−2 min"],
      [0.5, "−1 min"],
      [1, "now"],
    ]) {
      ctx.textAlign = fraction === 0 ? "left" : fraction === 1 ? "right" : "center";
      ctx.fillText(label, pad.left + plotW * fraction, pad.top + plotH + 6);
    }
    const x = (t) => pad.left + ((t - start) / CHART_WINDOW_MS) * plotW;
    const y = (v) => pad.top + plotH - (v / top) * plotH;
    // Down solid, up dashed on top: told apart without colour, and both visible
    // where they coincide.
    for (const [key, name, dash] of [
      ["down", "--chart-down", []],
      ["up", "--chart-up", [6, 4]],
    ]) {
      if (samples.length === 0) break;
      ctx.strokeStyle = color(name);
      ctx.lineWidth = 2;
      ctx.lineJoin = "round";
      ctx.setLineDash(dash);
      ctx.beginPath();
      samples.forEach((s, i) =>
        i === 0 ? ctx.moveTo(x(s.t), y(s[key])) : ctx.lineTo(x(s.t), y(s[key])),
      );
      ctx.stroke();
    }
    ctx.setLineDash([]);

    canvas.dataset.samples = String(samples.length);
    const last = samples[samples.length - 1];
    const summary = last
      ? `now up ${fmtRate(last.up)}, down ${fmtRate(last.down)}; peak ${fmtRate(peak)} over the last 2 minutes`
      : "no samples yet";
    canvas.setAttribute("aria-label", `Throughput chart: ${summary}`);
    setText(
      $("rates"),
      last
        ? `Now: ↑ ${fmtRate(last.up)} · ↓ ${fmtRate(last.down)} · peak ${fmtRate(peak)}`
        : "No samples yet.",
    );
  }

  const scheduleChart = throttled(drawChart);

  // ---------------------------------------------------------------- last events

  const eventBuffer = []; // oldest first

  function pushEvent(envelope) {
    eventBuffer.push(envelope);
    if (eventBuffer.length > EVENT_BUFFER) eventBuffer.splice(0, eventBuffer.length - EVENT_BUFFER);
    if (eventFilter()(envelope.event_type)) scheduleEvents();
  }

  /** Whether an event type is listed now: the two checkboxes, then the types box, whose
   * words match the start of a type and, starting with "-", hide the types they match. */
  function eventFilter() {
    const showFrequent = $("events-frequent").checked;
    const showIpc = $("events-ipc").checked;
    const words = $("events-filter").value.toLowerCase().split(/[\s,]+/).filter(Boolean);
    const hide = words.filter((w) => w.startsWith("-") && w.length > 1).map((w) => w.slice(1));
    const show = words.filter((w) => !w.startsWith("-"));
    return (type) => {
      if (!showFrequent && FREQUENT.has(type)) return false;
      if (!showIpc && IPC_EVENTS.has(type)) return false;
      if (hide.some((w) => type.startsWith(w))) return false;
      return show.length === 0 || show.some((w) => type.startsWith(w));
    };
  }

  function flowSummary(p) {
    const r = p.record || {};
    const target = r.target ? hostPort(r.target.host, r.target.port) : "";
    const out = r.path && r.path.outbound ? ` via ${r.path.outbound.tag}` : "";
    const inbound = r.inbound ? ` on ${r.inbound.tag}` : "";
    let text = `${target}${inbound}${out}`;
    if (r.result) {
      text += ` · ${r.result.outcome}`;
      if (r.result.close_reason) text += ` (${r.result.close_reason})`;
      if (r.result.failure) text += ` · ${r.result.failure.code}`;
    }
    if (r.traffic && (r.state === "completed" || p.bytes_up !== undefined)) {
      text += ` · ↑ ${fmtBytes(r.traffic.bytes_up)} ↓ ${fmtBytes(r.traffic.bytes_down)}`;
    }
    return text;
  }

  function summarize(envelope) {
    const p = envelope.payload || {};
    switch (envelope.event_type) {
      case "flow.started":
      case "flow.routed":
      case "flow.updated":
      case "flow.completed":
        return flowSummary(p);
      case "policy.selected":
        return `${p.policy_tag}: ${p.previous || "–"} → ${p.selected}`;
      case "policy.probe.completed": {
        const members = (p.members || [])
          .map((m) => `${m.target_tag} ${m.healthy ? fmtLatency(m.latency_ms) : "down"}`)
          .join(", ");
        return `${p.policy_tag} (${p.trigger}): selected ${p.selected || "–"}; ${members}`;
      }
      case "stats.sampled":
        return `${p.active_sessions} active · ↑ ${fmtBytes(p.bytes_up)} ↓ ${fmtBytes(p.bytes_down)}`;
      case "config.changed":
        return `${p.trigger}: ${(p.changed_components || []).join(", ") || "no change"} (${p.persistence})`;
      case "engine.started":
        return p.build_id || "";
      case "engine.stopped":
        return p.reason ? `reason: ${p.reason}` : "";
      case "engine.warning":
        return `${p.code}: ${p.message}`;
      case "ipc.connected":
      case "ipc.disconnected":
        return `${p.pipe || "unnamed socket"} · ${p.active} open${p.error ? ` · ${p.error}` : ""}`;
      default: {
        const text = JSON.stringify(p);
        return text.length > 160 ? `${text.slice(0, 160)}…` : text;
      }
    }
  }

  function renderEvents() {
    const visible = eventFilter();
    const items = [];
    for (let i = eventBuffer.length - 1; i >= 0 && items.length < EVENTS_SHOWN; i -= 1) {
      const envelope = eventBuffer[i];
      if (!visible(envelope.event_type)) continue;
      items.push(
        el(
          "li",
          { data: { type: envelope.event_type, sequence: envelope.sequence, testid: "event" } },
          el("time", {
            datetime: new Date(envelope.occurred_at_unix_ms).toISOString(),
            text: fmtTime(envelope.occurred_at_unix_ms),
          }),
          el("code", {
            class: `etype etype-${envelope.event_type.split(".")[0]}`,
            text: envelope.event_type,
          }),
          el("span", { class: "summary", text: summarize(envelope) }),
        ),
      );
    }
    $("events").replaceChildren(...items);
    $("events-empty").hidden = items.length > 0;
  }

  const scheduleEvents = throttled(renderEvents);

  // ---------------------------------------------------------------- the event stream

  const refreshAfterConfig = debounced(() => {
    loadConfig().catch((e) => report("Configuration", e, "config-load"));
    loadPolicies().catch((e) => report("Policy groups", e, "policies-load"));
  }, 200);

  function handleEvent(envelope) {
    const type = envelope.event_type;
    if (type === "flow.snapshot") {
      replaceFlows(envelope.payload.records);
      setStreamState("live", "Live");
      return;
    }
    const payload = envelope.payload || {};
    if (FLOW_EVENTS.has(type)) mergeRecord(payload.record);
    else if (type === "stats.sampled") addSample(envelope);
    else if (type === "policy.selected" || type === "policy.probe.completed") schedulePolicies();
    else if (type === "config.changed") refreshAfterConfig();
    else if (type === "engine.started") {
      // A restarted engine: its keys, configuration and groups may all have changed.
      loadHealth().catch(() => {});
      // Its log ring starts over too (a replayed engine.started of this engine does not).
      const startedAt = payload.started_at_unix_ms || 0;
      if (engineStartedAt !== null && startedAt > engineStartedAt) resetLogs();
      engineStartedAt = Math.max(engineStartedAt || 0, startedAt);
      loadCapabilities()
        .then(scheduleFlows)
        .catch(() => {});
      refreshAfterConfig();
    } else if (type === "engine.stopped") setStreamState("stopped", "Engine stopped");
    pushEvent(envelope);
  }

  function setStreamState(state, text) {
    const holder = $("stream-state").parentElement;
    holder.dataset.state = state;
    setText($("stream-state"), text);
  }

  /** Read SSE frames from a fetch() body; `onFrame({id, type, data})`, `onComment(text)`. */
  async function readFrames(body, onFrame, onComment, onActivity) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let data = [];
    let type = "";
    let id = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      onActivity();
      buffer += decoder.decode(value, { stream: true });
      let start = 0;
      for (;;) {
        const newline = buffer.indexOf("\n", start);
        if (newline < 0) break;
        let line = buffer.slice(start, newline);
        start = newline + 1;
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) onFrame({ id, type: type || "message", data: data.join("\n") });
          data = [];
          type = "";
          continue;
        }
        if (line.startsWith(":")) {
          onComment(line.slice(1).trim());
          continue;
        }
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") data.push(val);
        else if (field === "event") type = val;
        else if (field === "id" && !val.includes("\u0000")) id = val;
      }
      buffer = buffer.slice(start);
    }
  }

  const stream = { lastId: null, retryMs: 1000 };

  async function streamLoop() {
    let since = null;
    try {
      // Only the ring's bounds are wanted: replay its last events on the first connection.
      const ring = await api("/events?types=engine.started&limit=1");
      since = Math.max(0, ring.latest_sequence - BACKFILL);
    } catch (error) {
      report("Event history", error, "stream");
    }
    for (;;) {
      const controller = new AbortController();
      let silence = null;
      const kick = () => {
        clearTimeout(silence);
        silence = setTimeout(() => controller.abort(), STREAM_SILENCE_MS);
      };
      let retryAfter = null;
      try {
        const headers = { Accept: "text/event-stream" };
        let url = `${API}/events/stream`;
        if (stream.lastId !== null) headers["Last-Event-ID"] = stream.lastId;
        else if (since !== null) url += `?since=${since}`;
        setStreamState(
          "connecting",
          stream.lastId === null ? "Opening the event stream" : "Reconnecting…",
        );
        const resp = await request(url, { headers, signal: controller.signal });
        if (!resp.ok) {
          retryAfter = Number(resp.headers.get("Retry-After")) || null;
          throw await errorOf(resp);
        }
        kick(); // from here on, silence means a dead connection
        since = null;
        stream.retryMs = 1000;
        clearStatus("stream");
        await readFrames(
          resp.body,
          (frame) => {
            if (frame.id !== null) stream.lastId = frame.id;
            let envelope;
            try {
              envelope = JSON.parse(frame.data);
            } catch {
              return;
            }
            handleEvent(envelope);
          },
          (comment) => {
            if (comment.startsWith("since"))
              setStatus(
                "The engine restarted: the page caught up from its first event.",
                "info",
                "stream",
              );
            else if (comment.startsWith("replay gap"))
              setStatus(
                `Some events were missed while disconnected (${comment}).`,
                "info",
                "stream",
              );
          },
          kick,
        );
      } catch (error) {
        if (error.name !== "AbortError") report("Event stream", error, "stream");
      } finally {
        clearTimeout(silence);
      }
      const wait = retryAfter ? retryAfter * 1000 : stream.retryMs;
      const holder = $("stream-state").parentElement;
      if (holder.dataset.state !== "stopped")
        setStreamState("down", `Disconnected; retrying in ${Math.round(wait / 1000)} s`);
      else setStreamState("stopped", `Engine stopped; retrying in ${Math.round(wait / 1000)} s`);
      await sleep(wait);
      stream.retryMs = Math.min(stream.retryMs * 2, 15000);
    }
  }

  // ---------------------------------------------------------------- start

  function every(ms, load, what, source) {
    const tick = async () => {
      try {
        await load();
      } catch (error) {
        report(what, error, source);
      }
      setTimeout(tick, ms);
    };
    setTimeout(tick, ms);
  }

  async function start() {
    wireKeyDialog();
    wireModeForm();
    updateKeyButtons();
    $("events-frequent").addEventListener("change", renderEvents);
    $("events-ipc").addEventListener("change", renderEvents);
    $("events-filter").addEventListener("input", scheduleEvents);
    $("flow-filter").addEventListener("input", scheduleFlows);
    $("logs-level").addEventListener("change", renderLogs);
    $("logs-clear").addEventListener("click", () => {
      logState.buffer.length = 0;
      renderLogs();
    });
    $("events-clear").addEventListener("click", () => {
      eventBuffer.length = 0;
      renderEvents();
    });
    $("flows-title").setAttribute("tabindex", "-1");
    new ResizeObserver(scheduleChart).observe($("chart"));
    // The first paint is the empty state of every panel, not placeholders: nothing is
    // awaited before these.
    renderFlows();
    renderEvents();
    renderRules();
    renderLogs();
    drawChart();
    setInterval(tickAges, 1000);

    try {
      await loadCapabilities(); // the first call: asks for a key when one is needed
    } catch (error) {
      report("Capabilities", error, "capabilities");
    }
    const first = [
      [loadHealth, "Engine health", "health"],
      [loadStats, "Statistics", "stats-load"],
      [loadConfig, "Configuration", "config-load"],
      [loadPolicies, "Policy groups", "policies-load"],
      [loadSinks, "Sinks", "sinks-load"],
      [loadLogs, "Engine log", "logs-load"],
    ];
    streamLoop();
    await Promise.all(
      first.map(([load, what, source]) => load().catch((e) => report(what, e, source))),
    );
    every(SINKS_EVERY_MS, loadSinks, "Sinks", "sinks-load");
    every(CONFIG_EVERY_MS, loadConfig, "Configuration", "config-load");
    every(POLICIES_EVERY_MS, loadPolicies, "Policy groups", "policies-load");
    every(LOGS_EVERY_MS, loadLogs, "Engine log", "logs-load");
    document.body.dataset.ready = "true";
  }

  start();
})();
