// pagedserve KV dashboard: draws one frame (see the frame JSON in the dashboard's contract) at a time.
// Live, frames arrive over server-sent events; in a report they are embedded in
// <script id="frames" type="application/json"> and stepped through.
"use strict";

const STATES = ["free", "used", "shared", "cached"]; // frame.cells codes 0..3
const MAX_EVENTS = 300; // the page's own event log keeps at most this many rows
const MAX_TOOLTIP_OWNERS = 16;
const MAX_ARROWS = 96;
const CHART_W = 200; // the charts' viewBox; strokes do not scale with it
const CHART_H = 48;
const KIND_COLORS = 6; // the palette of group kinds in the CSS (data-kind-color 0..5)

const $ = (id) => document.getElementById(id);
// Taken from the inline <svg> so that no namespace URL has to be spelled out in this file.
const SVG_NS = $("arrows").namespaceURI;

const state = {
  mode: "live",
  frame: null, // the frame on screen
  framesRendered: 0,
  owners: new Map(), // physical block id -> [{req, index}] in the frame on screen
  pool: { n: -1, cellBlocks: 0, cells: [], states: [], refs: [], texts: [], groups: [] },
  groupColors: [], // per KV cache group of the frame on screen: its kind's colour (groups of one window share it)
  rows: new Map(), // request id -> its .request element, reused from frame to frame
  hover: null, // {request: id} or {blocks: [ids]}: what the pool highlights
  highlighted: [], // cell indices that carry the class "highlight"
  tooltipCell: -1, // the cell the tooltip describes, -1 when hidden
  lastSeq: -1, // the newest event seq in the live log
  charts: null,
};

// ---- small helpers -------------------------------------------------------------------------------

function setText(el, text) {
  // Only touch the DOM when the text changes: most figures stay put between frames.
  if (el && el.textContent !== text) el.textContent = text;
}

function int(v) {
  return Number.isFinite(v) ? String(Math.round(v)) : "–";
}

function pct(v) {
  if (!Number.isFinite(v)) return "–";
  const p = v * 100;
  return (p !== 0 && Math.abs(p) < 10 ? p.toFixed(1) : p.toFixed(0)) + "%";
}

