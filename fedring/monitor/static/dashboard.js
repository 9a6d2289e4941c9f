// The live dashboard of one fedring job: polls /api/state once a second and redraws
// in place. Every text that comes from the job (agent ids, event texts) is set with
// textContent, never parsed as HTML. Tests read #round[data-round] and each chart's
// data-points attribute.
"use strict";

const POLL_MS = 1000;
const MAX_ROWS = 4096; // as the feed: past this the older half is thinned

const state = { rows: [], since: null, eventsKey: "", membersKey: "", countersKey: "" };
const charts = {};

function $(id) { return document.getElementById(id); }

function fmtSeconds(s) {
  if (s === null || s === undefined) return "\u2013";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
  return `${sec}s`;
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "\u2013";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(b) >= 1000 && i < units.length - 1) { b /= 1000; i += 1; }
  const digits = b >= 100 || i === 0 || Number.isInteger(b) ? 0 : 1;
  return `${b.toFixed(digits)} ${units[i]}`;
}

function chart(id, series, yOpts) {
  const el = $(id);
  const opts = {
    width: Math.max(el.clientWidth, 300), height: 220,
    scales: { x: { time: false }, y: yOpts.scale || {} },
    series: [{ label: "round" }, ...series.map((s) => ({ spanGaps: true, width: 2, ...s }))],
    axes: [{ label: "round" }, { size: 64, values: yOpts.values }],
    legend: { live: false },
  };
  const data = [[], ...series.map(() => [])];
  charts[id] = { plot: new uPlot(opts, data, el), keys: series.map((s) => s.key), el };
}

function setupCharts() {
  chart("chart-accuracy", [{ key: "accuracy", label: "accuracy", stroke: "#3b6fd4" }], {});
  chart("chart-loss", [{ key: "loss", label: "loss", stroke: "#c0392b" }], {});
  const bytes = (u, ticks) => ticks.map(fmtBytes);
  chart("chart-bytes", [
    { key: "bytes_sent", label: "sent", stroke: "#3b6fd4" },
    { key: "dense_bytes", label: "dense equivalent", stroke: "#7a8499", dash: [6, 4] },
  ], { scale: { distr: 3 }, values: bytes });
  window.addEventListener("resize", () => {
    for (const c of Object.values(charts)) {
      c.plot.setSize({ width: Math.max(c.el.clientWidth, 300), height: 220 });
    }
  });
}

function positive(v) { return typeof v === "number" && v > 0 ? v : null; }
function finite(v) { return typeof v === "number" && Number.isFinite(v) ? v : null; }

function redrawCharts() {
  const rows = state.rows;
  const x = rows.map((r) => r.round);
  for (const [id, c] of Object.entries(charts)) {
    const clean = id === "chart-bytes" ? positive : finite;
    const ys = c.keys.map((k) => rows.map((r) => clean(r[k])));
    c.plot.setData([x, ...ys]);
    c.el.dataset.points = String(x.length);
  }
}

function mergeRows(s) {
  if (s.since === undefined) state.rows = s.rows.slice();
  else if (s.rows.length) {
    const first = s.rows[0].round;
    state.rows = state.rows.filter((r) => r.round < first).concat(s.rows);
  }
  const rolledBack = state.rows.some((r) => r.round > s.round);
  state.rows = state.rows.filter((r) => r.round <= s.round);
  if (state.rows.length > MAX_ROWS) {
    const half = Math.floor(state.rows.length / 2);
    state.rows = state.rows.slice(0, half).filter((_, i) => i % 2 === 0)
      .concat(state.rows.slice(half));
  }
  // a re-formed ring runs rounds again: fetch the whole curve once more next time
  state.since = rolledBack ? null : (state.rows.length ? state.rows[state.rows.length - 1].round : 0);
}

function redrawHeader(s) {
  $("job").textContent = s.job || "(enrolling)";
  $("phase").textContent = s.phase;
  $("phase").dataset.phase = s.phase;
  $("round").textContent = String(s.round);
  $("round").dataset.round = String(s.round);
  $("rounds").textContent = String(s.rounds);
  $("accuracy").textContent = s.accuracy === null ? "\u2013" : s.accuracy.toFixed(4);
  const last = state.rows.length ? state.rows[state.rows.length - 1] : {};
  $("loss").textContent = finite(last.loss) === null ? "\u2013" : last.loss.toFixed(4);
  $("online").textContent = `${s.online}/${s.agents}`;
  $("elapsed").textContent = fmtSeconds(s.elapsed_s);
  $("eta").textContent = s.phase === "training" ? fmtSeconds(s.eta_s) : "\u2013";
  const dense = positive(last.dense_bytes), sent = positive(last.bytes_sent);
  $("ratio").textContent = dense && sent ? `(${(dense / sent).toFixed(1)}x fewer bytes)` : "";
  document.title = `${s.round}/${s.rounds} ${s.phase} \u00b7 fedring ${s.job}`;
}

