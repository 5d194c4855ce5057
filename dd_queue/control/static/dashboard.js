// dd_queue dashboard: one EventSource ("snapshot" events from /api/events), Plotly charts,
// fault buttons that POST /api/faults with the admin token. No build step, no CDN.
"use strict";

const FAULTS = ["kill", "stall", "slow", "drop", "delay", "corrupt", "disconnect"];
const TIMED = new Set(["stall", "slow", "drop", "delay", "disconnect"]);
const CHAOS = { action: "start", duration_s: 600, rates_per_min: { stall: 2, slow: 1, drop: 1 },
  fault_duration_s: 5, by: "dashboard" };
const LAYOUT = { margin: { l: 40, r: 10, t: 10, b: 30 }, paper_bgcolor: "#171e26",
  plot_bgcolor: "#171e26", font: { color: "#d8dee6", size: 11 }, showlegend: true,
  legend: { orientation: "h", y: 1.15 } };
const CONFIG = { displayModeBar: false, responsive: true };
const $ = (id) => document.getElementById(id);
const rows = new Map();
let chaosActive = false;
// The chaos toggle the user just set, until a snapshot agrees with it: a snapshot taken before
// the POST landed must not flip the box back. {want, until}; until is Infinity while in flight.
let chaosIntent = null;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (cls) node.className = cls;
  return node;
}
const num = (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toPrecision(d));
const when = (s) => new Date(s * 1000).toLocaleTimeString();
const token = () => $("token").value.trim();

async function post(path, body) {
  const headers = { "Content-Type": "application/json" };
  if (token()) headers.Authorization = "Bearer " + token();
  const res = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) {
    const detail = typeof data.detail === "string" ? data.detail : JSON.stringify(data.detail);
    throw new Error(res.status + ": " + detail);
  }
  return data;
}

function say(text, bad) {
  const msg = $("action-msg");
  msg.textContent = text;
  msg.style.color = bad ? "#f85149" : "";
}

async function inject(learner, kind) {
  const body = { target: learner, kind, by: "dashboard" };
  if (TIMED.has(kind)) body.duration_s = Number($("fault-duration").value) || 5;
  if (kind === "slow") body.factor = 3;
  if (kind === "delay") body.delay_s = 2;
  try {
    const fault = await post("/api/faults", body);
    say(`${kind} sent to ${learner} (${fault.fault_id})`);
  } catch (err) { say(`${kind} ${learner} refused: ${err.message}`, true); }
}

function row(id) {
  if (rows.has(id)) return rows.get(id);
  const tr = el("tr");
  tr.dataset.learner = id;
  tr.id = "learner-" + id;  // the alerts' links (#learner-L1)
  const cells = {};
  for (const name of ["id", "state", "reason", "age", "step", "tokens", "steptime",
    "contrib", "weight", "versions", "where", "inject"]) {
    cells[name] = el("td", undefined, name);
    tr.appendChild(cells[name]);
  }
  cells.id.textContent = id;
  cells.state.appendChild(el("span", "", "state"));
  for (const kind of FAULTS) {
    const b = el("button", kind);
    b.dataset.fault = kind;
    b.title = `inject ${kind} into ${id}`;
    b.addEventListener("click", () => inject(id, kind));
    cells.inject.appendChild(b);
  }
  $("learners").tBodies[0].appendChild(tr);
  const entry = { tr, cells };
  rows.set(id, entry);
  return entry;
}