function rate(v) {
  if (!Number.isFinite(v)) return "–";
  return v >= 100 ? v.toFixed(0) : v.toFixed(1);
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function clamp(v, lo, hi) {
  return Math.min(hi, Math.max(lo, v));
}

function setStatus(text, detail) {
  const s = $("status");
  setText(s, text);
  s.dataset.status = text;
  s.title = detail || "";
}

// The tokens a request's logical block holds, as "a-b" (inclusive), per the contract's range.
function tokenRange(index, blockSize, numTokens) {
  const first = index * blockSize;
  const last = Math.min((index + 1) * blockSize, numTokens) - 1;
  return last >= first ? `${first}-${last}` : "none yet";
}

// ---- KV cache groups: a model mixing full attention and sliding windows keeps a block table per group ----

function isGrouped(frame) {
  return (frame.groups || []).length > 1;
}

function groupKind(group) {
  return group && group.window ? `sliding ${group.window}` : "full";
}

// Groups of one window share a colour: their window's place among the frame's windows, in order.
function kindColors(groups) {
  const windows = [];
  return groups.map((g) => {
    const w = g.window || 0;
    if (!windows.includes(w)) windows.push(w);
    return windows.indexOf(w) % KIND_COLORS;
  });
}

// The request's tables, one per group (null where a block left its sliding window); a frame without
// them has the one table `blocks`.
function requestTables(req) {
  return req.groups || [req.blocks || []];
}

// Each block the request holds: {block, index (its logical block), group}.
function heldEntries(req) {
  const out = [];
  requestTables(req).forEach((table, group) =>
    table.forEach((block, index) => {
      if (block !== null && block !== undefined) out.push({ block, index, group });
    })
  );
  return out;
}

function groupName(frame, g) {
  const group = (frame.groups || [])[g];
  return `group ${g}: ${groupKind(group)}`;
}

function cellOfBlock(block) {
  const i = Math.floor(block / Math.max(1, state.pool.cellBlocks));
  return state.pool.cells[i];
}

// ---- one frame ------------------------------------------------------------------------------------

function renderFrame(frame) {
  state.frame = frame;
  state.owners = indexOwners(frame);
  renderHeader(frame);
  renderGroups(frame);
  renderPool(frame);
  renderRequests(frame);
  renderCharts(frame.series || {});
  refreshHover();
}

// Counted last, after the events too, so that a test waiting on it sees the whole frame drawn.
function frameDone() {
  state.framesRendered += 1;
  document.body.dataset.frames = String(state.framesRendered);
}

function indexOwners(frame) {
  const owners = new Map();
  for (const req of frame.requests || []) {
    for (const { block, index, group } of heldEntries(req)) {
      let list = owners.get(block);
      if (!list) owners.set(block, (list = []));
      list.push({ req, index, group });
    }
  }
  return owners;
}

// ---- header: counts per state and the engine's own figures -----------------------------------------

function renderHeader(frame) {
  const counts = frame.counts || {};
  for (const s of STATES) setText($("counts-" + s), int(counts[s]));

  const e = frame.engine || {};
  setText($("engine-free"), int(e.free_blocks));
  setText($("engine-used"), int(e.used_blocks));
  setText($("engine-cached"), int(e.cached_free_blocks));
  setText($("engine-total"), int(e.total_blocks));
  setText($("engine-block-size"), int(frame.block_size));
  setText($("engine-usage"), pct(e.usage));
  setText($("engine-waste"), pct(e.waste));
  setText($("engine-hit-rate"), pct(e.prefix_hit_rate));
  setText($("engine-cow"), int(e.cow_copies));
  setText($("engine-running"), int(e.num_running));
  setText($("engine-waiting"), int(e.num_waiting));
  setText($("engine-preemptions"), int(e.num_preemptions));
  // Offloaded blocks only matter with a KV tier behind the pool: shown when there are any.
  const offloaded = Number(e.offloaded_blocks) || 0;
  $("engine-offloaded-item").hidden = !(offloaded > 0);
  setText($("engine-offloaded"), int(offloaded));
}

// ---- the KV cache groups' legend: each group, its window and its blocks --------------------------------

function renderGroups(frame) {
  const groups = frame.groups || [];
  state.groupColors = kindColors(groups);
  const box = $("groups-legend");
  box.hidden = groups.length <= 1;
  if (box.hidden) return;
  if (box.childElementCount !== groups.length) {
    box.replaceChildren(
      ...groups.map((_, g) => {
        const item = el("span", "legend-item group-item");
        item.dataset.group = String(g);
        item.append(el("i", "swatch swatch-group"), el("span", "group-name"), el("b", "group-used"));
        return item;
      })
    );
  }
  groups.forEach((group, g) => {
    const item = box.children[g];
    const [swatch, name, used] = item.children;
    swatch.dataset.kindColor = String(state.groupColors[g]);
    item.dataset.window = String(group.window || 0);
    setText(name, groupName(frame, g));
    setText(used, int(group.used_blocks));
    const title = `${int(group.used_blocks)} blocks in use, ${int(group.cached_blocks)} cached`;
    if (item.title !== title) item.title = title;
  });
}

// ---- the block pool ---------------------------------------------------------------------------------

// Cell elements are made once per change in their number; frames then only update attributes.
function renderPool(frame) {
  const cells = frame.cells || [];
  const refs = frame.cell_refs || [];
  const cellGroups = frame.cell_groups || [];
  const grouped = isGrouped(frame);
  const cellBlocks = Math.max(1, frame.cell_blocks || 1);
  const p = state.pool;
  if (cells.length !== p.n || cellBlocks !== p.cellBlocks) buildPool(cells.length, cellBlocks);
  $("pool").classList.toggle("grouped", grouped);

  for (let i = 0; i < cells.length; i++) {
    const s = STATES[cells[i]] || "free";
    const r = refs[i] || 0;
    const text = s === "shared" ? String(r) : "";
    const cell = p.cells[i];
    if (p.states[i] !== s) cell.dataset.state = p.states[i] = s;
    if (p.refs[i] !== r) {
      p.refs[i] = r;
      cell.dataset.ref = String(r);
    }
    if (p.texts[i] !== text) cell.textContent = p.texts[i] = text;
    // The group whose tokens the cell's blocks hold, drawn as a bar in its kind's colour.
    const g = grouped && cellGroups[i] >= 0 ? cellGroups[i] : -1;
    const group = g >= 0 ? `${g}:${state.groupColors[g] || 0}` : "";
    if (p.groups[i] !== group) {
      p.groups[i] = group;
      if (g >= 0) {
        cell.dataset.group = String(g);
        cell.dataset.kindColor = String(state.groupColors[g] || 0);
      } else {
        delete cell.dataset.group;
        delete cell.dataset.kindColor;
      }
    }
  }

  const note = [`${int(frame.num_blocks)} blocks × ${int(frame.block_size)} tokens`];
  if (cellBlocks > 1) note.push(`${cellBlocks} blocks per cell`);
  note.push("a number is a shared block's ref count");
  if (grouped) note.push("the bar's colour is the KV cache group's kind");
  setText($("pool-note"), note.join(", "));
}

function buildPool(n, cellBlocks) {
  const pool = $("pool");
  const frag = document.createDocumentFragment();
  const cells = new Array(n);
  for (let i = 0; i < n; i++) {
    const cell = el("div", "cell");
    cell.dataset.index = String(i);
    cell.dataset.block = String(i * cellBlocks);
    cells[i] = cell;
    frag.appendChild(cell);
  }
  pool.replaceChildren(frag);
  Object.assign(state.pool, {
    n,
    cellBlocks,
    cells,
    states: new Array(n).fill(""),
    refs: new Array(n).fill(-1),
    texts: new Array(n).fill(null),
    groups: new Array(n).fill(null),
  });
  state.highlighted = [];
  sizePool();
}

// Square cells sized so that the whole pool fits the panel's width and about 40% of the window's
// height: large squares for a small pool, down to ~8 px so that 4096 cells still fit a screen.
function sizePool() {
  const pool = $("pool");
  const n = Math.max(1, state.pool.n);
  const width = pool.clientWidth || 800;
  const height = Math.max(180, window.innerHeight * 0.4);
  const side = Math.sqrt((width * height) / n);
  const gap = side >= 16 ? 3 : 1;
  const size = clamp(Math.floor(side) - gap, 6, 30);
  pool.style.setProperty("--cell", size + "px");
  pool.style.setProperty("--gap", gap + "px");
  pool.classList.toggle("tiny", size < 12);
  // Cells this large have room for their block id (drawn by CSS, not part of the cell's text).
  pool.classList.toggle("labelled", size >= 24);
}

// ---- the tooltip: who holds a block ------------------------------------------------------------------

function showTooltip(cellIndex, x, y) {
  const tip = $("tooltip");
  state.tooltipCell = cellIndex;
  fillTooltip(cellIndex);
  tip.hidden = false;
  // Beside the pointer, flipped when it would leave the window.
  const w = tip.offsetWidth;
  const h = tip.offsetHeight;
  let left = x + 14;
  let top = y + 14;
  if (left + w > window.innerWidth - 4) left = Math.max(4, x - w - 14);
  if (top + h > window.innerHeight - 4) top = Math.max(4, y - h - 14);
  tip.style.left = left + "px";
  tip.style.top = top + "px";
}

function hideTooltip() {
  state.tooltipCell = -1;
  $("tooltip").hidden = true;
}

function fillTooltip(cellIndex) {
  const frame = state.frame;
  const p = state.pool;
  if (!frame || cellIndex < 0 || cellIndex >= p.n) return;
  const bs = frame.block_size || 1;
  const first = cellIndex * p.cellBlocks;
  const last = Math.min(first + p.cellBlocks, frame.num_blocks || first + 1) - 1;
  const s = p.states[cellIndex];
  const ref = p.refs[cellIndex];

  const lines = [];
  const head = p.cellBlocks === 1 ? `block ${first}` : `blocks ${first}-${last} (cell ${cellIndex})`;
  lines.push(el("div", "tip-head", head));
  const what = el("div", "tip-state");
  what.append(el("i", "swatch"), `${s}` + (ref > 0 ? `, ref ${ref}` : ""));
  what.firstChild.dataset.state = s;
  lines.push(what);
  const grouped = isGrouped(frame);
  const cellGroup = grouped ? (frame.cell_groups || [])[cellIndex] : -1;
  if (cellGroup >= 0) {
    const group = el("div", "tip-group");
    const swatch = el("i", "swatch swatch-group");
    swatch.dataset.kindColor = String(state.groupColors[cellGroup] || 0);
    group.append(swatch, (p.cellBlocks > 1 ? "mostly " : "") + groupName(frame, cellGroup));
    lines.push(group);
  }

  let shown = 0;
  let more = 0;
  for (let b = first; b <= last; b++) {
    for (const { req, index, group } of state.owners.get(b) || []) {
      if (shown >= MAX_TOOLTIP_OWNERS) {
        more += 1;
        continue;
      }
      const where = p.cellBlocks > 1 ? ` (block #${b})` : "";
      const inGroup = grouped ? ` in group ${group}` : "";
      const line = `${req.id} block ${index} tokens ${tokenRange(index, bs, req.num_tokens || 0)}${inGroup}${where}`;
      lines.push(el("div", "tip-owner", line));
      shown += 1;
    }
  }
  if (more) lines.push(el("div", "tip-note", `… and ${more} more`));
  if (!shown && !more) {
    // No listed request holds it: say why, so an empty list does not look like a bug.
    const why = {
      free: "free: no owner",
      cached: "free, holds a cached prefix block: reused on a prefix hit, evicted when the pool runs short",
      used: "held by a request not listed (the frame lists at most 64)",
      shared: "held by requests not listed (the frame lists at most 64)",
    }[s];
    if (why) lines.push(el("div", "tip-note", why));
  } else if (s === "shared" && p.cellBlocks === 1 && ref > shown && !more) {
    lines.push(el("div", "tip-note", `+${ref - shown} holder(s) not listed`));
  }
  $("tooltip").replaceChildren(...lines);
}

function onPoolOver(event) {
  const cell = event.target.closest(".cell");
  if (!cell) return hideTooltip();
  showTooltip(Number(cell.dataset.index), event.clientX, event.clientY);
}

function onPoolMove(event) {
  if (state.tooltipCell >= 0) showTooltip(state.tooltipCell, event.clientX, event.clientY);
}

// ---- requests and their block tables ------------------------------------------------------------------

// Rows are kept per request id and updated in place, so a hovered row survives the next frame.
function renderRequests(frame) {
  const box = $("requests");
  const reqs = frame.requests || [];
  const seen = new Set();
  reqs.forEach((req, pos) => {
    if (seen.has(req.id)) return;
    seen.add(req.id);
    let row = state.rows.get(req.id);
    if (!row) state.rows.set(req.id, (row = makeRequestRow(req.id)));
    updateRequestRow(row, req, frame);
    if (box.children[pos] !== row) box.insertBefore(row, box.children[pos] || null);
  });
  for (const [id, row] of state.rows) {
    if (!seen.has(id)) {
      row.remove();
      state.rows.delete(id);
    }
  }
  const total = Number.isFinite(frame.num_requests) ? frame.num_requests : reqs.length;
  setText($("requests-note"), total > reqs.length ? `showing ${reqs.length} of ${total}` : String(total));
}

function makeRequestRow(id) {
  const row = el("div", "request");
  row.dataset.request = id;
  const head = el("div", "req-head");
  head.append(el("span", "req-id", id), el("span", "req-status"), el("span", "req-tokens"));
  row.append(head, el("div", "req-blocks"));
  return row;
}

function updateRequestRow(row, req, frame) {
  const status = req.status || "";
  if (row.dataset.status !== status) row.dataset.status = status;
  const [, statusEl, tokensEl] = row.firstChild.children;
  setText(statusEl, status);
  const held = heldEntries(req).length;
  setText(tokensEl, `${int(req.num_tokens)} tokens, ${held} block${held === 1 ? "" : "s"}`);

  // One strip of blocks; with several KV cache groups, one per group, labelled with its kind.
  const strip = row.lastChild;
  const grouped = isGrouped(frame);
  const tables = requestTables(req);
  const key = (grouped ? "groups " : "") + JSON.stringify(tables);
  if (strip.dataset.key !== key) {
    strip.dataset.key = key;
    if (grouped) {
      strip.replaceChildren(
        ...tables.map((table, g) => {
          const part = el("div", "req-group");
          part.dataset.group = String(g);
          const label = el("span", "req-group-label", `g${g} ${groupKind(frame.groups[g])}`);
          label.dataset.kindColor = String(state.groupColors[g] || 0);
          part.append(label, ...tableSpans(table, g));
          return part;
        })
      );
    } else {
      strip.replaceChildren(...tableSpans(tables[0] || [], 0));
    }
  }
  // Coloured like the pool cell of the block. A block in a table is held, so an aggregated cell
  // whose majority is free or cached still shows as used here.
  const bs = frame.block_size || 1;
  const n = req.num_tokens || 0;
  for (const b of strip.querySelectorAll(".req-block")) {
    const block = Number(b.dataset.block);
    const index = Number(b.dataset.index);
    const cell = cellOfBlock(block);
    let s = cell ? cell.dataset.state : "used";
    if (s === "free" || s === "cached") s = "used";
    if (b.dataset.state !== s) b.dataset.state = s;
    const inGroup = grouped ? ` (${groupName(frame, Number(b.dataset.group))})` : "";
    const title = `logical ${index} → physical ${block}, tokens ${tokenRange(index, bs, n)}${inGroup}`;
    if (b.title !== title) b.title = title;
  }
}

// A table's held blocks as spans; the blocks a sliding window let go of (null) as one count before them.
function tableSpans(table, group) {
  const spans = [];
  const slid = table.filter((block) => block === null || block === undefined).length;
  if (slid) {
    const note = el("span", "req-slid", `${slid} slid`);
    note.dataset.count = String(slid);
    note.title = `${slid} block${slid === 1 ? "" : "s"} behind the sliding window, back in the pool`;
    spans.push(note);
  }
  table.forEach((block, index) => {
    if (block === null || block === undefined) return;
    const b = el("span", "req-block", String(block));
    b.dataset.block = String(block);
    b.dataset.index = String(index);
    b.dataset.group = String(group);
    spans.push(b);
  });
  return spans;
}

// ---- hover: a request's (or an event's) blocks highlighted in the pool ---------------------------------

function setHover(hover) {
  state.hover = hover;
  refreshHover();
}

// Re-applied after every frame: the hovered request's table may have grown, or it may be gone.
function refreshHover() {
  let blocks = [];
  const h = state.hover;
  if (h && h.request !== undefined) {
    const req = (state.frame && (state.frame.requests || []).find((r) => r.id === h.request)) || null;
    if (req) blocks = req.blocks || [];
    for (const [id, row] of state.rows) row.classList.toggle("hovered", id === h.request);
  } else {
    for (const row of state.rows.values()) row.classList.remove("hovered");
    if (h && h.blocks) blocks = h.blocks;
  }
  highlightBlocks(blocks);
  drawArrows();
  if (state.tooltipCell >= 0) fillTooltip(state.tooltipCell);
}

function highlightBlocks(blocks) {
  const p = state.pool;
  const next = new Set();
  for (const b of blocks) {
    const i = Math.floor(b / Math.max(1, p.cellBlocks));
    if (i >= 0 && i < p.n) next.add(i);
  }
  for (const i of state.highlighted) if (!next.has(i)) p.cells[i].classList.remove("highlight");
  for (const i of next) p.cells[i].classList.add("highlight");
  state.highlighted = [...next];
}

// Arrows from the hovered request's table to its pool cells: the logical -> physical mapping.
function drawArrows() {
  const svg = $("arrows");
  const h = state.hover;
  const row = h && h.request !== undefined ? state.rows.get(h.request) : null;
  if (!row) {
    if (svg.firstChild) svg.replaceChildren();
    return;
  }
  const paths = [];
  const blocks = row.querySelectorAll(".req-block");
  for (let i = 0; i < blocks.length && i < MAX_ARROWS; i++) {
    const cell = cellOfBlock(Number(blocks[i].dataset.block));
    if (!cell) continue;
    const a = blocks[i].getBoundingClientRect();
    const c = cell.getBoundingClientRect();
    const x1 = a.left + a.width / 2;
    const x2 = c.left + c.width / 2;
    // Leave the table cell on the side facing the pool cell; curve vertically in between.
    const up = c.top < a.top;
    const y1 = up ? a.top : a.bottom;
    const y2 = up ? c.bottom : c.top;
    const bend = Math.max(24, Math.abs(y1 - y2) / 2) * (up ? -1 : 1);
    paths.push(
      svgEl("path", { d: `M${x1},${y1} C${x1},${y1 + bend} ${x2},${y2 - bend} ${x2},${y2}`, class: "arrow" }),
      svgEl("circle", { cx: x2, cy: y2, r: 2.5, class: "arrow-end" })
    );
  }
  svg.replaceChildren(...paths);
}

function onRequestsOver(event) {
  const blockEl = event.target.closest(".req-block");
  const cell = blockEl ? cellOfBlock(Number(blockEl.dataset.block)) : null;
  if (cell) showTooltip(Number(cell.dataset.index), event.clientX, event.clientY);
  else hideTooltip();
  const row = event.target.closest(".request");
  const id = row ? row.dataset.request : null;
  const current = state.hover ? state.hover.request : undefined;
  if (id === null) {
    if (current !== undefined) setHover(null);
  } else if (id !== current) {
    setHover({ request: id });
  }
}

function onEventsOver(event) {
  const row = event.target.closest(".event");
  const blocks = row && row.dataset.blocks ? row.dataset.blocks.split(",").map(Number) : [];
  setHover(blocks.length ? { blocks } : null);
}

function onLeave() {
  hideTooltip();
  setHover(null);
}

// ---- the event log ------------------------------------------------------------------------------------

function makeEventRow(ev) {
  const row = el("div", "event");
  const kind = String(ev.kind || "");
  row.dataset.kind = kind;
  row.dataset.seq = String(ev.seq);
  const blocks = ev.blocks || [];
  if (blocks.length) row.dataset.blocks = blocks.join(",");
  const badge = el("span", "badge", kind.replace("_", " "));
  badge.dataset.kind = kind;
  const shown = blocks.length > 8 ? blocks.slice(0, 8).join(" ") + ` …+${blocks.length - 8}` : blocks.join(" ");
  row.append(
    badge,
    // A replay's times count steps of its script; a live stream's, seconds since the watch began.
    el("span", "ev-t", !Number.isFinite(ev.t) ? "" : state.mode === "replay" ? `step ${ev.t}` : ev.t.toFixed(2) + "s"),
    el("span", "ev-req", ev.request || ""),
    el("span", "ev-blocks", blocks.length ? `[${shown}]` : ""),
    el("span", "ev-text", ev.text || "")
  );
  return row;
}

// Live: frames repeat the newest events; only those whose seq is new are added, newest on top.
function appendEvents(events) {
  const box = $("events");
  events = events || [];
  // A seq lower than the newest shown means a new watch (the server restarted): start over.
  if (events.length && events[events.length - 1].seq < state.lastSeq) {
    box.replaceChildren();
    state.lastSeq = -1;
  }
  const fresh = events.filter((ev) => ev.seq > state.lastSeq);
  if (!fresh.length) return;
  state.lastSeq = fresh[fresh.length - 1].seq;
  const frag = document.createDocumentFragment();
  for (let i = fresh.length - 1; i >= fresh.length - MAX_EVENTS && i >= 0; i--) frag.appendChild(makeEventRow(fresh[i]));
  box.prepend(frag);
  while (box.childElementCount > MAX_EVENTS) box.lastElementChild.remove();
}

// Replay: the log is the events of frames 0..i, so stepping back removes the later ones.
function replayEvents(frames, upTo) {
  let last = -1;
  const kept = [];
  for (let k = 0; k <= upTo; k++) {
    for (const ev of frames[k].events || []) {
      if (ev.seq > last) {
        kept.push(ev);
        last = ev.seq;
      }
    }
  }
  const frag = document.createDocumentFragment();
  const tail = kept.slice(-MAX_EVENTS).reverse();
  for (const ev of tail) frag.appendChild(makeEventRow(ev));
  $("events").replaceChildren(frag);
}

// ---- the time-series charts ---------------------------------------------------------------------------

const CHARTS = [
  { id: "chart-usage", latest: "latest-usage", series: ["usage"], fraction: true },
  { id: "chart-waste", latest: "latest-waste", series: ["waste"], fraction: true },
  { id: "chart-hit-rate", latest: "latest-hit-rate", series: ["prefix_hit_rate"], fraction: true },
  { id: "chart-requests", latest: "latest-requests", series: ["running", "waiting"] },
  { id: "chart-tokens", latest: "latest-tokens", series: ["tokens_per_s"] },
];

// The SVG parts are made once; each frame sets the polylines' points.
function setupCharts() {
  state.charts = CHARTS.map((spec) => {
    const svg = $(spec.id);
    svg.replaceChildren(
      svgEl("line", { x1: 0, y1: CHART_H / 2, x2: CHART_W, y2: CHART_H / 2, class: "grid" }),
      svgEl("line", { x1: 0, y1: CHART_H - 1, x2: CHART_W, y2: CHART_H - 1, class: "axis" })
    );
    const area = spec.series.length === 1 ? svgEl("polygon", { class: "area area-" + spec.series[0] }) : null;
    if (area) svg.appendChild(area);
    const lines = spec.series.map((name) => {
      const line = svgEl("polyline", { class: "line line-" + name, "data-series": name, fill: "none" });
      line.setAttribute("vector-effect", "non-scaling-stroke");
      svg.appendChild(line);
      return line;
    });
    const scale = el("span", "scale");
    svg.parentNode.appendChild(scale);
    return { spec, svg, area, lines, scale };
  });
}

function renderCharts(series) {
  if (!state.charts) setupCharts();
  for (const chart of state.charts) renderChart(chart, series);
}

function renderChart(chart, series) {
  const { spec, svg, area, lines, scale } = chart;
  const t = series.t || [];
  const columns = spec.series.map((name) => series[name] || []);
  const n = Math.max(0, ...columns.map((c) => c.length));
  // Fractions on a fixed 0..100% scale; counts and rates from 0 to a rounded-up maximum.
  let max = 1;
  if (!spec.fraction) {
    for (const c of columns) for (const v of c) if (Number.isFinite(v) && v > max) max = v;
    max = niceCeil(max);
  }
  const t0 = t.length ? t[0] : 0;
  const t1 = t.length ? t[t.length - 1] : 0;
  const x = (i) => {
    if (n <= 1) return CHART_W;
    if (t.length === n && Number.isFinite(t0) && t1 > t0) return ((t[i] - t0) / (t1 - t0)) * CHART_W;
    return (i / (n - 1)) * CHART_W;
  };
  const y = (v) => CHART_H - 2 - (clamp(v, 0, max) / max) * (CHART_H - 4);

  columns.forEach((column, k) => {
    const pts = [];
    for (let i = 0; i < column.length; i++) {
      if (Number.isFinite(column[i])) pts.push(`${x(i).toFixed(1)},${y(column[i]).toFixed(1)}`);
    }
    // A single point still shows as a short flat line at its value.
    if (pts.length === 1) pts.unshift(`${(CHART_W - 6).toFixed(1)},${pts[0].split(",")[1]}`);
    lines[k].setAttribute("points", pts.join(" "));
    if (area && k === 0) {
      area.setAttribute("points", pts.length ? `${pts[0].split(",")[0]},${CHART_H} ${pts.join(" ")} ${pts[pts.length - 1].split(",")[0]},${CHART_H}` : "");
    }
  });

  const lastOf = (c) => (c.length ? c[c.length - 1] : NaN);
  const latest = $(spec.latest);
  if (spec.id === "chart-requests") {
    setText(latest, `${int(lastOf(columns[0]))} running · ${int(lastOf(columns[1]))} waiting`);
  } else if (spec.fraction) {
    setText(latest, pct(lastOf(columns[0])));
  } else {
    setText(latest, rate(lastOf(columns[0])));
  }
  setText(scale, spec.fraction ? "100%" : String(max));
  svg.dataset.points = String(n);
}

// 1, 2, 5, 10, 20, 50, ...: a round top for a chart's scale.
function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

// ---- modes ---------------------------------------------------------------------------------------------

function startLive() {
  state.mode = "live";
  document.body.dataset.mode = "live";
  setStatus("connecting");
  const key = new URLSearchParams(location.search).get("api_key");
  // Built from the path: "events" relative to "/dashboard" (no trailing slash) would be "/events".
  const url = location.pathname.replace(/\/$/, "") + "/events" + (key ? "?api_key=" + encodeURIComponent(key) : "");
  const source = new EventSource(url);
  source.onopen = () => setStatus("live");
  // EventSource reconnects by itself (unless the server refused it: then it stays closed).
  source.onerror = () =>
    setStatus("disconnected", source.readyState === EventSource.CLOSED ? "the server refused the stream; reload to retry" : "reconnecting");
  source.onmessage = (message) => {
    let frame;
    try {
      frame = JSON.parse(message.data);
    } catch (err) {
      console.warn("dashboard: a message that is not frame JSON", err);
      return;
    }
    if (state.mode === "live" && $("status").textContent !== "live") setStatus("live");
    renderFrame(frame);
    appendEvents(frame.events);
    frameDone();
  };
}

function startReplay(script) {
  state.mode = "replay";
  document.body.dataset.mode = "replay";
  setStatus("replay");
  let frames = [];
  try {
    frames = JSON.parse(script.textContent);
  } catch (err) {
    console.warn("dashboard: the embedded frames are not JSON", err);
  }
  if (!Array.isArray(frames)) frames = [];
  const n = frames.length;
  const slider = $("replay-slider");
  const prev = $("replay-prev");
  const next = $("replay-next");
  const caption = $("caption");
  $("replay").hidden = false;
  caption.hidden = false;
  slider.max = String(Math.max(0, n - 1));
  let index = 0;

  function show(i) {
    if (!n) {
      setText($("replay-position"), "0 / 0");
      setText(caption, "no frames");
      prev.disabled = next.disabled = slider.disabled = true;
      return;
    }
    index = clamp(i, 0, n - 1);
    const frame = frames[index];
    renderFrame(frame);
    replayEvents(frames, index);
    slider.value = String(index);
    setText($("replay-position"), `${index + 1} / ${n}`);
    setText(caption, frame.caption || "");
    prev.disabled = index === 0;
    next.disabled = index === n - 1;
    frameDone();
  }

  prev.addEventListener("click", () => show(index - 1));
  next.addEventListener("click", () => show(index + 1));
  slider.addEventListener("input", () => show(Number(slider.value)));
  document.addEventListener("keydown", (event) => {
    // The focused slider steps on arrows by itself (its input event above renders).
    if (event.target === slider || event.altKey || event.ctrlKey || event.metaKey) return;
    const step = { ArrowLeft: -1, ArrowRight: 1 }[event.key];
    if (step) {
      event.preventDefault();
      show(index + step);
    } else if (event.key === "Home") {
      show(0);
    } else if (event.key === "End") {
      show(n - 1);
    }
  });
  // "#frame=N" (1-based) opens at step N, for a link to one step; otherwise the first.
  const asked = /^#frame=(\d+)$/.exec(location.hash);
  show(asked ? Number(asked[1]) - 1 : 0);
}

function main() {
  const pool = $("pool");
  pool.addEventListener("mouseover", onPoolOver);
  pool.addEventListener("mousemove", onPoolMove);
  pool.addEventListener("mouseleave", hideTooltip);
  const requests = $("requests");
  requests.addEventListener("mouseover", onRequestsOver);
  requests.addEventListener("mouseleave", onLeave);
  const events = $("events");
  events.addEventListener("mouseover", onEventsOver);
  events.addEventListener("mouseleave", onLeave);
  // The arrows are drawn in window coordinates: redrawn when anything scrolls or the window resizes.
  window.addEventListener("scroll", () => state.hover && drawArrows(), true);
  window.addEventListener("resize", () => {
    sizePool();
    if (state.hover) drawArrows();
  });
  setupCharts();

  const embedded = $("frames");
  if (embedded) startReplay(embedded);
  else startLive();
}

main();
