// voloco dashboard: polls /api/snapshot every 2 s and redraws in place. No libraries, no network
// beyond this origin. Every string a peer wrote (ids, device, state, role) goes into the page as
// text (textContent / setAttribute), never as HTML.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
let xAxis = "round";
let last = null;
let lastOk = 0;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function num(x) { return typeof x === "number" && isFinite(x); }

function fmtLoss(x) { return num(x) ? x.toFixed(3) : "–"; }

function fmtCount(x) {
  if (!num(x)) return "–";
  const units = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [d, u] of units) if (Math.abs(x) >= d) return (x / d).toFixed(x / d >= 100 ? 0 : 1) + u;
  return String(Math.round(x));
}

function fmtBytes(x) {
  if (!num(x)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB", "PB"];
  let i = 0;
  while (Math.abs(x) >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  return (i === 0 ? String(Math.round(x)) : x.toFixed(x >= 100 ? 0 : 1)) + " " + units[i];
}

function fmtAgo(s) {
  if (!num(s)) return "–";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(0) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function shortId(id) { return typeof id === "string" && id.length > 14 ? "…" + id.slice(-12) : String(id); }

function replaceChildren(node, children) {
  while (node.firstChild) node.removeChild(node.firstChild);
  for (const c of children) node.appendChild(c);
}

// ---- cards ----------------------------------------------------------------------------------
function renderCards(run) {
  const items = [
    ["round", run.round >= 0 ? run.round : "–"],
    ["live peers", run.peers],
    ["tokens", fmtCount(run.tokens_total)],
    ["tokens/s", fmtCount(run.tokens_per_s)],
    ["val loss", fmtLoss(run.val_loss)],
    ["best val loss", fmtLoss(run.best_val_loss)],
    ["bytes sent", fmtBytes(run.bytes_sent_total)],
    ["bytes received", fmtBytes(run.bytes_received_total)],
    ["chains", run.chains],
    ["strategy", run.strategy],
    ["parameters", fmtCount(run.params)],
    ["H (inner steps)", run.inner_steps],
  ];
  replaceChildren(document.getElementById("cards"), items.map(([label, value]) => {
    const c = el("div", "card");
    c.appendChild(el("div", "label", label));
    const v = el("div", "value", value);
    v.dataset.card = label;
    c.appendChild(v);
    return c;
  }));
}

// ---- the chart ------------------------------------------------------------------------------
function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
  return out;
}

function renderChart(history) {
  const chart = document.getElementById("chart");
  const W = Math.max(320, Math.round(chart.clientWidth || 900)), H = 300, L = 56, R = 16, T = 12, B = 34;
  chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const pts = (history && Array.isArray(history.points)) ? history.points : [];
  const xs = p => (xAxis === "round" ? p.round : p.tokens);
  const series = [["train", "loss"], ["val", "val_loss"]];
  const ys = [];
  for (const p of pts) for (const [, k] of series) if (num(p[k])) ys.push(p[k]);
  const nodes = [];
  let drawn = 0;
  if (pts.length === 0 || ys.length === 0) {
    nodes.push(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }));
    nodes[0].textContent = "no losses reported yet";
  } else {
    const xv = pts.map(xs).filter(num);
    let x0 = Math.min(...xv), x1 = Math.max(...xv);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    const pad = (y1 - y0) * 0.08 || 0.1;
    y0 = Math.max(0, y0 - pad); y1 = y1 + pad;
    const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    for (const t of niceTicks(y0, y1, 5)) {
      nodes.push(svg("line", { class: "grid", x1: L, x2: W - R, y1: sy(t), y2: sy(t) }));
      const label = svg("text", { x: L - 6, y: sy(t) + 4, "text-anchor": "end" });
      label.textContent = t.toFixed(2);
      nodes.push(label);
    }
    for (const t of niceTicks(x0, x1, 8)) {
      if (xAxis === "round" && t !== Math.round(t)) continue;
      nodes.push(svg("line", { class: "axis", x1: sx(t), x2: sx(t), y1: H - B, y2: H - B + 4 }));
      const label = svg("text", { x: sx(t), y: H - B + 16, "text-anchor": "middle" });
      label.textContent = xAxis === "round" ? String(t) : fmtCount(t);
      nodes.push(label);
    }
    nodes.push(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    nodes.push(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
    const xl = svg("text", { x: W - R, y: H - 4, "text-anchor": "end" });
    xl.textContent = xAxis === "round" ? "round" : "tokens";
    nodes.push(xl);
    for (const [cls, key] of series) {
      const seg = pts.filter(p => num(p[key]) && num(xs(p)));
      if (seg.length === 0) continue;
      const line = svg("polyline", { class: cls, points: seg.map(p => sx(xs(p)).toFixed(1) + "," + sy(p[key]).toFixed(1)).join(" ") });
      line.dataset.series = key;
      nodes.push(line);
      for (const p of seg) {
        const c = svg("circle", { class: cls, cx: sx(xs(p)).toFixed(1), cy: sy(p[key]).toFixed(1), r: seg.length > 120 ? 1.5 : 3 });
        const tip = svg("title");
        tip.textContent = `round ${p.round}, ${fmtCount(p.tokens)} tokens: ${key === "loss" ? "training" : "validation"} loss ${fmtLoss(p[key])}`;
        c.appendChild(tip);
        nodes.push(c);
        drawn++;
      }
    }
  }
  replaceChildren(chart, nodes);
  chart.setAttribute("data-points", String(drawn));
}

// ---- round, peers, chains -------------------------------------------------------------------
function renderMembers(run) {
  document.getElementById("round-no").textContent = run.round >= 0 ? String(run.round) : "–";
  const members = Array.isArray(run.members) ? run.members : [];
  const chips = members.map(id => { const c = el("span", "chip", shortId(id)); c.title = String(id); return c; });
  const more = num(run.members_total) ? run.members_total - members.length : 0;
  if (more > 0) chips.push(el("span", "muted", `and ${more} more`));
  replaceChildren(document.getElementById("members"), chips.length ? chips : [el("span", "muted", "no live peer at this round")]);
}

function cell(text, cls) { return el("td", cls, text); }

function renderPeers(peers) {
  const body = document.querySelector("#peers tbody");
  const rows = (peers && Array.isArray(peers.rows)) ? peers.rows : [];
  const count = document.getElementById("peer-count");
  count.textContent = peers ? (peers.shown < peers.total ? `${peers.shown} of ${peers.total}` : `${peers.total}`) : "";
  replaceChildren(body, rows.map(r => {
    const tr = el("tr", r.state === "stopped" ? "state-stopped" : "");
    tr.dataset.peer = String(r.peer_id);
    const id = cell(String(r.peer_id), "id");
    tr.appendChild(id);
    tr.appendChild(cell(r.role, "wrap"));
    tr.appendChild(cell(r.state));
    tr.appendChild(cell(r.device || "–", "wrap"));
    tr.appendChild(cell(r.round, "num"));
    tr.appendChild(cell(fmtLoss(r.loss), "num"));
    tr.appendChild(cell(fmtLoss(r.val_loss), "num"));
    tr.appendChild(cell(fmtCount(r.tokens_per_s), "num"));
    tr.appendChild(cell(fmtBytes(r.bytes_sent), "num"));
    tr.appendChild(cell(fmtBytes(r.bytes_received), "num"));
    const util = cell("", "num");
    const bar = el("span", "bar");
    const fill = el("span");
    const u = num(r.util) ? Math.max(0, Math.min(1, r.util)) : 0;
    fill.style.width = (u * 100).toFixed(0) + "%";
    bar.appendChild(fill);
    util.appendChild(bar);
    util.appendChild(document.createTextNode(num(r.util) ? (u * 100).toFixed(0) + "%" : "–"));
    tr.appendChild(util);
    tr.appendChild(cell(fmtAgo(r.last_seen_s), "num" + (r.last_seen_s > 30 ? " stale" : "")));
    const reach = ["public", "client", "unknown"].includes(r.reach) ? r.reach : "unknown";
    tr.appendChild(cell(reach === "client" ? "client-only" : reach, "reach-" + reach));
    return tr;
  }));
}

function renderChains(chains) {
  const box = document.getElementById("chains");
  const list = Array.isArray(chains) ? chains : [];
  document.getElementById("chain-count").textContent = String(list.length);
  replaceChildren(box, list.length ? list.map(ch => {
    const d = el("div", "chain");
    d.appendChild(el("span", "id", `${ch.chain_id} (epoch ${ch.epoch})`));
    const stages = el("div", "stages");
    for (const s of ch.stages || []) {
      const blocks = Array.isArray(s.blocks) ? `${s.blocks[0]}–${s.blocks[1] - 1}` : "?";
      const text = `stage ${s.stage}: ${shortId(s.peer_id)} · blocks ${blocks} · ${s.state} · ${fmtCount(s.tokens_per_s)} tok/s`;
      const st = el("span", "stage", text);
      st.title = String(s.peer_id);
      stages.appendChild(st);
    }
    d.appendChild(stages);
    return d;
  }) : [el("span", "muted", "no chains: every peer holds the model (or its slice)")]);
}

function render(snap) {
  last = snap;
  if (!snap || !snap.run) {
    document.getElementById("status").textContent = "waiting for the coordinator's first look at the DHT…";
    return;
  }
  const run = snap.run;
  document.getElementById("run-id").textContent = `${run.run_id} · spec ${run.spec}`;
  renderCards(run);
  renderChart(snap.history);
  renderMembers(run);
  renderPeers(snap.peers);
  renderChains(snap.chains);
}

async function poll() {
  try {
    const r = await fetch("/api/snapshot", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    lastOk = Date.now();
    document.getElementById("status").textContent = "live · updated " + new Date().toLocaleTimeString();
    document.body.dataset.updates = String((Number(document.body.dataset.updates) || 0) + 1);
  } catch (e) {
    const ago = lastOk ? ` (last update ${Math.round((Date.now() - lastOk) / 1000)} s ago)` : "";
    document.getElementById("status").textContent = "cannot reach the coordinator" + ago;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function setAxis(axis) {
  xAxis = axis;
  document.getElementById("x-round").classList.toggle("on", axis === "round");
  document.getElementById("x-tokens").classList.toggle("on", axis === "tokens");
  if (last) renderChart(last.history);
}

document.addEventListener("DOMContentLoaded", () => {
  window.addEventListener("resize", () => { if (last) renderChart(last.history); });
  document.getElementById("x-round").addEventListener("click", () => setAxis("round"));
  document.getElementById("x-tokens").addEventListener("click", () => setAxis("tokens"));
  poll();
});