function renderLearners(learners) {
  for (const l of learners) {
    const { tr, cells } = row(l.learner_id);
    tr.dataset.state = l.state;
    const badge = cells.state.firstChild;
    badge.textContent = l.state;
    badge.className = "state state-" + l.state;
    cells.reason.textContent = l.reason;
    cells.age.textContent = l.heartbeat_age_s === null ? "gone" : num(l.heartbeat_age_s, 2) + " s";
    cells.step.textContent = l.step;
    cells.tokens.textContent = l.n_tokens;
    cells.steptime.textContent = l.step_time_s === null ? "–" : num(l.step_time_s, 2) + " s";
    const c = l.contributions;
    cells.contrib.textContent = `${c.sent} / ${c.merged} / ${c.dropped} / ${c.dead_lettered}`;
    cells.weight.textContent = Object.entries(l.last_weights).map(([p, w]) => `f${p}:${num(w, 2)}`).join(" ");
    cells.versions.textContent = Object.values(l.versions).join(" ");
    cells.where.textContent = `${l.host}:${l.pid}` + (l.restarts ? ` (${l.restarts} restarts)` : "");
  }
}

function renderSummary(s) {
  const q = s.quorum, frags = s.fragments;
  const grace = frags.length ? Math.max(...frags.map((f) => f.grace_window_s)) : null;
  const cards = [["goodput", num(s.goodput.goodput)], ["uptime", num(s.goodput.uptime)],
    ["merged-token share", num(s.merged_token_share)],
    ["rounds merged", s.rounds_merged], ["abandoned", s.rounds_abandoned],
    ["live / expected", `${q.live_learners} / ${q.expected_learners}`], ["quorum K", q.quorum],
    ["ξ step", num(q.step_time_s, 2) + " s"], ["grace window", num(grace, 2) + " s"],
    ["bytes in / out", `${(s.bytes_in / 1e6).toFixed(1)} / ${(s.bytes_out / 1e6).toFixed(1)} MB`]];
  $("summary").replaceChildren(...cards.map(([k, v]) => {
    const card = el("div", k, "card");
    card.prepend(el("b", String(v)));
    return card;
  }));
  $("run").textContent = `run ${s.run_id} · config ${s.config_digest}`;
  chaosActive = s.chaos.active;
  if (chaosIntent && (chaosIntent.want === chaosActive || Date.now() > chaosIntent.until)) chaosIntent = null;
  $("chaos").checked = chaosIntent ? chaosIntent.want : chaosActive;
  $("chaos-status").textContent = s.chaos.schedule
    ? `${s.chaos.active ? "running" : "last"} ${s.chaos.schedule.schedule_id}: ${s.chaos.fired}/${s.chaos.schedule.planned} fired` : "";
}

function renderCharts(snap) {
  if (!window.Plotly) return;
  const s = snap.state;
  const f = s.fragments;
  Plotly.react("heat", [{ type: "heatmap", z: [f.map((x) => x.version)], x: f.map((x) => "f" + x.fragment_id),
    y: ["version"], text: [f.map((x) => String(x.version))], texttemplate: "%{text}", colorscale: "Viridis",
    showscale: false }], { ...LAYOUT, showlegend: false, margin: { l: 60, r: 10, t: 5, b: 25 } }, CONFIG);
  const ev = s.eval;
  Plotly.react("eval", [{ x: ev.map((p) => new Date(p.at_s * 1000)), y: ev.map((p) => p.loss),
    mode: "lines+markers", name: "held-out loss" }], { ...LAYOUT, annotations: ev.length ? [] : [{
    text: "no evaluation yet (run ddq evaluator)", showarrow: false, xref: "paper", yref: "paper",
    x: 0.5, y: 0.5 }] }, CONFIG);
  const curves = Object.entries(snap.train_loss);
  Plotly.react("train", curves.map(([id, pts]) => ({ x: pts.map((p) => p[1]), y: pts.map((p) => p[2]),
    mode: "lines", name: id })), { ...LAYOUT, xaxis: { title: { text: "inner step" } },
    annotations: curves.length ? [] : [{ text: "no train loss yet (learners report it in heartbeats)",
      showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }] }, CONFIG);
  const h = s.goodput.history;
  const t = h.map((p) => new Date(p[0] * 1000));
  Plotly.react("goodput", [{ x: t, y: h.map((p) => p[1]), name: "goodput", mode: "lines" },
    { x: t, y: h.map((p) => p[2]), name: "uptime", mode: "lines" }],
  { ...LAYOUT, yaxis: { range: [0, 1.05] } }, CONFIG);
  const r = snap.rounds.filter((x) => x.quorum_at_s !== null || x.decision === "abandon");
  const bar = (name, color, pick) => {
    const rs = r.filter(pick.filter);
    return { type: "bar", orientation: "h", name, marker: { color },
      y: rs.map((x) => "f" + x.fragment_id), base: rs.map((x) => new Date(pick.from(x) * 1000)),
      x: rs.map((x) => Math.max(1, (pick.to(x) - pick.from(x)) * 1000)),
      hovertext: rs.map((x) => `round ${x.round_id}: ${x.reason}`) };
  };
  Plotly.react("timeline", [
    bar("to quorum", "#388bfd", { filter: (x) => x.quorum_at_s !== null, from: (x) => x.opened_at_s, to: (x) => x.quorum_at_s }),
    bar("grace + merge", "#2ea043", { filter: (x) => x.decision === "merge" && x.quorum_at_s !== null, from: (x) => x.quorum_at_s, to: (x) => x.closed_at_s }),
    bar("abandoned", "#f85149", { filter: (x) => x.decision === "abandon", from: (x) => x.opened_at_s, to: (x) => x.closed_at_s }),
  ], { ...LAYOUT, barmode: "overlay", xaxis: { type: "date" } }, CONFIG);
}