const SVG = "http://www.w3.org/2000/svg";
function svg(name, attrs, parent) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  parent.appendChild(el);
  return el;
}

function redrawRing(s) {
  const key = JSON.stringify([s.members, s.layout]);
  if (key === state.membersKey) return;
  state.membersKey = key;
  $("layout").textContent = s.layout ? `(${s.layout}, ${s.members.length} members)` : "";
  const ring = $("ring");
  ring.replaceChildren();
  ring.dataset.members = String(s.members.length);
  const n = s.members.length;
  if (!n) {
    svg("text", { x: 0, y: 0, class: "empty" }, ring).textContent = "no members yet";
    return;
  }
  const r = n === 1 ? 0 : 85;
  const at = s.members.map((_, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / n;
    return [r * Math.cos(a), r * Math.sin(a)];
  });
  const hub = s.layout === "star" || s.layout === "async";
  if (hub) {
    for (const [x, y] of at) svg("line", { x1: 0, y1: 0, x2: x, y2: y }, ring);
    svg("circle", { cx: 0, cy: 0, r: 9, class: "hub" }, ring);
  } else if (n > 1) {
    const d = at.map(([x, y], i) => `${i ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`).join("");
    svg("path", { d: `${d}Z` }, ring);
  }
  s.members.forEach((name, i) => {
    const [x, y] = at[i];
    const dot = svg("circle", { cx: x, cy: y, r: 7, class: i ? "member" : "member head" }, ring);
    svg("title", {}, dot).textContent = i ? name : `${name} (head: its rows are the curves)`;
    const label = svg("text", { x: x * 1.22, y: y * 1.22 + 4, class: "member-name" }, ring);
    label.textContent = name;
  });
}

function redrawEvents(s) {
  const key = JSON.stringify(s.events.length ? [s.events.length, s.events[s.events.length - 1]] : []);
  if (key === state.eventsKey) return;
  state.eventsKey = key;
  const list = $("events");
  list.replaceChildren();
  if (!s.events.length) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = "none yet: losses, re-formations and degrades show here";
    list.appendChild(li);
  }
  for (const e of s.events.slice().reverse()) {
    const li = document.createElement("li");
    const round = document.createElement("span");
    round.className = "round";
    round.textContent = `round ${e.round}`;
    const kind = document.createElement("span");
    kind.className = `kind ${String(e.kind).replace(/[^a-z-]/gi, "-")}`;
    kind.textContent = e.kind;
    li.append(round, kind, document.createTextNode(e.text));
    list.appendChild(li);
  }
}

function redrawCounters(s) {
  const key = JSON.stringify(s.counters);
  if (key === state.countersKey) return;
  state.countersKey = key;
  const body = $("counters").tBodies[0];
  body.replaceChildren();
  if (!Object.keys(s.counters).length) {
    const cell = body.insertRow().insertCell();
    cell.className = "empty";
    cell.textContent = "none yet: refused frames, timeouts and lost peers count here";
  }
  for (const name of Object.keys(s.counters).sort()) {
    const tr = body.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = String(s.counters[name]);
  }
}

async function poll() {
  const link = $("link");
  try {
    const query = state.since === null ? "" : `?since=${state.since}`;
    const res = await fetch(`/api/state${query}`, { cache: "no-store" });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const s = await res.json();
    mergeRows(s);
    redrawHeader(s);
    redrawCharts();
    redrawRing(s);
    redrawEvents(s);
    redrawCounters(s);
    link.dataset.state = "live";
    link.textContent = `live: updated ${new Date().toLocaleTimeString()}, every ${POLL_MS / 1000} s`;
  } catch (err) {
    link.dataset.state = "lost";
    link.textContent = `no answer from the job (${err.message}): it may have ended; showing the last state, retrying`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => { setupCharts(); poll(); });
