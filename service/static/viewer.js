// The dataset viewer's one script (service/viewer.py serves it and documents the routes).
// Every text from user data goes into the page with textContent or an attribute, never as HTML.
// With --read-auth the token typed into the login form stays in this tab's sessionStorage and is
// sent as an Authorization header; it never goes into a URL.
"use strict";

const TOKEN_KEY = "shard-service-token";
const POLL_BUILDING_MS = 2000, POLL_IDLE_MS = 10000, FRAME_MS = 250;
// One shell for every page: "/" is the catalog, "/sets/REF" a set, "/sets/REF/clips" its clips.
const PARTS = location.pathname.split("/").filter(Boolean);  // [], ["sets", REF] or ["sets", REF, "clips"]
const KIND = PARTS.length === 0 ? "catalog" : PARTS.length === 2 ? "set" : "clips";

class NeedToken extends Error {}

function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? {Authorization: "Bearer " + token} : {};
}

async function api(path) {
  const r = await fetch(path, {headers: headers()});
  if (r.status === 401 || r.status === 403) throw new NeedToken(r.status === 403 ? "wrong token" : "");
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

// el("td", {class: "num"}, "text", child, ...): an element; strings become text nodes.
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

const $ = (id) => document.getElementById(id);
const fill = (node, ...children) => node.replaceChildren(...children);
const bytes = (n) => n >= 1e9 ? (n / 1e9).toFixed(2) + " GB" : n >= 1e6 ? (n / 1e6).toFixed(1) + " MB"
  : (n / 1e3).toFixed(1) + " kB";
const count = (n) => Number(n).toLocaleString("en");
const plural = (n, word, words) => `${count(n)} ${n === 1 ? word : words || word + "s"}`;  // "1 clip", "2 clips"
const refFromPath = () => decodeURIComponent(PARTS[1] || "");

// Frames are fetched (with the token when there is one) and shown from blob: URLs, kept per page.
const frameURLs = new Map();
async function showFrame(img, url) {
  if (!frameURLs.has(url)) {
    frameURLs.set(url, fetch(url, {headers: headers()}).then((r) => {
      if (!r.ok) throw new Error(`frame ${url}: HTTP ${r.status}`);
      return r.blob();
    }).then((blob) => URL.createObjectURL(blob)));
  }
  img.dataset.frame = url;
  img.src = await frameURLs.get(url);
}
function forgetFrames() {
  for (const p of frameURLs.values()) p.then((u) => URL.revokeObjectURL(u), () => {});
  frameURLs.clear();
}

// --- the catalog ----------------------------------------------------------------------------
function progress(p) {
  const total = p.videos_total || 0;
  return el("span", {class: "progress"}, el("progress", {max: total || 1, value: p.videos_done || 0}),
    `${count(p.videos_done || 0)} / ${plural(total, "video")}, ${count(p.failed || 0)} failed, ` +
    `${plural(p.shards_written || 0, "shard")} written`);
}

// A set's state (shards.catalog.condition: the API's "state", with "problem" and "remedy" when
// it is not sound) is drawn as a badge: its word in its tone's colour (service.states' table,
// read from /v1/viewer at start; .tone-* in viewer.css), what it means as the tooltip.
let STATES = {};
const READABLE = ["ready", "damaged"];  // the sets the viewer browses: a damaged one too, in its own colour

function badge(state) {
  const shown = STATES[state] || {tone: "warn", meaning: "a state this page does not know"};
  return el("span", {class: `badge tone-${shown.tone}`, title: shown.meaning, "data-state": state}, state);
}

function stateCell(rec) {
  const cell = el("td", {class: "state"}, badge(rec.state));
  if (rec.state === "building") cell.append(el("br"), progress(rec.progress || {}));
  const why = rec.problem ? `${rec.problem}; ${rec.remedy}` : rec.state === "failed" ? rec.error : "";
  if (why) cell.append(el("span", {class: "why", title: why}, why));
  return cell;
}

function verifyText(v) {
  if (!v) return "never";  // in a narrow column a line break between the date and the time, never inside them
  const outcome = v.problems ? plural(v.problems, "problem") : "ok";
  const [date, time] = v.at.split(/(?=T)/);
  return el("span", {}, el("span", {class: "nowrap"}, date), el("wbr"), el("span", {class: "nowrap"}, `${time}:`),
    ` ${outcome}`);
}

async function catalogPage() {
  const {datasets} = await api("/v1/datasets");
  const rows = datasets.map((rec) => {
    const splits = Object.values(rec.splits || {});
    const clips = splits.reduce((a, s) => a + (s.clips || 0), 0);
    const size = splits.reduce((a, s) => a + (s.bytes || 0), 0);
    const ref = rec.name || rec.id;
    return el("tr", {"data-id": rec.id},
      el("td", {class: "nowrap"}, el("a", {href: "/sets/" + encodeURIComponent(ref)}, rec.name || "(unnamed)")),
      el("td", {class: "mono nowrap"}, rec.id.slice(0, 12)), stateCell(rec),
      el("td", {class: "num"}, READABLE.includes(rec.state) ? count(clips) : ""),
      el("td", {class: "num nowrap"}, READABLE.includes(rec.state) ? bytes(size) : ""),
      el("td", {}, rec.tags.join(", ")), el("td", {class: "nowrap"}, rec.created || ""),
      el("td", {class: "nowrap"}, rec.finished || ""),
      el("td", {class: rec.verified && rec.verified.problems ? "tone-bad" : ""}, verifyText(rec.verified)));
  });
  fill($("sets").tBodies[0], ...rows);
  $("empty").hidden = rows.length > 0;
  const building = datasets.some((r) => r.state === "building");
  setTimeout(() => run(catalogPage), building ? POLL_BUILDING_MS : POLL_IDLE_MS);
}

// --- a set ----------------------------------------------------------------------------------
// Clips per class as bars, most clips first, with a y axis (clips), an x axis (classes), the
// longest and shortest classes marked and named; any bar's name and count on hover, and every
// class in the table beside the chart (readable at 400 classes, where a bar is 2 pixels wide).
const CHART = {height: 180, left: 52, right: 12, top: 44, bottom: 34, plot: 640, widest: 40, least: 380};
const cut = (name, n = 48) => name.length <= n ? name : name.slice(0, n - 3) + "...";

// 0, step, 2 step, ... up to the first at or above ``most``: about four whole steps of 1, 2 or 5 x 10^k.
function ticks(most) {
  const rough = most / 4, power = 10 ** Math.floor(Math.log10(Math.max(1, rough)));
  const step = Math.max(1, [1, 2, 5, 10].map((m) => m * power).find((s) => s >= rough));
  return Array.from({length: Math.ceil(most / step) + 1}, (_, i) => i * step);
}

function text(x, y, words, attrs = {}) {
  const node = svg("text", {x, y, ...attrs});
  node.textContent = words;
  return node;
}

function histogram(counts, classes) {
  const order = counts.map((n, c) => [n, c]).sort((a, b) => b[0] - a[0] || a[1] - b[1]);
  const {height, left, right, top: above, bottom, plot} = CHART;
  const bar = Math.min(CHART.widest, plot / Math.max(1, order.length)), span = left + bar * order.length;
  const width = Math.max(CHART.least, Math.ceil(span) + right), full = above + height + bottom;
  const axis = ticks(Math.max(1, order[0]?.[0] || 1)), top = axis[axis.length - 1];
  const y = (n) => above + height - height * n / top;
  const [most, least] = [order[0] || [0, 0], order[order.length - 1] || [0, 0]];
  const marked = most[0] !== least[0];  // the longest and shortest classes, when they differ
  const mark = (i) => !marked ? "" : i === 0 ? "longest" : i === order.length - 1 ? "shortest" : "";
  const chart = svg("svg", {width, height: full, viewBox: `0 0 ${width} ${full}`, role: "img",
    "aria-label": `clips per class, ${plural(order.length, "class", "classes")}`});
  for (const n of axis) {
    chart.append(svg("line", {x1: left, x2: span, y1: y(n), y2: y(n), class: "grid"}),
      text(left - 6, y(n) + 4, count(n), {class: "tick", "text-anchor": "end"}));
  }
  chart.append(svg("line", {x1: left, x2: span, y1: y(0), y2: y(0), class: "axis"}),
    svg("line", {x1: left, x2: left, y1: above, y2: y(0), class: "axis"}),
    text(14, above + height / 2, "clips", {class: "axis-label", "text-anchor": "middle",
      transform: `rotate(-90 14 ${above + height / 2})`}),
    text(left + Math.max(span - left, 200) / 2, full - 8,
      `${plural(order.length, "class", "classes")}, most clips first`, {class: "axis-label", "text-anchor": "middle"}));
  const hover = $("hist-hover");
  order.forEach(([n, c], i) => {
    const rect = svg("rect", {x: (left + i * bar).toFixed(2), y: y(n), width: Math.max(1, bar - (bar > 3)).toFixed(2),
      height: y(0) - y(n), "data-class": c, class: mark(i)});
    const title = svg("title");
    title.textContent = `${classes[c]}: ${count(n)}`;
    rect.append(title);
    rect.onmouseenter = () => fill(hover, el("b", {}, classes[c]), `: ${plural(n, "clip")}`);
    chart.append(rect);
  });
  const notes = !order.length ? [] : !marked ? [[`every class: ${plural(most[0], "clip")}`, ""]]
    : [[`longest: ${cut(classes[most[1]])} (${count(most[0])})`, "longest"],
       [`shortest: ${cut(classes[least[1]])} (${count(least[0])})`, "shortest"]];
  notes.forEach(([words, cls], i) => chart.append(text(left, 16 + 16 * i, words, {class: `note ${cls}`})));
  const total = counts.reduce((a, b) => a + b, 0);
  const table = el("table", {class: "list", id: "hist-table"},
    el("thead", {}, el("tr", {}, ...["#", "class", "clips", "share"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...order.map(([n, c], i) => el("tr", {"data-class": c, class: mark(i)},
      el("td", {class: "num"}, i + 1), el("td", {}, classes[c]), el("td", {class: "num"}, count(n)),
      el("td", {class: "num"}, `${(100 * n / Math.max(1, total)).toFixed(1)}%`)))));
  return {chart, table, summary: `${plural(total, "clip")} in ${plural(order.length, "class", "classes")}`};
}

// Frame statistics in words: "8 frames per clip", "85x64 px: 32 frames".
function framesInWords(perClip) {
  const kinds = Object.entries(perClip);
  if (kinds.length === 1) return `${plural(Number(kinds[0][0]), "frame")} per clip`;
  return kinds.map(([t, n]) => `${plural(Number(t), "frame")} per clip: ${plural(n, "clip")}`).join("; ");
}
const sizesInWords = (sizes) => Object.entries(sizes).map(([s, n]) => `${s} px: ${plural(n, "frame")}`).join("; ");

async function setPage() {
  const ref = refFromPath();
  const data = await api(`/v1/viewer/${encodeURIComponent(ref)}`);
  const rec = data.record;
  document.title = `${rec.name || rec.id} - shard-service`;
  fill($("name"), rec.name || rec.id);
  fill($("crumbs"), " / ", rec.name || rec.id.slice(0, 12));
  $("clips-link").href = `/sets/${encodeURIComponent(ref)}/clips`;
  $("clips-link").hidden = !READABLE.includes(rec.state);
  const fields = [["id", rec.id], ["state", badge(rec.state)], ["why", rec.problem], ["remedy", rec.remedy],
    ["tags", rec.tags.join(", ")], ["source", rec.source], ["location", rec.location], ["created", rec.created],
    ["finished", rec.finished], ["attempts", rec.attempts], ["last verify", verifyText(rec.verified)],
    ["error", rec.error], ["classes", data.classes.length], ["frames per clip", data.frames_per_clip]];
  fill($("record"), ...fields.filter(([, v]) => v !== null && v !== undefined && v !== "").flatMap(([k, v]) =>
    [el("dt", {}, k), el("dd", {}, v)]));
  if (rec.state === "building") {
    $("record").append(el("dt", {}, "progress"), el("dd", {}, progress(rec.progress || {})));
    setTimeout(() => run(setPage), POLL_BUILDING_MS);
  }
  fill($("options"), JSON.stringify(rec.options, null, 2));
  const names = Object.keys(data.splits);
  fill($("splits").tBodies[0], ...names.map((s) => {
    const x = data.splits[s];
    return el("tr", {"data-split": s}, el("td", {}, s), el("td", {class: "num"}, count(x.clips)),
      el("td", {class: "num"}, bytes(x.bytes)), el("td", {class: "num"}, count(x.shards)),
      el("td", {class: "num"}, count(x.failed)));
  }));
  const select = $("hist-split");
  fill(select, ...names.map((s) => el("option", {value: s}, s)));
  const draw = () => {
    if (!select.value) return;
    const {chart, table, summary} = histogram(data.splits[select.value].histogram, data.classes);
    fill($("histogram"), chart);
    fill($("hist-classes"), table);
    fill($("hist-summary"), summary);
    fill($("hist-hover"), "point at a bar for its class");
  };
  select.onchange = draw;
  draw();
  const errors = data.errors || {total: 0, rows: []};
  const warned = errors.warnings || 0;
  const said = `${plural(errors.total - warned, "video")} could not be used` +
    (warned ? `, ${plural(warned, "warning")} (videos used with a caveat, or not found)` : "");
  fill($("errors-count"), errors.total === errors.rows.length ? said
    : `${said}; the first ${count(errors.rows.length)} are shown`);
  fill($("errors").tBodies[0], ...errors.rows.map((e) => el("tr", {}, el("td", {class: "mono"}, e.path),
    el("td", {}, e.split), el("td", {}, e.reason), el("td", {class: "mono"}, e.ffmpeg))));
  if (!READABLE.includes(rec.state)) return;
  const probe = await api(`/v1/viewer/${encodeURIComponent(ref)}/probe`);
  fill($("frames").tBodies[0], ...Object.entries(probe.splits).map(([s, p]) => el("tr", {},
    el("td", {}, s), el("td", {class: "num"}, count(p.probed_clips)), el("td", {}, framesInWords(p.frames_per_clip)),
    el("td", {}, sizesInWords(p.frame_sizes)),
    el("td", {class: "num"}, p.bytes_per_frame ? bytes(p.bytes_per_frame) : ""))));
}

// --- clips ----------------------------------------------------------------------------------
// A set with motion fields (ingest build --motion) shows, as the "show" toggle says, each clip's
// frames, its motion (each frame's field coloured as optical-flow figures are, by
// shards.format.motioncolour on the server: the colour wheel is /static/motion-legend.png), or both:
// each field under its frame in the strips, side by side in the clip's player.
const frameURL = (id, split, n, t) => `/v1/viewer/${id}/frames/${encodeURIComponent(split)}/${n}/${t}`;
const motionURL = (id, split, n, t) => `/v1/viewer/${id}/motion/${encodeURIComponent(split)}/${n}/${t}`;
const VIEWS = ["frames", "motion", "both"];
let player = null, view = "frames", shownClip = null;

// One cell per frame: its frame and/or its field, as the view says; the images' loads.
function cells(id, split, n, frames, kind) {
  const loads = [];
  const image = (url, alt, cls) => {
    const img = el("img", {alt, class: cls});
    loads.push(showFrame(img, url));
    return img;
  };
  const out = Array.from({length: frames}, (_, t) => el("span", {class: "cell"},
    ...(view !== "motion" || !kind ? [image(frameURL(id, split, n, t), `frame ${t}`, "frame")] : []),
    ...(view !== "frames" && kind ? [image(motionURL(id, split, n, t), `motion of frame ${t}`, "motion")] : [])));
  return {cells: out, loads};
}

function legend(kind, scale) {
  const shown = kind && view !== "frames";
  const box = el("p", {class: "legend", hidden: shown ? null : ""});
  if (shown) {
    box.append(el("img", {src: "/static/motion-legend.png", alt: "colour wheel: the colour of each direction"}),
      `motion (${kind}): direction as hue (right red, down yellow, left cyan, up blue), length as saturation` +
      (scale ? `, full colour at ${scale.toPrecision(2)} px/frame`
        : ", full colour at each clip's 99th-percentile length, longer darker") +
      "; black: motion not known (intra-coded frames and blocks)");
  }
  return box;
}

function setView(next) {
  view = VIEWS.includes(next) ? next : "frames";
  for (const id of ["view", "detail-view"]) $(id).value = view;
  const query = new URLSearchParams(location.search);
  if (view === "frames") query.delete("view"); else query.set("view", view);
  history.replaceState(null, "", `?${query}`);
}

async function openClip(id, split, n) {
  const d = await api(`/v1/viewer/${id}/clips/${encodeURIComponent(split)}/${n}`);
  shownClip = [id, split, n];
  const meta = d.meta || {};
  fill($("detail-title"), d.class ?? "(unlabeled)", " ", el("span", {class: "mono"}, d.key));
  const fields = [["key", d.key], ["label", d.class === null ? "(unlabeled)" : `${d.class} (${d.label})`],
    ["source video", meta.source], ["frame indices", (meta.frame_indices || []).join(", ")],
    ["shard", d.shard], ["byte offset", count(d.offset)], ["size", `${count(d.length)} bytes`],
    ["frames", `${d.frames} (${d.frame_bytes.map(count).join(", ")} bytes)`],
    ["motion", d.motion ? `${d.motion}, full colour at ${d.motion_scale.toPrecision(2)} px/frame` : undefined]];
  fill($("detail-fields"), ...fields.filter(([, v]) => v !== undefined).flatMap(([k, v]) => [el("dt", {}, k),
    el("dd", {}, v)]));
  $("detail-view-label").hidden = !d.motion;
  $("detail-view").onchange = () => { setView($("detail-view").value); run(() => openClip(id, split, n)); };
  fill($("detail-legend"), legend(d.motion, d.motion_scale));
  const shown = cells(id, split, n, d.frames, d.motion);
  fill($("detail-frames"), ...shown.cells);
  await Promise.all(shown.loads);
  const players = [...(view !== "motion" || !d.motion ? [[$("player"), frameURL]] : []),
    ...(view !== "frames" && d.motion ? [[$("player-motion"), motionURL]] : [])];
  $("player").hidden = !players.some(([p]) => p === $("player"));
  $("player-motion").hidden = !players.some(([p]) => p === $("player-motion"));
  let t = 0;
  const step = () => {
    for (const [img, url] of players) showFrame(img, url(id, split, n, t));
    t = (t + 1) % d.frames;
  };
  clearInterval(player);
  step();
  player = setInterval(step, FRAME_MS);
  fill($("play"), "pause");
  $("play").onclick = () => {
    if (player) { clearInterval(player); player = null; fill($("play"), "play"); }
    else { player = setInterval(step, FRAME_MS); fill($("play"), "pause"); }
  };
  $("detail").onclose = () => { clearInterval(player); player = null; shownClip = null; };
  if (!$("detail").open) $("detail").showModal();
}

async function clipsPage() {
  delete document.body.dataset.loaded;
  const ref = refFromPath();
  const query = new URLSearchParams(location.search);
  const ask = new URLSearchParams();
  for (const k of ["split", "class", "page", "per_page"]) if (query.get(k)) ask.set(k, query.get(k));
  const data = await api(`/v1/viewer/${encodeURIComponent(ref)}/clips?${ask}`);
  setView(data.motion ? query.get("view") : "frames");
  fill($("clips-name"), ref);
  fill($("crumbs"), " / ", el("a", {href: `/sets/${encodeURIComponent(ref)}`}, ref), " / clips");
  fill($("split"), ...data.splits.map((s) => el("option", {value: s}, s)));
  $("split").value = data.split;
  fill($("class"), el("option", {value: ""}, "all classes"),
    ...data.classes.map((c, i) => el("option", {value: String(i)}, c)));
  $("class").value = data.class === null ? "" : String(data.class);
  $("view-label").hidden = !data.motion;
  fill($("page"), `page ${data.pages ? data.page + 1 : 0} of ${data.pages} (${count(data.total)} clips)`);
  const go = (changes) => {
    const next = new URLSearchParams({split: $("split").value, class: $("class").value, page: data.page,
      view: view === "frames" ? "" : view, ...changes});
    if (data.per_page !== 48) next.set("per_page", data.per_page);
    for (const [k, v] of [...next]) if (v === "") next.delete(k);
    history.pushState(null, "", `?${next}`);
    run(clipsPage);
  };
  $("split").onchange = () => go({page: 0, class: ""});
  $("class").onchange = () => go({page: 0});
  $("view").onchange = () => go({view: $("view").value === "frames" ? "" : $("view").value});
  $("prev").disabled = data.page <= 0;
  $("next").disabled = data.page + 1 >= data.pages;
  $("prev").onclick = () => go({page: data.page - 1});
  $("next").onclick = () => go({page: data.page + 1});
  forgetFrames();
  fill($("clips-legend"), legend(data.motion, null));
  const loads = [];
  fill($("grid"), ...data.clips.map((c) => {
    const shown = cells(data.id, data.split, c.n, data.frames || 0, data.motion);
    loads.push(...shown.loads);
    const fig = el("figure", {class: "clip", "data-n": c.n, "data-label": c.label},
      el("figcaption", {}, el("div", {class: "class"}, c.class ?? "(unlabeled)"), el("div", {class: "key"}, c.key)),
      el("div", {class: `strip view-${view}`}, ...shown.cells));
    fig.onclick = () => run(() => openClip(data.id, data.split, c.n));
    return fig;
  }));
  await Promise.all(loads);
  document.body.dataset.loaded = "clips";
}

// --- start: the login form when the server wants a token and this tab has none ---------------
async function run(page) {
  try {
    await page();
  } catch (e) {
    if (e instanceof NeedToken) return login(e.message);
    $("status").hidden = false;
    fill($("status"), e.message);
  }
}

function login(problem) {
  sessionStorage.removeItem(TOKEN_KEY);
  $("main").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  fill($("login-error"), problem || "");
  $("token").focus();
}

const TITLES = {catalog: "Datasets", set: "Set", clips: "Clips"};

async function start() {
  const page = {catalog: catalogPage, set: setPage, clips: clipsPage}[KIND];
  document.title = `${TITLES[KIND]} - shard-service`;
  $("page-" + KIND).hidden = false;
  $("login").onsubmit = (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    $("login").hidden = true;
    start();
  };
  $("forget").onclick = () => { sessionStorage.removeItem(TOKEN_KEY); location.reload(); };
  window.onpopstate = () => run(page);
  const {read_auth: readAuth, states} = await (await fetch("/v1/viewer")).json();
  STATES = states;
  if (readAuth && !sessionStorage.getItem(TOKEN_KEY)) return login("");
  $("forget").hidden = !readAuth;
  $("main").hidden = false;
  await run(page);
  document.body.dataset.ready = "1";
}

document.addEventListener("DOMContentLoaded", start);