// The exporter cannot report itself down: the page raises DDQExporterDown (deploy/alerts.yml:
// critical after 1 minute) while its live connection is lost.
let lostSince = null;
let lastAlerts = [];

function renderAlerts(alerts) {
  lastAlerts = alerts;
  const shown = [...alerts];
  if (lostSince !== null) {
    const firing = Date.now() - lostSince >= 60000;
    shown.unshift({ name: "DDQExporterDown", severity: "critical", state: firing ? "firing" : "pending",
      since_s: lostSince / 1000, subject: "control plane", link: "#alerts-panel",
      summary: "the control plane does not answer" });
  }
  const firing = shown.filter((a) => a.state === "firing").length;
  $("alerts-count").textContent = `${firing} firing, ${shown.length - firing} pending`;
  if (!shown.length) {
    list("alerts", [null], (li) => { li.className = "none"; li.textContent = "no alert: every rule of deploy/alerts.yml holds"; });
    return;
  }
  list("alerts", shown, (li, a) => {
    li.className = `${a.state} ${a.severity}`;
    li.dataset.alert = a.name;
    const link = el("a", a.subject);
    link.href = a.link;
    li.append(el("span", when(a.since_s), "when"), el("b", `${a.name} `),
      el("span", `${a.state} · ${a.severity} · `, "muted"), link, el("span", ": " + a.summary));
  });
}

const FATES = ["merged", "late", "superseded", "stale", "duplicate", "invalid", "dropped",
  "dead_lettered", "dropped_at_learner", "unsent", "in_flight"];

function renderTokens(tokens) {
  const shown = FATES.filter((f) => tokens.some((t) => t.fates[f]));
  const head = $("tokens").tHead.rows[0];
  head.replaceChildren(el("th", "learner"), el("th", "computed"),
    ...shown.map((f) => el("th", f.replace(/_/g, " "))), el("th", "balance"));
  const count = (x) => Math.round(x).toLocaleString();
  $("tokens").tBodies[0].replaceChildren(...tokens.map((t) => {
    const tr = el("tr");
    tr.dataset.learner = t.learner_id;
    tr.append(el("td", t.learner_id), el("td", count(t.computed)));
    for (const f of shown) {
      const share = t.computed ? ` (${(100 * (t.fates[f] || 0) / t.computed).toFixed(0)}%)` : "";
      const td = el("td", count(t.fates[f] || 0) + share);
      td.dataset.fate = f;
      tr.append(td);
    }
    const ok = el("td", (t.balanced ? "✓ " : "✗ ") + t.reason, t.balanced ? "ok" : "bad");
    ok.dataset.fate = "balance";
    tr.append(ok);
    return tr;
  }));
  const bad = tokens.filter((t) => !t.balanced).length;
  $("tokens-summary").textContent = !tokens.length ? "no tokens reported yet"
    : bad ? `${bad} of ${tokens.length} learners do not balance`
      : `every learner balances: computed = the sum of its fates`;
}

