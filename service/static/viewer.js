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
    `${count(p.videos_done || 0)} / ${count(total)} videos, ${count(p.failed || 0)} failed, ` +
    `${count(p.shards_written || 0)} shards written`);
}

// A set's state as the catalog's commands show it (shards.catalog.condition): ready, or why not.
const READABLE = ["ready", "damaged"];  // a damaged set is shown and browsed, in its own colour

function stateCell(rec) {
  const cell = el("td", {class: "state-" + rec.state}, rec.state);
  if (rec.state === "building") {
    cell.append(el("br"), progress(rec.progress || {}));
  } else if (rec.state === "failed" && rec.error) {
    cell.append(el("br"), el("span", {class: "mono"}, rec.error));
  } else if (rec.problem) {
    cell.append(el("br"), el("span", {class: "problem"}, `${rec.problem}; ${rec.remedy}`));
  }
  return cell;
}

function verifyText(v) {
  if (!v) return "never";
  return `${v.at}: ${v.problems ? v.problems + " problems" : "ok"}`;
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
      el("td", {}, verifyText(rec.verified)));
  });
  fill($("sets").tBodies[0], ...rows);
  $("empty").hidden = rows.length > 0;
  const building = datasets.some((r) => r.state === "building");
  setTimeout(() => run(catalogPage), building ? POLL_BUILDING_MS : POLL_IDLE_MS);
}

// --- a set ----------------------------------------------------------------------------------
function histogram(counts, classes) {
  const order = counts.map((n, c) => [n, c]).sort((a, b) => b[0] - a[0] || a[1] - b[1]);
  const bar = Math.min(24, 800 / Math.max(1, order.length)), width = Math.ceil(bar * order.length), height = 160;
  const top = Math.max(1, order[0]?.[0] || 1);
  const chart = svg("svg", {width, height: height + 2, viewBox: `0 0 ${width} ${height + 2}`, role: "img"});
  order.forEach(([n, c], i) => {
    const h = Math.round(height * n / top);
    const rect = svg("rect", {x: (i * bar).toFixed(2), y: height - h + 1, width: Math.max(1, bar - 1).toFixed(2),
      height: h, "data-class": c});
    const title = svg("title");
    title.textContent = `${classes[c]}: ${n}`;
    rect.append(title);
    chart.append(rect);
  });
  const most = order[0], least = order[order.length - 1];
  const extremes = order.length ? [`largest: `, el("b", {}, classes[most[1]]), ` (${count(most[0])}), smallest: `,
    el("b", {}, classes[least[1]]), ` (${count(least[0])}); ${order.length} classes`] : ["no classes"];
  return {chart, extremes};
}

async function setPage() {
  const ref = refFromPath();
  const data = await api(`/v1/viewer/${encodeURIComponent(ref)}`);
  const rec = data.record;
  document.title = `${rec.name || rec.id} - shard-service`;
  fill($("name"), rec.name || rec.id);
  fill($("crumbs"), " / ", rec.name || rec.id.slice(0, 12));
  $("clips-link").href = `/sets/${encodeURIComponent(ref)}/clips`;
  $("clips-link").hidden = !READABLE.includes(rec.state);
  const fields = [["id", rec.id], ["state", rec.state], ["why", rec.problem], ["remedy", rec.remedy],
    ["tags", rec.tags.join(", ")], ["source", rec.source],
    ["location", rec.location], ["created", rec.created], ["finished", rec.finished], ["attempts", rec.attempts],
    ["last verify", verifyText(rec.verified)], ["error", rec.error], ["classes", data.classes.length],
    ["frames per clip", data.frames_per_clip]];
  fill($("record"), ...fields.filter(([, v]) => v !== null && v !== undefined && v !== "").flatMap(([k, v]) =>
    [el("dt", {}, k), el("dd", k === "state" ? {class: "state-" + v} : {}, v)]));
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
    const {chart, extremes} = histogram(data.splits[select.value].histogram, data.classes);
    fill($("histogram"), chart);
    fill($("hist-extremes"), ...extremes);
  };
  select.onchange = draw;
  draw();
  const errors = data.errors || {total: 0, rows: []};
  fill($("errors-count"), errors.total === errors.rows.length ? `${count(errors.total)} videos could not be used`
    : `${count(errors.total)} videos could not be used; the first ${count(errors.rows.length)} are shown`);
  fill($("errors").tBodies[0], ...errors.rows.map((e) => el("tr", {}, el("td", {class: "mono"}, e.path),
    el("td", {}, e.split), el("td", {}, e.reason), el("td", {class: "mono"}, e.ffmpeg))));
  if (!READABLE.includes(rec.state)) return;
  const probe = await api(`/v1/viewer/${encodeURIComponent(ref)}/probe`);
  const list = (o) => Object.entries(o).map(([k, v]) => `${k}: ${count(v)}`).join(", ");
  fill($("frames").tBodies[0], ...Object.entries(probe.splits).map(([s, p]) => el("tr", {},
    el("td", {}, s), el("td", {class: "num"}, count(p.probed_clips)), el("td", {}, list(p.frames_per_clip)),
    el("td", {}, list(p.frame_sizes)), el("td", {class: "num"}, p.bytes_per_frame ? bytes(p.bytes_per_frame) : ""))));
}

