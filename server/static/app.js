// nodraft playground: plain JS, no build step, no network beyond this server.
"use strict";

const POLL_MS = 3000;           // how often /metrics is read
const WINDOW_MS = 5 * 60 * 1000; // the server panel's sliding window

const $ = (sel, root = document) => root.querySelector(sel);
let methods = {};  // method -> {param: default}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("#api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text) { $("#status").textContent = text; }

// -- pickers ---------------------------------------------------------------------------------
async function loadModels() {
  const res = await fetch("/v1/models", { headers: headers(false) });
  if (!res.ok) { setStatus("could not list models: HTTP " + res.status); return; }
  const body = await res.json();
  const modelSel = $("#model");
  modelSel.innerHTML = "";
  for (const m of body.data) modelSel.add(new Option(m.id, m.id));
  methods = (body.data[0] && body.data[0].speculation_methods) || {};
  for (const pane of ["a", "b"]) {
    const sel = $("#method-" + pane);
    sel.innerHTML = "";
    for (const name of Object.keys(methods)) {
      if (methods[name] && methods[name].error) continue;  // a broken plugin
      sel.add(new Option(name, name));
    }
    sel.value = pane === "a" ? pick(["prompt_lookup", "ngram"]) : pick(["none"]);
    sel.addEventListener("change", () => renderParams(pane));
    renderParams(pane);
  }
}

function pick(prefs) {
  for (const p of prefs) if (p in methods) return p;
  return Object.keys(methods)[0] || "";
}

function renderParams(pane) {
  const method = $("#method-" + pane).value;
  const box = $("#drafter-" + pane + " .params");
  box.innerHTML = "";
  const params = methods[method] || {};
  for (const [name, def] of Object.entries(params)) {
    const id = `param-${pane}-${name}`;
    const field = document.createElement("div");
    field.className = "field";
    const label = document.createElement("label");
    label.htmlFor = id;
    label.textContent = name.replace(/_/g, " ");
    const input = document.createElement("input");
    input.id = id;
    input.dataset.param = name;
    if (typeof def === "boolean") {
      input.type = "checkbox"; input.checked = def; input.dataset.kind = "bool";
      field.classList.add("check");
      field.append(input, label);
    } else {
      if (typeof def === "number") {
        input.type = "number"; input.step = Number.isInteger(def) ? "1" : "any";
        input.dataset.kind = "number";
      } else {
        input.type = "text"; input.dataset.kind = def === null ? "json-or-null" : "string";
        if (def === null) input.placeholder = "default";
      }
      input.value = def === null ? "" : (typeof def === "object" ? JSON.stringify(def) : def);
      field.append(label, input);
    }
    box.append(field);
  }
  if (!Object.keys(params).length) {
    const p = document.createElement("p");
    p.className = "noparams"; p.textContent = "no parameters";
    box.append(p);
  }
}

function speculationFor(pane) {
  const spec = { method: $("#method-" + pane).value };
  const defaults = methods[spec.method] || {};
  for (const input of $("#drafter-" + pane).querySelectorAll("[data-param]")) {
    const name = input.dataset.param, kind = input.dataset.kind;
    let value;
    if (kind === "bool") value = input.checked;
    else if (kind === "number") { if (input.value === "") continue; value = Number(input.value); }
    else if (kind === "json-or-null") {
      if (input.value.trim() === "") continue;
      try { value = JSON.parse(input.value); } catch { value = input.value; }
    } else value = input.value;
    if (JSON.stringify(value) !== JSON.stringify(defaults[name])) spec[name] = value;
  }
  return spec;
}

// -- one streamed completion into one pane --------------------------------------------------
function fmt(x, digits) { return x === null || x === undefined ? null : Number(x).toFixed(digits); }

function setFig(pane, name, text, value) {
  const dd = $(`#pane-${pane} [data-fig="${name}"]`);
  dd.textContent = text;
  if (value === undefined || value === null) dd.removeAttribute("data-value");
  else dd.dataset.value = String(value);
}

