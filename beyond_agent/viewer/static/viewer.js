// The run viewer's page: plain JS over the JSON API of app.py; plotly.js draws the curves.
// Routes live in the URL hash: #/dashboard, #/episodes?step=N&kind=train&..., #/episode?step=N&kind=K&line=L[&compare=M], #/config.
"use strict";

const POLL_MS = 5000;       // a run in progress: the dashboard and the step list are read again this often
const PAGE_SIZE = 50;
const FILTERS = ["env", "task", "agent_task", "termination", "success", "min_reward", "max_reward"];
let pollTimer = null;
let lastRoute = "";

async function api(path) {
  const response = await fetch(path);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${path}: HTTP ${response.status}`);
  return body;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function setStatus(text, isError = false) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

function parseRoute() {
  const hash = location.hash.replace(/^#\/?/, "") || "dashboard";
  const [name, query] = hash.split("?");
  return {name, params: new URLSearchParams(query || "")};
}

function go(name, params) {
  location.hash = `#/${name}` + (params && [...params].length ? `?${params}` : "");
}

// ---------------------------------------------------------------- dashboard
// Plotly renders a subset of HTML in titles and legend names (<a href>, <b>, ...): a metric key or task name
// is the run's data, shown as text, never as markup.
function plotText(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function traces(panel, series) {
  return panel.lines.filter(line => series[line.key]).map(line => {
    const points = series[line.key];
    const trace = {name: plotText(line.label), x: points.map(p => p[0]), y: points.map(p => p[1]), meta: line.key};
    if (line.points) return {...trace, type: "scatter", mode: "markers", marker: {symbol: "diamond", size: 9}};
    return {...trace, type: panel.stacked ? "bar" : "scatter", mode: "lines+markers"};
  });
}

function layout(title, unit, stacked, lastStep, yRange = null) {
  // Whole steps only, and at most ~8 labels on the axis, so they never overlap (plotly alone adds 1.5, 2.5, ...).
  const dtick = lastStep !== null && lastStep > 0 ? Math.max(1, Math.ceil(lastStep / 8)) : undefined;
  return {title: {text: plotText(title), font: {size: 14}}, margin: {l: 60, r: 10, t: 36, b: 40},
          xaxis: {title: {text: "step"}, dtick, tickformat: "d"},
          yaxis: {title: {text: plotText(unit), font: {size: 11}}, range: yRange || undefined},
          barmode: stacked ? "stack" : undefined,
          // Below the plot, in rows: a long legend never squeezes the plot into a strip.
          legend: {font: {size: 10}, orientation: "h", yanchor: "top", y: -0.3, x: 0}};
}

async function drawDashboard() {
  const {panels, keys} = await api("/api/panels");
  const wanted = [...new Set(panels.flatMap(p => p.lines.map(line => line.key)))];
  const {series, last_step} = await api("/api/metrics?keys=" + encodeURIComponent(wanted.join(",")));
  document.getElementById("dashboard-empty").hidden = keys.length > 0;
  const holder = document.getElementById("panels");
  for (const panel of panels) {
    let div = document.getElementById(`panel-${panel.id}`);
    if (!div) {
      div = el("div", {id: `panel-${panel.id}`, class: "panel", "data-panel": panel.id});
      holder.append(div);
    }
    await Plotly.react(div, traces(panel, series), layout(panel.title, panel.unit, panel.stacked, last_step, panel.y_range),
                       {responsive: true});
    div.dataset.drawn = String(last_step ?? "");
  }
  fillAnyMetric(keys);
  setStatus(last_step === null ? "no steps logged yet" : `last logged step ${last_step}`);
}

function fillAnyMetric(keys) {
  const select = document.getElementById("any-metric");
  if (select.options.length === keys.length + 1) return;
  const chosen = select.value;
  select.replaceChildren(el("option", {value: "", text: `(${keys.length} metrics)`}),
                         ...keys.map(key => el("option", {value: key, text: key})));
  select.value = chosen;
}

async function drawAnyMetric() {
  const key = document.getElementById("any-metric").value;
  const div = document.getElementById("panel-any");
  if (!key) { Plotly.purge(div); return; }
  const {series} = await api("/api/metrics?keys=" + encodeURIComponent(key));
  const points = series[key] || [];
  await Plotly.react(div, [{name: plotText(key), x: points.map(p => p[0]), y: points.map(p => p[1]), mode: "lines+markers"}],
                     layout(key, "", false, points.length ? points[points.length - 1][0] : null), {responsive: true});
}

// ---------------------------------------------------------------- episode list
async function showEpisodes(params) {
  const {steps} = await api("/api/steps");
  const stepSelect = document.getElementById("step-select");
  stepSelect.replaceChildren(...steps.map(s => el("option", {value: `${s.kind}:${s.step}`,
    text: `${s.kind === "val" ? "validation" : "training"} step ${s.step}`})));
  const info = document.getElementById("episodes-info");
  const body = document.querySelector("#episode-table tbody");
  if (!steps.length) {
    info.textContent = "No trajectory dumps yet (beyond_agent.trajectories.every writes them).";
    body.replaceChildren();
    return;
  }
  const last = steps.filter(s => s.kind === "train").pop() || steps[steps.length - 1];
  const step = params.get("step") || String(last.step);
  const kind = params.get("kind") || last.kind;
  stepSelect.value = `${kind}:${step}`;
  const query = new URLSearchParams({step, kind, offset: params.get("offset") || "0", limit: String(PAGE_SIZE)});
  for (const name of FILTERS) if (params.get(name)) query.set(name, params.get(name));
  const page = await api(`/api/episodes?${query}`);
  for (const name of ["env", "task", "agent_task", "termination"]) {
    const select = document.getElementById(`filter-${name}`);
    select.replaceChildren(el("option", {value: "", text: "any"}),
                           ...page.facets[name].map(v => el("option", {value: v, text: v})));
    select.value = params.get(name) || "";
  }
  for (const name of ["success", "min_reward", "max_reward"]) document.getElementById(`filter-${name}`).value = params.get(name) || "";
  info.textContent = `${page.matched} of ${page.total} episodes of this step match`;
  body.replaceChildren(...page.items.map(item => episodeRow(item, step, kind)));
  document.getElementById("page-info").textContent =
    page.matched ? `${page.offset + 1}–${Math.min(page.offset + page.limit, page.matched)} of ${page.matched}` : "";
  pager("page-prev", params, page.offset > 0 ? Math.max(page.offset - page.limit, 0) : null);
  pager("page-next", params, page.offset + page.limit < page.matched ? page.offset + page.limit : null);
  updateCompareButton();
}

function episodeRow(item, step, kind) {
  const link = el("a", {href: `#/episode?${new URLSearchParams({step, kind, line: item.line})}`, text: String(item.line)});
  const tick = el("input", {type: "checkbox", class: "pick", "data-line": item.line});
  tick.addEventListener("change", updateCompareButton);
  const row = el("tr", {class: `episode-row ${item.success ? "ok" : "fail"}`, "data-line": item.line,
                        "data-termination": item.termination},
    el("td", {}, tick), el("td", {}, link), el("td", {text: item.env}), el("td", {text: String(item.task)}),
    el("td", {text: item.agent_task}), el("td", {text: item.group}),
    el("td", {class: "success", text: item.success ? "yes" : "no"}), el("td", {text: item.reward.toFixed(3)}),
    el("td", {text: item.rounds}), el("td", {class: "termination", text: item.termination}),
    el("td", {text: `${item.response_tokens} (${item.trained_tokens})`}), el("td", {class: "error", text: item.error || ""}));
  return row;
}

function pager(id, params, offset) {
  const button = document.getElementById(id);
  button.disabled = offset === null;
  button.onclick = () => { const next = new URLSearchParams(params); next.set("offset", offset); go("episodes", next); };
}

function updateCompareButton() {
  const ticked = [...document.querySelectorAll("#episode-table input.pick:checked")];
  const button = document.getElementById("compare-selected");
  button.disabled = ticked.length !== 2;
  button.onclick = () => {
    const [kind, step] = document.getElementById("step-select").value.split(":");
    go("episode", new URLSearchParams({step, kind, line: ticked[0].dataset.line, compare: ticked[1].dataset.line}));
  };
}

function applyFilters(event) {
  event.preventDefault();
  const [kind, step] = document.getElementById("step-select").value.split(":");
  const params = new URLSearchParams({step, kind});
  for (const name of FILTERS) {
    const value = document.getElementById(`filter-${name}`).value.trim();
    if (value) params.set(name, value);
  }
  go("episodes", params);
}

// ---------------------------------------------------------------- one episode
async function showEpisode(params) {
  const step = params.get("step"), kind = params.get("kind") || "train";
  const lines = [params.get("line"), params.get("compare")].filter(Boolean);
  const panes = document.getElementById("episode-panes");
  panes.replaceChildren();
  document.getElementById("back-to-list").href = `#/episodes?${new URLSearchParams({step, kind})}`;
  for (const line of lines) {
    const episode = await api(`/api/episode?${new URLSearchParams({step, kind, line})}`);
    panes.append(episodePane(episode, step, kind, lines));
  }
}

function episodePane(episode, step, kind, shownLines) {
  const pane = el("div", {class: "episode-pane", "data-line": episode.line});
  pane.append(el("h3", {text: `${kind === "val" ? "Validation" : "Training"} step ${step}, line ${episode.line}`}));
  const facts = el("dl", {class: "facts"});
  const fact = (name, value) => facts.append(el("dt", {text: name}), el("dd", {text: String(value)}));
  fact("env / task", `${episode.env} / ${episode.task} (${episode.split}, seed ${episode.seed})`);
  fact("agent task", episode.agent_task);
  fact("group", episode.group);
  fact("success", episode.success ? "yes" : "no");
  fact("reward / score", `${episode.reward} / ${episode.score}`);
  fact("rounds", episode.rounds);
  fact("termination", episode.termination);
  if (episode.error) fact("error", episode.error);
  fact("time (env / llm / wall)", `${episode.env_time_s} / ${episode.llm_time_s} / ${episode.wall_time_s} s`);
  if (episode.policy_version !== null) fact("policy version", episode.policy_version);
  if (episode.sampling_seed != null) fact("sampling seed", episode.sampling_seed);  // null or absent: the server's
  const extra = episode.extra || {};
  if (extra.agent_mode) {  // played by a user's agent behind the gateway (docs/gateway.md)
    fact("agent's samples", extra.agent_mode === "merged" ? "merged: all its calls in this one sample"
      : `per call: it rewrote its history; this is its last call's sample (${extra.earlier_segments} earlier, each trained as a sample of its own)`);
  }
  if (extra.seat != null) {  // one seat of a game of several (docs/self_play.md)
    fact("seat", `${extra.seat}, against ${extra.opponent === "self" ? "the policy itself" : extra.opponent}`);
  }
  pane.append(facts);
  pane.append(groupLinks(episode, step, kind, shownLines));
  if (extra.seat != null) pane.append(gameLinks(episode, step, kind, shownLines));
  pane.append(el("h4", {text: "Turns"}), turns(episode));
  pane.append(el("h4", {text: "Tokens"}), tokenLegend(episode), tokens(episode));
  return pane;
}

function gameLinks(episode, step, kind, shownLines) {
  return compareLinks(episode.game_lines || [], episode, step, kind, shownLines,
                      {holder: "game-links", link: "seat-link", lead: "The game's other seats: ",
                       none: "No other seat of this game was dumped."});
}

function groupLinks(episode, step, kind, shownLines) {
  return compareLinks(episode.group_lines, episode, step, kind, shownLines,
                      {holder: "group-links", link: "compare-link", lead: "Same group: ",
                       none: "No other episode of this group was dumped."});
}

// Links that open each of `lines` (but the episode's own) side by side with the episodes shown.
function compareLinks(lines, episode, step, kind, shownLines, names) {
  const others = lines.filter(line => String(line) !== String(episode.line));
  const holder = el("p", {class: names.holder, text: others.length ? names.lead : names.none});
  for (const line of others) {
    const params = new URLSearchParams({step, kind, line: shownLines[0], compare: line});
    holder.append(el("a", {href: `#/episode?${params}`, class: names.link, "data-line": line,
                            text: `line ${line} side by side`}), " ");
  }
  return holder;
}

function turns(episode) {
  const holder = el("div", {class: "turns"});
  let assistantTurn = 0;
  for (const message of episode.messages) {
    const role = message.role || "?";
    let label = role;
    if (role === "assistant") {
      const reward = episode.step_rewards[assistantTurn];
      label = `assistant, turn ${assistantTurn + 1}` + (reward !== undefined ? ` (step reward ${reward})` : "");
      assistantTurn += 1;
    }
    const content = typeof message.content === "string" ? message.content : JSON.stringify(message.content);
    holder.append(el("div", {class: `message ${role}`}, el("div", {class: "role", text: label}), content));
  }
  return holder;
}

function tokenLegend(episode) {
  const legend = el("p", {class: "token-legend"},
    el("span", {class: "tok trained", text: "trained (mask 1)"}), el("span", {class: "tok context", text: "context (mask 0)"}),
    el("span", {class: "tok prompt", text: "prompt"}), "hover a token for its id and log-prob ");
  const toggle = el("input", {type: "checkbox", class: "show-ids"});
  toggle.addEventListener("change", () => showIds(legend.closest(".episode-pane"), toggle.checked));
  legend.append(el("label", {}, toggle, " show token ids"));
  if (episode.tokenizer_problem) legend.append(el("div", {class: "error", text: episode.tokenizer_problem}));
  return legend;
}

function showIds(pane, ids) {
  for (const span of pane.querySelectorAll(".tokens .tok")) span.textContent = ids ? `${span.dataset.id} ` : span.dataset.text;
}

function tokenText(token) {
  if (token.text === null) return `[${token.id}]`;
  return token.text.replace(/\n/g, "↵\n");
}

function tokens(episode) {
  const holder = el("div", {class: "tokens"});
  for (const token of episode.tokens.prompt) {
    holder.append(el("span", {class: "tok prompt", title: `prompt · id ${token.id}`, "data-id": token.id,
                               "data-text": tokenText(token), text: tokenText(token)}));
  }
  const ends = new Map(episode.turn_ends.map((end, turn) => [end, turn]));
  episode.tokens.response.forEach((token, position) => {
    const trained = token.mask === 1;
    const logprob = token.logprob === null ? "" : ` · logprob ${token.logprob.toFixed(4)}`;
    holder.append(el("span", {class: `tok ${trained ? "trained" : "context"}`, "data-pos": position,
                               "data-mask": token.mask, "data-id": token.id, "data-text": tokenText(token),
                               title: `position ${position} · id ${token.id} · mask ${token.mask}${logprob}`,
                               text: tokenText(token)}));
    if (ends.has(position)) {
      const turn = ends.get(position);
      holder.append(el("span", {class: "turn-end", text: `end of turn ${turn + 1} · step reward ${episode.step_rewards[turn]}`}));
    }
  });
  holder.style.whiteSpace = "pre-wrap";
  return holder;
}

// ---------------------------------------------------------------- config
async function showConfig() {
  const run = await api("/api/run");
  const versions = document.getElementById("versions");
  versions.replaceChildren(...Object.entries(run.versions).map(([name, value]) =>
    el("tr", {}, el("th", {text: name}), el("td", {text: value}))));
  document.getElementById("training-config").textContent = run.training_config || "(no .hydra/config.yaml found)";
  document.getElementById("training-config-file").textContent = run.training_config_file || "";
  document.getElementById("launcher-config").textContent = run.launcher_config || "(not started by the launcher)";
  document.getElementById("command").textContent = run.command || "";
}

// ---------------------------------------------------------------- integrity banner
async function showIntegrity() {
  // A monitor that fired (beyond_agent/integrity.py) stays on the page, whatever view is open: the run's signal
  // may be broken from that step on. Text only: the names come from the run's files.
  const {alarms, setting} = await api("/api/integrity");
  const banner = document.getElementById("integrity-banner");
  banner.textContent = alarms.map(a => `Integrity monitor ${a.monitor} fired at step${a.steps.length > 1 ? "s" : ""} ` +
    a.steps.join(", ")).join("; ") + (alarms.length ? ` (read those steps' trajectories; ${setting} in the config, docs/hacks.md)` : "");
  banner.hidden = alarms.length === 0;
  banner.dataset.monitors = alarms.map(a => a.monitor).join(",");
}

// ---------------------------------------------------------------- routing
const VIEWS = {dashboard: drawDashboard, episodes: showEpisodes, episode: showEpisode, config: showConfig};

async function route() {
  const {name, params} = parseRoute();
  const view = VIEWS[name] ? name : "dashboard";
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${view}`;
  for (const link of document.querySelectorAll("header nav a")) link.classList.toggle("active", link.id === `nav-${view === "episode" ? "episodes" : view}`);
  lastRoute = location.hash;
  clearTimeout(pollTimer);
  try {
    await showIntegrity();
    await VIEWS[view](params);
    document.body.dataset.loaded = location.hash || "#/dashboard";
  } catch (error) {
    setStatus(error.message, true);
    document.body.dataset.loaded = "error";
  }
  if (view === "dashboard") pollTimer = setTimeout(() => { if (location.hash === lastRoute) route(); }, POLL_MS);
}

async function start() {
  document.getElementById("episode-filters").addEventListener("submit", applyFilters);
  document.getElementById("step-select").addEventListener("change", applyFilters);
  document.getElementById("any-metric").addEventListener("change", drawAnyMetric);
  window.addEventListener("hashchange", route);
  try {
    const run = await api("/api/run");
    document.getElementById("run-name").textContent = run.name;
    document.title = `${run.name} · BeyondAgent`;
  } catch (error) { setStatus(error.message, true); }
  await route();
}

start();