// --- clips ----------------------------------------------------------------------------------
const frameURL = (id, split, n, t) => `/v1/viewer/${id}/frames/${encodeURIComponent(split)}/${n}/${t}`;
let player = null;

async function openClip(id, split, n) {
  const d = await api(`/v1/viewer/${id}/clips/${encodeURIComponent(split)}/${n}`);
  const meta = d.meta || {};
  fill($("detail-title"), d.class ?? "(unlabeled)", " ", el("span", {class: "mono"}, d.key));
  const fields = [["key", d.key], ["label", d.class === null ? "(unlabeled)" : `${d.class} (${d.label})`],
    ["source video", meta.source], ["frame indices", (meta.frame_indices || []).join(", ")],
    ["shard", d.shard], ["byte offset", count(d.offset)], ["size", `${count(d.length)} bytes`],
    ["frames", `${d.frames} (${d.frame_bytes.map(count).join(", ")} bytes)`]];
  fill($("detail-fields"), ...fields.filter(([, v]) => v !== undefined).flatMap(([k, v]) => [el("dt", {}, k),
    el("dd", {}, v)]));
  const urls = d.frame_bytes.map((_, t) => frameURL(id, split, n, t));
  const imgs = urls.map((u, t) => el("img", {alt: `frame ${t}`}));
  fill($("detail-frames"), ...imgs);
  await Promise.all(imgs.map((img, t) => showFrame(img, urls[t])));
  let t = 0;
  const step = () => { showFrame($("player"), urls[t]); t = (t + 1) % urls.length; };
  clearInterval(player);
  step();
  player = setInterval(step, FRAME_MS);
  fill($("play"), "pause");
  $("play").onclick = () => {
    if (player) { clearInterval(player); player = null; fill($("play"), "play"); }
    else { player = setInterval(step, FRAME_MS); fill($("play"), "pause"); }
  };
  $("detail").onclose = () => { clearInterval(player); player = null; };
  if (!$("detail").open) $("detail").showModal();
}

async function clipsPage() {
  delete document.body.dataset.loaded;
  const ref = refFromPath();
  const query = new URLSearchParams(location.search);
  const ask = new URLSearchParams();
  for (const k of ["split", "class", "page", "per_page"]) if (query.get(k)) ask.set(k, query.get(k));
  const data = await api(`/v1/viewer/${encodeURIComponent(ref)}/clips?${ask}`);
  fill($("clips-name"), ref);
  fill($("crumbs"), " / ", el("a", {href: `/sets/${encodeURIComponent(ref)}`}, ref), " / clips");
  fill($("split"), ...data.splits.map((s) => el("option", {value: s}, s)));
  $("split").value = data.split;
  fill($("class"), el("option", {value: ""}, "all classes"),
    ...data.classes.map((c, i) => el("option", {value: String(i)}, c)));
  $("class").value = data.class === null ? "" : String(data.class);
  fill($("page"), `page ${data.pages ? data.page + 1 : 0} of ${data.pages} (${count(data.total)} clips)`);
  const go = (changes) => {
    const next = new URLSearchParams({split: $("split").value, class: $("class").value, page: data.page, ...changes});
    if (data.per_page !== 48) next.set("per_page", data.per_page);
    for (const [k, v] of [...next]) if (v === "") next.delete(k);
    history.pushState(null, "", `?${next}`);
    run(clipsPage);
  };
  $("split").onchange = () => go({page: 0, class: ""});
  $("class").onchange = () => go({page: 0});
  $("prev").disabled = data.page <= 0;
  $("next").disabled = data.page + 1 >= data.pages;
  $("prev").onclick = () => go({page: data.page - 1});
  $("next").onclick = () => go({page: data.page + 1});
  forgetFrames();
  const loads = [];
  fill($("grid"), ...data.clips.map((c) => {
    const imgs = Array.from({length: data.frames || 0}, (_, t) => el("img", {alt: `frame ${t}`}));
    imgs.forEach((img, t) => loads.push(showFrame(img, frameURL(data.id, data.split, c.n, t))));
    const fig = el("figure", {class: "clip", "data-n": c.n, "data-label": c.label},
      el("figcaption", {}, el("div", {class: "class"}, c.class ?? "(unlabeled)"), el("div", {class: "key"}, c.key)),
      el("div", {class: "strip"}, ...imgs));
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
  const {read_auth: readAuth} = await (await fetch("/v1/viewer")).json();
  if (readAuth && !sessionStorage.getItem(TOKEN_KEY)) return login("");
  $("forget").hidden = !readAuth;
  $("main").hidden = false;
  await run(page);
  document.body.dataset.ready = "1";
}

document.addEventListener("DOMContentLoaded", start);