function resetPane(pane, prompt, method) {
  const root = $("#pane-" + pane);
  $(".pane-method", root).textContent = method;
  root.removeAttribute("data-done");
  root.removeAttribute("data-speculation");
  const out = $(".completion", root);
  out.innerHTML = "";
  const p = document.createElement("span");
  p.className = "prompt"; p.textContent = prompt;
  out.append(p);
  for (const dd of root.querySelectorAll(".fig")) { dd.textContent = "…"; dd.removeAttribute("data-value"); }
}

function addTokens(out, nodraft) {
  const toks = nodraft.tokens || [], rejected = nodraft.rejected || [];
  toks.forEach((t, i) => {
    const span = document.createElement("span");
    span.className = "tok " + (t.origin === "accepted" ? "accepted" : "bonus");
    span.textContent = t.text;
    span.dataset.origin = t.origin;
    let title = t.origin === "accepted" ? "accepted draft token" : "bonus token (the target's own)";
    // The rejected draft is what the last token of this step (the bonus token) replaced.
    if (i === toks.length - 1 && rejected.length) {
      span.classList.add("had-rejection");
      span.dataset.rejected = rejected.map((r) => r.text).join("");
      title += "\nrejected draft: " + JSON.stringify(span.dataset.rejected) +
               " (" + rejected.length + " token" + (rejected.length > 1 ? "s" : "") + ")";
    }
    span.title = title + "\ntoken id " + t.id + ": " + JSON.stringify(t.text);
    out.append(span);
  });
  return toks.length;
}

async function runPane(pane, body) {
  const root = $("#pane-" + pane);
  const out = $(".completion", root);
  const t0 = performance.now();
  let n = 0, spec = null;
  const res = await fetch("/v1/completions", {
    method: "POST", headers: headers(true), body: JSON.stringify(body),
  });
  if (!res.ok) {
    let msg = "HTTP " + res.status;
    try { msg += ": " + (await res.json()).error.message; } catch { /* not JSON */ }
    throw new Error(msg);
  }
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  const handle = (event) => {
    for (const line of event.split("\n")) {
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "generation failed");
      if (chunk.nodraft) n += addTokens(out, chunk.nodraft);
      if (chunk.speculation) spec = chunk.speculation;
    }
    const secs = (performance.now() - t0) / 1000;
    if (n && secs > 0) setFig(pane, "tokens_per_second", (n / secs).toFixed(1), n / secs);
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      handle(event);
    }
  }
  const secs = (performance.now() - t0) / 1000;
  setFig(pane, "tokens_per_second", (n / secs).toFixed(1), n / secs);
  if (spec) showSpeculation(pane, spec);
  root.dataset.done = "true";
}

function showSpeculation(pane, s) {
  $("#pane-" + pane).dataset.speculation = JSON.stringify(s);
  if (s.acceptance_rate === null || s.acceptance_rate === undefined) {
    setFig(pane, "acceptance_rate", "n/a (nothing drafted)", null);
  } else {
    setFig(pane, "acceptance_rate", fmt(100 * s.acceptance_rate, 1) + " %", s.acceptance_rate);
  }
  const tpp = fmt(s.tokens_per_pass, 2);
  setFig(pane, "tokens_per_pass", tpp === null ? "n/a" : tpp, s.tokens_per_pass);
  setFig(pane, "drafted_accepted", `${s.drafted} / ${s.accepted}`, null);
  setFig(pane, "target_passes", String(s.target_passes), s.target_passes);
  const est = fmt(s.estimated_speedup, 2);
  setFig(pane, "estimated_speedup", est === null ? "n/a" : est + "×", s.estimated_speedup);
  const measured = fmt(s.measured_cost_speedup, 2);
  setFig(pane, "measured_cost_speedup", measured === null ? "n/a" : measured + "×",
    s.measured_cost_speedup);
}

async function run(event) {
  event.preventDefault();
  const button = $("#run");
  button.disabled = true;
  const sideBySide = $("#side-by-side").checked;
  const panes = sideBySide ? ["a", "b"] : ["a"];
  const prompt = $("#prompt").value;
  const base = {
    model: $("#model").value, prompt, stream: true,
    max_tokens: Number($("#max-tokens").value) || 16,
    temperature: Number($("#temperature").value) || 0,
  };
  setStatus("running…");
  const t0 = performance.now();
  const results = await Promise.allSettled(panes.map((pane) => {
    const spec = speculationFor(pane);
    resetPane(pane, prompt, spec.method);
    return runPane(pane, { ...base, speculation: spec });  // concurrent streams
  }));
  const errors = results.map((r, i) => r.status === "rejected" ? `${panes[i].toUpperCase()}: ${r.reason.message}` : null)
    .filter(Boolean);
  setStatus(errors.length ? "error — " + errors.join("; ")
    : `done in ${((performance.now() - t0) / 1000).toFixed(2)} s`);
  button.disabled = false;
  pollMetrics();
}