function renderFragments(fragments) {
  list("fragment-list", fragments, (li, f) => {
    li.id = "fragment-" + f.fragment_id;  // the alerts' links (#fragment-2)
    li.append(el("b", `f${f.fragment_id} v${f.version}`), el("span", " " + (f.last_reason || "")));
  });
}

function list(id, items, render) {
  $(id).replaceChildren(...items.map((item) => {
    const li = el("li");
    render(li, item);
    return li;
  }));
}

function renderLogs(snap) {
  list("decisions", snap.state.last_decisions, (li, d) => {
    li.append(el("span", when(d.closed_at_s), "when"),
      el("span", `f${d.fragment_id} r${d.round_id} ${d.decision}: ${d.reason}`, "decision-" + d.decision));
  });
  list("faults", snap.faults, (li, f) => {
    li.dataset.fault = f.fault_id;
    li.append(el("span", when(f.issued_at_s), "when"),
      el("span", `${f.kind} ${f.target} by ${f.by} — ${f.status}`, "status-" + f.status.replace(" ", "-")));
    for (const e of f.effects) li.append(el("div", "↳ " + e.note, "muted"));
  });
  list("events", snap.events, (li, e) => {
    li.append(el("span", when(e.at_s), "when"), el("b", e.kind + " "), el("span", e.message));
  });
}

function render(snap) {
  renderLearners(snap.learners);
  renderSummary(snap.state);
  renderLogs(snap);
  renderAlerts(snap.alerts);
  renderTokens(snap.tokens);
  renderFragments(snap.state.fragments);
  renderCharts(snap);
  const ready = snap.state.synchronizers.some((x) => x.heartbeat_age_s < 10);
  $("ready").textContent = ready ? "synchronizer up" : "no synchronizer";
  $("ready").className = "pill " + (ready ? "ok" : "bad");
}

function connect() {
  const source = new EventSource("/api/events");
  source.addEventListener("snapshot", (e) => {
    lostSince = null;
    $("conn").textContent = "live";
    $("conn").className = "pill ok";
    render(JSON.parse(e.data));
  });
  source.addEventListener("problem", (e) => {
    $("conn").textContent = e.data;
    $("conn").className = "pill bad";
  });
  source.onerror = () => {
    $("conn").textContent = "reconnecting…";
    $("conn").className = "pill bad";
    if (lostSince === null) lostSince = Date.now();
    renderAlerts(lastAlerts);
  };
  setInterval(() => { if (lostSince !== null) renderAlerts(lastAlerts); }, 5000);
}

function setup() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) {
    sessionStorage.setItem("ddq-token", fromHash);
    history.replaceState(null, "", location.pathname);
  }
  $("token").value = sessionStorage.getItem("ddq-token") || "";
  $("token").addEventListener("change", () => sessionStorage.setItem("ddq-token", token()));
  $("chaos").addEventListener("change", async (e) => {
    const on = e.target.checked;
    // A snapshot that already agrees may clear chaosIntent while the POST is in flight: keep
    // our own handle on this intent, and touch the shared one only while it is still ours.
    const intent = { want: on, until: Infinity };
    chaosIntent = intent;
    try {
      await post("/api/chaos", on ? CHAOS : { action: "stop", by: "dashboard" });
    } catch (err) {
      if (chaosIntent === intent) chaosIntent = null;
      e.target.checked = chaosActive;
      say("chaos refused: " + err.message, true);
      return;
    }
    intent.until = Date.now() + 5000;
    say(on ? "chaos started" : "chaos stopped");
  });
  connect();
}

document.addEventListener("DOMContentLoaded", setup);
