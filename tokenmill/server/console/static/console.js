// tokenmill console: plain JavaScript, no build step. Reads the server's own APIs: /v1/console/live (polled
// about once a second), the KServe repository routes, /v1/chat/completions. Data from the server or from
// files is only ever written as text (textContent), never parsed as HTML.
"use strict";

(() => {
  const KEY_STORE = "tokenmill.apiKey"; // sessionStorage: this tab only, gone when it closes
  const POLL_MS = 1000;
  const POLL_HIDDEN_MS = 5000; // a tab in the background polls less
  const POLL_AUTH_MS = 3000; // waiting for a key: no point in asking every second
  const POLL_TIMEOUT_MS = 5000; // a server that hangs (stopped, half-open connection) is not waited on
  const KEEP_POINTS = 300; // five minutes at one poll a second
  const WINDOW_S = 30;
  // Rates are over the last few seconds, not between two polls: the counters move when requests finish,
  // so a one-second difference jumps between nothing and a whole request's tokens.
  const RATE_WINDOW_S = 5;

  const $ = (sel) => document.querySelector(sel);
  const st = {
    key: sessionStorage.getItem(KEY_STORE) || "",
    live: null,
    history: [], // {t, counters} of recent polls: the rates' other end
    tab: "overview",
    authNeeded: false,
    unreachable: false,
    serverStatus: null, // an answer other than 200 and 401 (a proxy's 502, a 500): said in the banner
    timer: null,
    charts: {},
    bench: [],
    benchChart: null,
    benchPending: null,
    modelsIndex: null,
    modelsMode: null,
    play: null,
  };
  // What the page shows, for tests and for a curious reader's devtools.
  const hooks = { polls: 0, live: null, banner: "", series: {}, play: null, bench: { files: 0, points: 0 } };
  window.tokenmillConsole = hooks;

  // -- small helpers ----------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("data-")) e.setAttribute(k, String(v));
      else if (k === "onclick") e.addEventListener("click", v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }
  const fmt = (v, digits = 1) =>
    v === null || v === undefined || Number.isNaN(v)
      ? "-"
      : Math.abs(v) >= 1000
        ? Math.round(v).toLocaleString()
        : Number(v).toFixed(digits);
  const pct = (v) => (v === null || v === undefined ? "-" : `${(100 * v).toFixed(1)}%`);
  const ms = (s) => (s === null || s === undefined ? null : 1000 * s);
  const sum = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);
  // Reasons may quote a file or a socket: shown without them (the server scrubs its own; files differ).
  const scrub = (t) =>
    String(t ?? "")
      .replace(/\b(?:ipc|inproc):\/\/\S*/g, "<socket>")
      .replace(/(^|[\s'"(=])\/(?:[\w.+-]+\/)*[\w.+-]+/g, "$1<path>");

  async function api(path, init = {}) {
    const headers = new Headers(init.headers || {});
    if (st.key) headers.set("Authorization", `Bearer ${st.key}`);
    const res = await fetch(path, { ...init, headers, cache: "no-store", credentials: "omit" });
    if (res.status === 401) st.authNeeded = true;
    return res;
  }

  async function errorText(res) {
    // OpenAI's {"error": {"message"}} or KServe's {"error": "..."}; else the status alone.
    try {
      const body = await res.json();
      const e = body && body.error;
      return scrub(typeof e === "string" ? e : (e && e.message) || res.statusText);
    } catch {
      return res.statusText || `HTTP ${res.status}`;
    }
  }
  const authMessage = () =>
    st.key
      ? "The server refused this API key (401): enter its key above."
      : "This server needs an API key (401): enter it above. It is kept in this tab only and sent as Authorization: Bearer.";

  // -- the API key ---------------------------------------------------------------------------------
  function showKeyState() {
    $("#key-state").textContent = st.key ? "set" : "";
    $("#key-state").title = st.key ? "kept in this tab only (session storage), sent as Authorization: Bearer" : "";
    $("#key-input").placeholder = st.key ? "••••••••" : "not set";
  }
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = $("#key-input");
    const key = input.value.trim();
    input.value = ""; // kept in sessionStorage only: never left in the page
    if (/[^\x21-\x7e]/.test(key)) {
      // An HTTP header carries printable ASCII only: such a key could never be sent.
      $("#key-state").textContent = "not used: an API key is printable ASCII without spaces";
      return;
    }
    st.key = key;
    if (st.key) sessionStorage.setItem(KEY_STORE, st.key);
    else sessionStorage.removeItem(KEY_STORE);
    st.authNeeded = false;
    showKeyState();
    schedule(0);
    if (st.tab === "models") refreshModels();
  });
  $("#key-forget").addEventListener("click", () => {
    st.key = "";
    sessionStorage.removeItem(KEY_STORE);
    showKeyState();
    schedule(0);
  });

  // -- banner and header ---------------------------------------------------------------------------
  function updateBanner() {
    const live = st.live;
    let kind = "";
    let text = "";
    if (st.unreachable) {
      kind = "unreachable";
      text = "Cannot reach the server: retrying every second.";
    } else if (st.serverStatus !== null) {
      kind = "unreachable";
      text = `The server answered ${st.serverStatus} for its live figures: retrying every second.`;
    } else if (st.authNeeded) {
      kind = "auth";
      text = authMessage();
    } else if (live && !live.engine.healthy) {
      kind = "engine-down";
      text = `${live.engine.reason || "The engine is not available"}. Generation requests get 503 until it is back.`;
    } else if (live && live.engine.draining) {
      kind = "draining";
      text = "The server is draining: it finishes the requests it has and takes no new ones.";
    }
    const banner = $("#banner");
    banner.hidden = !kind;
    banner.dataset.state = kind;
    banner.textContent = text;
    hooks.banner = kind;
    const pill = $("#engine-pill");
    const pillState = kind === "unreachable" ? "down" : kind === "engine-down" ? "down" : kind || (live ? "up" : "unknown");
    pill.dataset.state = pillState;
    pill.textContent = {
      up: "engine up",
      down: kind === "unreachable" ? "server unreachable" : "engine down",
      auth: "API key needed",
      draining: "draining",
      unknown: "connecting",
    }[pillState];
  }

  // -- polling ---------------------------------------------------------------------------------------
  function schedule(delay) {
    clearTimeout(st.timer);
    st.timer = setTimeout(poll, delay);
  }

  async function poll() {
    clearTimeout(st.timer); // one chain of polls, however this one was started
    const ctl = new AbortController();
    const timeout = setTimeout(() => ctl.abort(), POLL_TIMEOUT_MS);
    let live = null;
    try {
      const res = await api(`v1/console/live?window=${WINDOW_S}`, { signal: ctl.signal });
      st.unreachable = false;
      st.serverStatus = res.ok || res.status === 401 ? null : res.status;
      if (res.ok) {
        st.authNeeded = false;
        live = await res.json();
      }
    } catch {
      st.unreachable = true; // gone, restarting or hung: the banner says so until it answers
    } finally {
      clearTimeout(timeout);
    }
    // Drawing is not fetching: a fault here is the page's own, logged as such (not "unreachable").
    if (live !== null) {
      try {
        onLive(live);
      } catch (e) {
        console.error("tokenmill console: could not show the live figures", e);
      }
    }
    hooks.polls += 1;
    updateBanner();
    schedule(st.authNeeded ? POLL_AUTH_MS : document.hidden ? POLL_HIDDEN_MS : POLL_MS);
  }

  function onLive(live) {
    st.live = live;
    hooks.live = live;
    $("#model").textContent = `${live.server.model} · v${live.server.version}`;
    $("#window-s").textContent = String(live.latency.window_s);
    pushPoint(live);
    renderTiles(live);
    renderCharts();
    renderFleet(live.fleet);
    renderModelsAvailability(live.server);
  }

  // -- overview: series and charts ----------------------------------------------------------------
  const SERIES = [
    "t", "output_tps", "prompt_tps", "rps", "fail_ps", "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50",
    "itl_p90", "itl_p99", "e2e_p50", "e2e_p90", "e2e_p99", "running", "waiting", "kv_pct", "prefix_hit_pct",
    "qc", "off_host", "off_disk", "off_shared",
  ];
  for (const name of SERIES) hooks.series[name] = [];

  function rate(now, before, dt) {
    if (before === undefined || before === null || dt <= 0) return null;
    const d = now - before;
    return d < 0 ? null : d / dt; // below zero: the server restarted, its counters with it
  }

  function pushPoint(live) {
    const s = hooks.series;
    const c = live.counters;
    // The oldest poll within the rate window (none yet: no rates on the first poll).
    st.history = st.history.filter((h) => h.t >= live.time - RATE_WINDOW_S - 0.5 && h.t < live.time);
    const then = st.history[0] || null;
    st.history.push({ t: live.time, counters: c, engines: live.engines });
    const p = then ? then.counters : null;
    const dt = then ? live.time - then.t : 0;
    const lat = live.latency;
    // Engine counters differ per engine and per life of it (a fleet's workers come and go, a restart
    // counts from 0): differences are taken per engine present in both snapshots, then summed.
    const engineDelta = (get) => {
      if (!then) return null;
      let total = 0;
      for (const [id, now] of Object.entries(live.engines || {})) {
        const before = (then.engines || {})[id];
        if (before === undefined) continue;
        const a = get(now);
        const b = get(before);
        if (a !== undefined && b !== undefined && a >= b) total += a - b;
      }
      return total;
    };
    const tiers = (e) => e.offload_loaded_blocks || {};
    const dq = engineDelta((e) => e.prefix_cache_queries) || 0;
    const dh = engineDelta((e) => e.prefix_cache_hits) || 0;
    const offloadRate = (tier) => {
      const hasTier = Object.values(live.engines || {}).some((e) => tier in tiers(e));
      const d = engineDelta((e) => tiers(e)[tier]);
      return hasTier && d !== null && dt > 0 ? d / dt : null;
    };
    const point = {
      t: live.time,
      output_tps: p && rate(c.output_tokens, p.output_tokens, dt),
      prompt_tps: p && rate(c.prompt_tokens, p.prompt_tokens, dt),
      rps: p && rate(sum(c.finished), sum(p.finished), dt),
      fail_ps: p && rate(sum(c.failures), sum(p.failures), dt),
      ttft_p50: ms(lat.ttft_s.p50),
      ttft_p90: ms(lat.ttft_s.p90),
      ttft_p99: ms(lat.ttft_s.p99),
      itl_p50: ms(lat.itl_s.p50),
      itl_p90: ms(lat.itl_s.p90),
      itl_p99: ms(lat.itl_s.p99),
      e2e_p50: lat.e2e_s.p50,
      e2e_p90: lat.e2e_s.p90,
      e2e_p99: lat.e2e_s.p99,
      running: live.load.running,
      waiting: live.load.waiting,
      kv_pct: 100 * live.load.kv_usage,
      prefix_hit_pct: dq > 0 && dh >= 0 ? (100 * dh) / dq : null, // no lookups: no rate to show
      qc: live.queue_to_compute,
      off_host: offloadRate("host"),
      off_disk: offloadRate("disk"),
      off_shared: offloadRate("shared"),
    };
    for (const name of SERIES) {
      const arr = s[name];
      arr.push(point[name] === undefined || point[name] === false ? null : point[name]);
      if (arr.length > KEEP_POINTS) arr.shift();
    }
  }

  const CHART_H = 150;
  const BLUE = "#3b7dd8", GREY = "#9aa5b1", GREEN = "#1f9d55", RED = "#d8453b", AMBER = "#c77c02", PURPLE = "#7a5bd8";
  const CHARTS = [
    { id: "tps", title: "Tokens/s", series: [["output_tps", "output", BLUE], ["prompt_tps", "prompt", GREY]] },
    { id: "rps", title: "Requests/s", series: [["rps", "finished", GREEN], ["fail_ps", "failed", RED]] },
    { id: "ttft", title: "Time to first token (ms)", series: [["ttft_p50", "p50", BLUE], ["ttft_p90", "p90", AMBER], ["ttft_p99", "p99", RED]] },
    { id: "itl", title: "Inter-token latency (ms)", series: [["itl_p50", "p50", BLUE], ["itl_p90", "p90", AMBER], ["itl_p99", "p99", RED]] },
    { id: "e2e", title: "End-to-end latency (s)", series: [["e2e_p50", "p50", BLUE], ["e2e_p90", "p90", AMBER], ["e2e_p99", "p99", RED]] },
    { id: "load", title: "Requests in the engine", series: [["running", "running", BLUE], ["waiting", "waiting", AMBER]] },
    { id: "cache", title: "KV cache (%)", series: [["kv_pct", "KV usage", PURPLE], ["prefix_hit_pct", "prefix-cache hits", GREEN]], range: [0, 100] },
    { id: "qc", title: "Queue-to-compute ratio (last 60 s)", series: [["qc", "queue / compute", AMBER]] },
    { id: "offload", title: "Offload: KV blocks loaded/s by tier", series: [["off_host", "host", BLUE], ["off_disk", "disk", AMBER], ["off_shared", "shared", GREEN]] },
  ];

  // Wall-clock time of day on the x axis (uPlot's default adds the date on a line of its own).
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });

  function chartWidth(box) {
    return Math.max(260, Math.floor(box.clientWidth - 12));
  }

  function buildCharts() {
    if (Object.keys(st.charts).length || typeof uPlot === "undefined") return;
    const root = $("#charts");
    for (const def of CHARTS) {
      const box = el("div", { class: "chart", id: `chart-${def.id}`, "data-points": "0" }, el("h3", { text: def.title }));
      if (def.id === "offload") box.append(el("div", { class: "hint", id: "offload-hint", hidden: true, text: "This server has no KV offload tiers (--kv-offload)." }));
      root.append(box);
      const opts = {
        width: chartWidth(box),
        height: CHART_H,
        series: [{}, ...def.series.map(([, label, color]) => ({ label, stroke: color, width: 1.6, spanGaps: false }))],
        scales: { x: { time: true }, ...(def.range ? { y: { range: def.range } } : {}) },
        axes: [
          { stroke: "#667085", grid: { stroke: "#eef0f3" }, space: 70, values: (u, ticks) => ticks.map(clock) },
          { stroke: "#667085", size: 52, grid: { stroke: "#eef0f3" } },
        ],
        legend: { live: false },
        cursor: { drag: { x: false, y: false } },
      };
      st.charts[def.id] = { def, box, plot: new uPlot(opts, chartData(def), box) };
    }
  }

  function chartData(def) {
    return [hooks.series.t.slice(), ...def.series.map(([name]) => hooks.series[name].slice())];
  }

  function renderCharts() {
    if (st.tab !== "overview") return; // drawn when shown: a hidden chart has no size
    buildCharts();
    for (const { def, box, plot } of Object.values(st.charts)) {
      const data = chartData(def);
      plot.setData(data);
      const first = data[1];
      box.dataset.points = String(first.length);
      const last = first.length ? first[first.length - 1] : null;
      box.dataset.last = last === null ? "" : String(last);
    }
    const offload = st.live && st.live.counters.offload_loaded_blocks;
    const hint = $("#offload-hint");
    if (hint) hint.hidden = !!(offload && Object.keys(offload).length);
  }

  function resizeCharts() {
    for (const { box, plot } of Object.values(st.charts)) plot.setSize({ width: chartWidth(box), height: CHART_H });
    if (st.benchChart) st.benchChart.setSize({ width: chartWidth($("#bench-chart")), height: 360 });
  }
  window.addEventListener("resize", resizeCharts);

  function renderTiles(live) {
    const s = hooks.series;
    const last = (name) => {
      const a = s[name];
      return a.length ? a[a.length - 1] : null;
    };
    const lat = live.latency;
    const tiles = [
      ["output tokens/s", fmt(last("output_tps"))],
      ["requests/s", fmt(last("rps"), 2)],
      ["running", String(live.load.running)],
      ["waiting", String(live.load.waiting)],
      ["KV usage", pct(live.load.kv_usage)],
      [`TTFT p50 (${lat.window_s}s)`, lat.ttft_s.p50 === null ? "-" : `${fmt(ms(lat.ttft_s.p50), 0)} ms`],
      [`ITL p50 (${lat.window_s}s)`, lat.itl_s.p50 === null ? "-" : `${fmt(ms(lat.itl_s.p50), 1)} ms`],
      ["queue / compute", fmt(live.queue_to_compute, 2)],
      ["finished (all time)", fmt(sum(live.counters.finished), 0)],
      ["output tokens (all time)", fmt(live.counters.output_tokens, 0)],
    ];
    $("#tiles").replaceChildren(
      ...tiles.map(([label, value]) => el("div", { class: "tile" }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }))),
    );
  }

  // -- fleet ----------------------------------------------------------------------------------------
  function bar(frac) {
    if (frac === null || frac === undefined) return "-";
    const b = el("span", { class: "bar" }, el("i"));
    b.firstChild.style.width = `${Math.round(100 * Math.min(Math.max(frac, 0), 1))}%`;
    return el("span", {}, b, pct(frac));
  }

  function renderFleet(fleet) {
    $("#fleet-none").hidden = !!fleet;
    $("#fleet-body").hidden = !fleet;
    if (!fleet) return;
    const up = fleet.workers.filter((w) => w.state === "up").length;
    const r = fleet.router || {};
    const credited = r.request_blocks ? r.overlap_blocks / r.request_blocks : null;
    const summary = [
      ["workers up", `${up} / ${fleet.workers.length}`],
      ["routing policy", r.policy || "-"],
      ["routing decisions", fmt(r.decisions, 0)],
      ["prompt blocks found cached", pct(credited)],
      ["retries", fmt(r.retries, 0)],
      ["workers lost", fmt(r.worker_losses, 0)],
      ["restarts", r.restarts === null || r.restarts === undefined ? "-" : String(r.restarts)],
    ];
    $("#fleet-summary").replaceChildren(
      ...summary.map(([label, value]) => el("div", { class: "tile" }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }))),
    );
    $("#workers tbody").replaceChildren(
      ...fleet.workers.map((w) =>
        el(
          "tr",
          { "data-worker": w.name, "data-state": w.state },
          el("td", { text: w.name }),
          el("td", { text: w.role || "both" }),
          el("td", {}, el("span", { class: "state", "data-state": w.state, text: w.state })),
          el("td", { text: w.running ?? "-" }),
          el("td", { text: w.waiting ?? "-" }),
          el("td", {}, bar(w.kv_usage)),
          el("td", { text: w.in_flight }),
          el("td", { text: w.joins }),
          el("td", { text: w.heard_s_ago === null ? "-" : `${fmt(w.heard_s_ago, 1)} s ago` }),
          el("td", { class: "muted", text: w.last_error || "" }),
        ),
      ),
    );
    const placements = (fleet.placements || []).slice(0, 15);
    $("#placements tbody").replaceChildren(
      ...(placements.length
        ? placements.map((p) => el("tr", {}, el("td", {}, el("code", { text: p.request })), el("td", { text: p.worker }), el("td", { text: p.overlap_blocks })))
        : [el("tr", {}, el("td", { colspan: 3, class: "muted", text: "no requests routed yet" }))]),
    );
    renderPlanner(fleet.planner);
  }

  function decisionItem(d) {
    const change = d.target !== d.current ? `${d.current} → ${d.target}` : `keep ${d.current}`;
    const when = d.times > 1 ? `${d.times}× in a row, latest ${fmt(d.age_s, 0)} s ago` : `${fmt(d.age_s, 0)} s ago`;
    return el("li", {}, el("b", { text: change }), ` ${d.reason} `, el("span", { class: "muted", text: `(${when})` }));
  }

  // Decisions (newest first) with runs of the same one folded: a planner says "steady" (or "quiet for N
  // intervals") every interval. Reasons that differ only in their figures count as the same; the newest
  // one's text is shown.
  function folded(decisions) {
    const shape = (d) => `${d.current}>${d.target}:${String(d.reason).replace(/[\d.]+/g, "#")}`;
    const out = [];
    for (const d of decisions) {
      const last = out[out.length - 1];
      if (last && last.shape === shape(d)) last.times += 1;
      else out.push({ ...d, times: 1, shape: shape(d) });
    }
    return out;
  }

  function renderPlanner(pools) {
    const root = $("#planner");
    if (!pools) {
      root.replaceChildren(el("div", { class: "empty", text: "No planner runs: start with --planner load|sla and --workers MIN..MAX." }));
      return;
    }
    root.replaceChildren(
      ...pools.map((p) =>
        el(
          "div",
          { class: "pool", "data-pool": p.pool },
          el(
            "div",
            { class: "head" },
            el("b", { text: p.pool === "all" ? "all workers" : `${p.pool} pool` }),
            el("span", { text: `${p.mode} mode, ${p.min_workers}..${p.max_workers} workers, every ${p.interval_s} s` }),
            el("span", {}, "target ", el("b", { class: "planner-target", text: p.target ?? "-" })),
            el("span", { text: `serving ${p.serving ?? "-"}, starting ${p.starting ?? "-"}, draining ${p.draining ?? "-"}` }),
            el("span", { class: "muted", text: `scaled up ${p.scaled_up}×, down ${p.scaled_down}×` }),
          ),
          el("div", { class: "sub", text: "Latest decisions" }),
          el("ul", {}, ...(p.recent.length ? folded(p.recent).map(decisionItem) : [el("li", { class: "muted", text: "none yet" })])),
          el("div", { class: "sub", text: "Recent changes of the worker count" }),
          el("ul", {}, ...(p.changes.length ? p.changes.map(decisionItem) : [el("li", { class: "muted", text: "none yet" })])),
        ),
      ),
    );
  }

  // -- models (KServe v2 repository) -------------------------------------------------------------
  function renderModelsAvailability(server) {
    // The buttons follow the control mode: the index may have been listed before the first poll said it.
    if (st.modelsIndex && st.modelsMode !== server.model_control_mode) renderModels(st.modelsIndex);
    $("#models-none").hidden = server.repository;
    $("#models-body").hidden = !server.repository;
    const mode = server.model_control_mode;
    $("#models-mode").textContent = server.repository
      ? mode === "explicit"
        ? "model control mode: explicit (load and unload from here)"
        : `model control mode: ${mode} (load and unload need --model-control-mode explicit)`
      : "";
  }

  function modelsMessage(text, status) {
    const m = $("#models-msg");
    m.hidden = !text;
    m.textContent = text || "";
    m.dataset.status = status || "";
  }

  async function refreshModels() {
    if (st.live && !st.live.server.repository) return;
    let res;
    try {
      res = await api("v2/repository/index", { method: "POST", headers: { "Content-Type": "application/json" }, body: "{}" });
    } catch {
      modelsMessage("Cannot reach the server.", "error");
      return;
    }
    if (res.status === 401) {
      modelsMessage(authMessage(), "error");
      updateBanner();
      return;
    }
    if (!res.ok) {
      modelsMessage(`Listing the repository failed (${res.status}): ${await errorText(res)}`, "error");
      return;
    }
    renderModels(await res.json());
  }

  function renderModels(index) {
    st.modelsIndex = index;
    st.modelsMode = st.live ? st.live.server.model_control_mode : null;
    const explicit = st.modelsMode === "explicit";
    const seen = new Set();
    $("#models tbody").replaceChildren(
      ...index.map((m) => {
        const first = !seen.has(m.name);
        seen.add(m.name);
        const actions = el("td");
        if (first) {
          for (const action of ["load", "unload"]) {
            actions.append(
              el("button", {
                type: "button",
                "data-action": action,
                "data-model": m.name,
                disabled: !explicit,
                title: explicit ? `${action} ${m.name}` : "needs --model-control-mode explicit",
                text: action === "load" ? (m.state === "READY" ? "Reload" : "Load") : "Unload",
                onclick: () => modelAction(action, m.name),
              }),
              " ",
            );
          }
        }
        return el(
          "tr",
          { "data-model": m.name, "data-state": m.state },
          el("td", { text: first ? m.name : "" }),
          el("td", { text: m.version || "-" }),
          el("td", {}, el("span", { class: "state", "data-state": m.state, text: m.state })),
          el("td", { class: "muted", text: scrub(m.reason) }),
          actions,
        );
      }),
    );
  }

  async function modelAction(action, name) {
    modelsMessage(`${action === "load" ? "Loading" : "Unloading"} ${name}…`, "");
    let res;
    try {
      res = await api(`v2/repository/models/${encodeURIComponent(name)}/${action}`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: "{}",
      });
    } catch {
      modelsMessage("Cannot reach the server.", "error");
      return;
    }
    if (res.ok) modelsMessage(`${action === "load" ? "Loaded" : "Unloaded"} ${name}.`, "ok");
    else if (res.status === 401) {
      modelsMessage(`Could not ${action} ${name}: ${authMessage()}`, "error");
      updateBanner();
      return;
    } else modelsMessage(`Could not ${action} ${name} (${res.status}): ${await errorText(res)}`, "error");
    await refreshModels();
  }
  $("#models-refresh").addEventListener("click", refreshModels);

  // -- playground --------------------------------------------------------------------------------
  function playStats(p) {
    $("#play-ttft").textContent = p.ttft_ms === null ? "-" : `${fmt(p.ttft_ms, 0)} ms`;
    $("#play-ttft").dataset.ms = p.ttft_ms === null ? "" : String(p.ttft_ms);
    $("#play-tps").textContent = p.tps === null ? "-" : fmt(p.tps, 1);
    $("#play-tokens").textContent = p.tokens ? String(p.tokens) : "-";
    $("#play-finish").textContent = p.finish || "-";
  }

  function playEnd(p, state, message) {
    const out = $("#play-out");
    if (message) out.textContent = p.text ? `${p.text}\n\n[${message}]` : message;
    out.dataset.state = state;
    p.state = state;
    $("#play-send").disabled = false;
    $("#play-stop").disabled = true;
    playStats(p);
  }

  async function playSend(ev) {
    ev.preventDefault();
    if (st.play && st.play.state === "streaming") return;
    const messages = [];
    const system = $("#play-system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: $("#play-prompt").value });
    const body = {
      messages,
      max_tokens: Math.max(1, parseInt($("#play-max").value, 10) || 128),
      temperature: Math.max(0, parseFloat($("#play-temp").value) || 0),
      stream: true,
      stream_options: { include_usage: true },
    };
    const p = { text: "", ttft_ms: null, tps: null, tokens: 0, chunks: 0, finish: null, state: "streaming", lengths: [], controller: new AbortController() };
    st.play = p;
    hooks.play = p;
    const out = $("#play-out");
    out.textContent = "";
    out.dataset.state = "streaming";
    $("#play-send").disabled = true;
    $("#play-stop").disabled = false;
    playStats(p);
    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    let res;
    try {
      res = await api("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: p.controller.signal,
      });
    } catch (e) {
      playEnd(p, e.name === "AbortError" ? "stopped" : "error", e.name === "AbortError" ? "stopped" : "Cannot reach the server.");
      return;
    }
    if (!res.ok) {
      playEnd(p, "error", res.status === 401 ? authMessage() : `Error ${res.status}: ${await errorText(res)}`);
      updateBanner();
      return;
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    const handle = (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(scrub(chunk.error.message || "the stream ended with an error"));
      const choice = chunk.choices && chunk.choices[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        const now = performance.now();
        if (tFirst === null) {
          tFirst = now;
          p.ttft_ms = now - t0;
        }
        tLast = now;
        p.chunks += 1;
        p.tokens = p.chunks; // until the usage chunk says exactly
        p.text += piece;
        p.lengths.push(p.text.length);
        out.textContent = p.text;
        if (p.chunks > 1) p.tps = (p.chunks - 1) / ((tLast - tFirst) / 1000);
        playStats(p);
      }
      if (choice && choice.finish_reason) p.finish = choice.finish_reason;
      if (chunk.usage && chunk.usage.completion_tokens) {
        p.tokens = chunk.usage.completion_tokens;
        // Tokens after the first over the time they took: the rate a reader sees the answer grow at.
        if (p.tokens > 1 && tLast > tFirst) p.tps = (p.tokens - 1) / ((tLast - tFirst) / 1000);
      }
    };
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) if (line.startsWith("data: ")) handle(line.slice(6));
        }
      }
      playEnd(p, "done");
    } catch (e) {
      if (e.name === "AbortError") playEnd(p, "stopped", "stopped");
      else playEnd(p, "error", e.message || "the stream broke off");
    }
  }
  $("#play-form").addEventListener("submit", playSend);
  $("#play-stop").addEventListener("click", () => st.play && st.play.controller.abort());

  // -- bench results -----------------------------------------------------------------------------
  // A file of `tokenmill bench`: a sweep's top-level summary.json ("runs": one summary per level), one
  // level's summary.json, or a run.json ({"summary", "records"}).
  function benchRuns(data) {
    if (data && Array.isArray(data.runs)) return data.runs;
    if (data && data.summary && Array.isArray(data.records)) return [data.summary];
    if (data && typeof data.output_token_throughput === "number") return [data];
    return null;
  }

  const PALETTE = [BLUE, RED, GREEN, AMBER, PURPLE, "#0e9aa7", "#e76f51", "#264653"];

  function renderBench() {
    const files = st.bench;
    $("#bench-empty").hidden = files.length > 0;
    $("#bench-chart").hidden = files.length === 0;
    hooks.bench.files = files.length;
    if (st.benchChart) {
      st.benchChart.destroy();
      st.benchChart = null;
    }
    $("#bench-chart").replaceChildren();
    $("#bench-table").replaceChildren();
    if (!files.length) return;
    // One series per file over the union of their x values (uPlot shares one x axis): a file's line
    // joins its own points across the others'.
    const perFile = files.map((f) =>
      f.runs
        .filter((r) => r.tps_user && r.tps_user.p50 !== undefined && r.output_token_throughput !== undefined)
        .map((r) => ({ x: r.tps_user.p50, y: r.output_token_throughput, label: r.label || "" }))
        .sort((a, b) => a.x - b.x),
    );
    const xs = [...new Set(perFile.flat().map((pt) => pt.x))].sort((a, b) => a - b);
    const data = [xs, ...perFile.map((pts) => xs.map((x) => { const pt = pts.find((q) => q.x === x); return pt ? pt.y : null; }))];
    const labels = perFile.map((pts) => xs.map((x) => { const pt = pts.find((q) => q.x === x); return pt ? pt.label : null; }));
    hooks.bench.points = perFile.reduce((a, pts) => a + pts.length, 0);
    const box = $("#bench-chart");
    box.dataset.points = String(hooks.bench.points);
    box.append(el("h3", { text: "Throughput vs interactivity: output tokens/s of the system against output tokens/s per user (p50 of 1/ITL)" }));
    if (typeof uPlot === "undefined") return;
    const opts = {
      width: chartWidth(box),
      height: 360,
      // Padded ranges: the labels of the outermost points stay inside; throughput from zero.
      scales: {
        x: { time: false, range: (u, lo, hi) => { const pad = Math.max((hi - lo) * 0.08, 1); return [Math.max(0, lo - pad), hi + pad]; } },
        y: { range: (u, lo, hi) => [0, Math.max(hi * 1.15, 1)] },
      },
      legend: { live: false },
      series: [
        { label: "tokens/s per user" },
        ...files.map((f, i) => ({ label: f.name, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true, points: { show: true, size: 8 } })),
      ],
      axes: [
        { label: "output tokens/s per user (interactivity)", stroke: "#667085", grid: { stroke: "#eef0f3" } },
        { label: "output tokens/s (throughput)", stroke: "#667085", size: 64, grid: { stroke: "#eef0f3" } },
      ],
      hooks: {
        draw: [
          (u) => {
            // Each point named after its load level (c4, r2.0, ...), as the bench's own plot does.
            const ctx = u.ctx;
            ctx.save();
            ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
            ctx.fillStyle = "#475467";
            labels.forEach((row, si) =>
              row.forEach((label, i) => {
                const y = u.data[si + 1][i];
                if (label === null || y === null || !u.series[si + 1].show) return;
                ctx.fillText(label, u.valToPos(u.data[0][i], "x", true) + 6 * devicePixelRatio, u.valToPos(y, "y", true) - 6 * devicePixelRatio);
              }),
            );
            ctx.restore();
          },
        ],
      },
    };
    if (st.tab === "bench") st.benchChart = new uPlot(opts, data, box);
    else st.benchPending = () => (st.benchChart = new uPlot(opts, data, box));
    renderBenchTable(files);
  }

  function stat(r, key, k) {
    const s = r[key];
    return s && s[k] !== undefined && s[k] !== null ? s[k] : null;
  }

  function renderBenchTable(files) {
    const cols = files.flatMap((f) => f.runs.map((r) => ({ file: f.name, run: r })));
    const rows = [
      ["concurrency", (r) => r.concurrency ?? "-"],
      ["request rate (/s)", (r) => (r.request_rate === null || r.request_rate === undefined ? "-" : fmt(r.request_rate, 2))],
      ["completed", (r) => r.completed ?? "-"],
      ["failed", (r) => r.failed ?? "-"],
      ["requests/s", (r) => fmt(r.request_throughput, 2)],
      ["output tokens/s", (r) => fmt(r.output_token_throughput, 1)],
      ["TTFT p50 / p99 (ms)", (r) => `${fmt(stat(r, "ttft_ms", "p50"), 0)} / ${fmt(stat(r, "ttft_ms", "p99"), 0)}`],
      ["ITL p50 / p99 (ms)", (r) => `${fmt(stat(r, "itl_ms", "p50"), 1)} / ${fmt(stat(r, "itl_ms", "p99"), 1)}`],
      ["E2E p50 / p99 (ms)", (r) => `${fmt(stat(r, "e2e_ms", "p50"), 0)} / ${fmt(stat(r, "e2e_ms", "p99"), 0)}`],
      ["tokens/s per user p50", (r) => fmt(stat(r, "tps_user", "p50"), 1)],
      ["goodput (/s)", (r) => fmt(r.goodput, 2)],
      ["SLO attainment", (r) => (r.slos && r.slos.length ? pct(r.slo_attainment) : "-")],
    ];
    const head = el("tr", {}, el("th", { text: "" }), ...cols.map((c) => el("th", {}, el("div", { class: "muted", text: c.file }), c.run.label || "")));
    $("#bench-table").replaceChildren(
      el("thead", {}, head),
      el("tbody", {}, ...rows.map(([name, f]) => el("tr", {}, el("th", { text: name }), ...cols.map((c) => el("td", { text: f(c.run) }))))),
    );
  }

  function benchMessage(text) {
    const m = $("#bench-msg");
    m.hidden = !text;
    m.textContent = text || "";
    m.dataset.status = text ? "error" : "";
  }

  $("#bench-files").addEventListener("change", async (ev) => {
    const bad = [];
    for (const file of ev.target.files) {
      try {
        const runs = benchRuns(JSON.parse(await file.text()));
        if (!runs) bad.push(`${file.name}: not a summary.json or run.json of tokenmill bench`);
        else st.bench.push({ name: file.name, runs });
      } catch (e) {
        bad.push(`${file.name}: ${e.message}`);
      }
    }
    ev.target.value = "";
    benchMessage(bad.join("; "));
    renderBench();
  });
  $("#bench-clear").addEventListener("click", () => {
    st.bench = [];
    benchMessage("");
    renderBench();
  });

  // -- tabs ------------------------------------------------------------------------------------------
  const TABS = ["overview", "fleet", "models", "playground", "bench"];
  function showTab() {
    const want = location.hash.replace(/^#/, "");
    st.tab = TABS.includes(want) ? want : "overview";
    for (const a of document.querySelectorAll("#tabs a")) a.setAttribute("aria-selected", String(a.dataset.tab === st.tab));
    for (const p of document.querySelectorAll("main > section")) p.hidden = p.dataset.panel !== st.tab;
    if (st.tab === "overview") {
      renderCharts();
      resizeCharts();
    }
    if (st.tab === "models") refreshModels();
    if (st.tab === "bench" && st.benchPending) {
      st.benchPending();
      st.benchPending = null;
    }
    if (st.tab === "bench") resizeCharts();
  }
  window.addEventListener("hashchange", showTab);

  showKeyState();
  showTab();
  poll();
})();