function toggleSideBySide() {
  const on = $("#side-by-side").checked;
  $("#drafter-b").hidden = !on;
  $("#pane-b").hidden = !on;
  $("#panes").classList.toggle("two", on);
}

// -- server panel: acceptance by method over a sliding window of /metrics samples -----------
const samples = [];  // {t, counters: Map("model\tmethod" -> {drafted, accepted})}

function parseMetrics(text) {
  const counters = new Map();
  const re = /^(nodraft_spec_(?:draft|accepted)_tokens_total)\{([^}]*)\}\s+(\S+)/;
  for (const line of text.split("\n")) {
    const m = re.exec(line);
    if (!m) continue;
    const labels = {};
    for (const lm of m[2].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[lm[1]] = lm[2];
    const key = (labels.model || "") + "\t" + (labels.method || "");
    const c = counters.get(key) || { drafted: 0, accepted: 0 };
    if (m[1].includes("_draft_")) c.drafted += Number(m[3]); else c.accepted += Number(m[3]);
    counters.set(key, c);
  }
  return counters;
}

async function pollMetrics() {
  let text;
  try {
    const res = await fetch("/metrics");
    if (!res.ok) return;
    text = await res.text();
  } catch { return; }
  const now = Date.now();
  samples.push({ t: now, counters: parseMetrics(text) });
  // keep the newest sample at or before the window's start, and everything after it
  while (samples.length > 2 && samples[1].t <= now - WINDOW_MS) samples.shift();
  renderServer();
}

function renderServer() {
  const tbody = $("#server-table tbody");
  const first = samples[0], last = samples[samples.length - 1];
  const rows = [];
  for (const [key, c] of last.counters) {
    const before = first.counters.get(key) || { drafted: 0, accepted: 0 };
    const reset = c.drafted < before.drafted || c.accepted < before.accepted;
    const drafted = reset ? c.drafted : c.drafted - before.drafted;
    const accepted = reset ? c.accepted : c.accepted - before.accepted;
    const [model, method] = key.split("\t");
    if (drafted > 0 || accepted > 0) rows.push({ model, method, drafted, accepted });
  }
  tbody.innerHTML = "";
  if (!rows.length) {
    tbody.innerHTML = '<tr class="empty"><td colspan="5">no draft tokens in the window yet</td></tr>';
    return;
  }
  rows.sort((x, y) => (x.model + x.method).localeCompare(y.model + y.method));
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.method = r.method;
    const rate = r.drafted ? r.accepted / r.drafted : null;
    for (const v of [r.model, r.method, r.drafted, r.accepted]) {
      const td = document.createElement("td"); td.textContent = v; tr.append(td);
    }
    const td = document.createElement("td");
    if (rate === null) td.textContent = "n/a (nothing drafted)";
    else {
      const meter = document.createElement("meter");
      meter.min = 0; meter.max = 1; meter.value = rate;
      meter.setAttribute("aria-label", `acceptance rate of ${r.method}`);
      td.append(meter, document.createTextNode(" " + (100 * rate).toFixed(1) + " %"));
      td.dataset.value = String(rate);
    }
    tr.append(td);
    tbody.append(tr);
  }
}

// -- start --------------------------------------------------------------------------------------
$("#window-min").textContent = String(WINDOW_MS / 60000);
$("#controls").addEventListener("submit", run);
$("#side-by-side").addEventListener("change", toggleSideBySide);
$("#api-key").addEventListener("change", () => loadModels().catch((e) => setStatus(e.message)));
toggleSideBySide();
loadModels().then(() => document.body.dataset.ready = "true",
                  (e) => setStatus("could not list models: " + e.message));
pollMetrics();
setInterval(pollMetrics, POLL_MS);
