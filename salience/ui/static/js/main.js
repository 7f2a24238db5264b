// The page: connection indicator, auth token, the chat and completion views, the settings both
// share (sampling, readouts, steering, monitors), live concepts, and the completion panes.

import { ChatView } from "./chat.js";
import { ConceptForm } from "./concepts.js";
import { LmtpClient } from "./lmtp.js";
import { MonitorControls } from "./monitors.js";
import { Pane } from "./pane.js";
import { SteeringControls } from "./steering.js";
import { Vocab } from "./vocab.js";

const TOKEN_KEY = "salience-token";
const FEATURES_K = 8; // top SAE features per token, in each token's tooltip
const VIEWS = ["chat", "completion"];
const $ = (selector) => document.querySelector(selector);

// A token passed as ?token= (a link from whoever runs the server) moves into sessionStorage
// and out of the address bar.
const given = new URL(location.href);
if (given.searchParams.has("token")) {
  sessionStorage.setItem(TOKEN_KEY, given.searchParams.get("token"));
  given.searchParams.delete("token");
  history.replaceState(null, "", given);
}

/** The LMTP WebSocket is `/` on the server that served this page; browsers pass the token in the URL. */
function socketUrl() {
  const url = new URL("/", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) url.searchParams.set("token", token);
  return url.href;
}

const client = new LmtpClient(socketUrl);
const vocab = new Vocab(client);
const steering = new SteeringControls($("#steering"));
const monitors = new MonitorControls($("#monitors"));
const concepts = new ConceptForm($("#concepts"), client, showModel);
const chat = new ChatView({ section: $("#chat"), client, vocab, tip: $("#tip"), settings });
$("#steer-reset").addEventListener("click", () => steering.reset());
const LABELS = {
  connecting: "connecting…",
  loading: "loading model…",
  ready: "ready",
  draining: "server draining: finishing running requests",
  stopping: "server shutting down",
  lost: "connection lost",
  unauthorized: "unauthorized",
};

client.addEventListener("state", ({ detail: { state, detail } }) => {
  const indicator = $("#connection");
  indicator.dataset.state = state;
  indicator.textContent = LABELS[state] + (detail ? ` — ${detail}` : "");
  const ready = state === "ready";
  for (const button of document.querySelectorAll("#request button")) button.disabled = !ready;
  chat.enable(ready);
  concepts.enable(ready);
  if (ready) showModel(client.modelInfo);
  if (state === "unauthorized") $("#auth").open = true;
});

/**
 * Everything built from MODEL_INFO: at every ready, and after a live concept is defined or deleted.
 * New panes read `client.modelInfo` when they start (their heatmap's concepts and calibration);
 * running ones keep the manifest they started with.
 */
function showModel(info) {
  const sae = info.saes?.[0];
  const features = sae ? ` · features: SAE ${sae.name}, layer ${sae.layer}` : "";
  const limits = `context ${info.max_model_len} · top-k ≤ ${info.max_logprobs}`;
  $("#model").textContent = `${info.model} · ${limits}${features}`;
  $("#readouts").disabled = !info.readout_manifest;
  $("#readouts").checked &&= Boolean(info.readout_manifest);
  steering.show(info.steering);
  monitors.show(info.readout_manifest);
  concepts.show(info.readout_manifest);
  const chatTab = $("#tab-chat");
  chatTab.disabled = !info.chat_template;
  chatTab.title = info.chat_template ? "" : "the model has no chat template (salience serve --chat-template FILE)";
  if (view === "chat" && !info.chat_template) setView("completion", false);
}

// The page opens in chat (the default model is an instruct model: a first question gets an
// answer), or in the view the address names (…/ui/#completion), and in completion on a model
// without a chat template. max_tokens is kept per view: a reply needs room a continuation does
// not (as the REPL's chat and raw modes).
const maxTokens = { chat: "256", completion: $("#max_tokens").value };
let view = null;

function setView(name, remember = true) {
  if (name === view) return;
  if (view) maxTokens[view] = $("#max_tokens").value;
  view = name;
  $("#max_tokens").value = maxTokens[name];
  for (const tab of document.querySelectorAll("[role=tab]")) {
    const selected = tab.dataset.view === name;
    tab.setAttribute("aria-selected", String(selected));
    tab.tabIndex = selected ? 0 : -1;
  }
  $("#chat").hidden = name !== "chat";
  $("#request").hidden = $("#panes").hidden = name !== "completion";
  if (remember) history.replaceState(null, "", `#${name}`);
}

const named = () => VIEWS.find((name) => location.hash === `#${name}`);
setView(named() ?? "chat", false);
addEventListener("hashchange", () => {
  const name = named();
  if (name && !$(`#tab-${name}`).disabled) setView(name, false);
});
const tabs = [...document.querySelectorAll("[role=tab]")];
for (const tab of tabs) tab.addEventListener("click", () => setView(tab.dataset.view));
$(".views").addEventListener("keydown", (event) => {
  const step = { ArrowLeft: -1, ArrowRight: 1 }[event.key];
  const enabled = tabs.filter((tab) => !tab.disabled);
  const at = enabled.indexOf(document.activeElement);
  if (!step || at < 0) return;
  const next = enabled[(at + step + enabled.length) % enabled.length];
  setView(next.dataset.view);
  next.focus();
});

$("#token").value = sessionStorage.getItem(TOKEN_KEY) ?? "";
$("#auth-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("#token").value);
  client.connect();
});

/** Sampling fields as typed: an empty field is left out (the server's default); the server validates. */
function params() {
  const params = {};
  for (const name of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
    const value = $(`#${name}`).value.trim();
    if (value !== "") params[name] = Number(value);
  }
  return params;
}

/** The first SAE's top features for every token (null without one): shown in each token's tooltip. */
function features(info) {
  const sae = info.saes?.[0];
  return sae ? { sae, k: Math.min(FEATURES_K, sae.top) } : null;
}

/** What both views send with a request: sampling, alternatives, readouts, steering, monitors. */
function settings() {
  return {
    params: params(),
    topLogprobs: Number($("#top_logprobs").value),
    manifest: $("#readouts").checked ? client.modelInfo.readout_manifest : null,
    steer: steering.interventions(),
    monitors: monitors.monitors(),
  };
}

function start(mode) {
  const request = { mode, text: $("#prompt").value, ...settings(), features: features(client.modelInfo) };
  if (mode === "score") request.monitors = [];
  const pane = new Pane({ client, vocab, tip: $("#tip"), request });
  $("#panes").prepend(pane.element);
  pane.run();
}

$("#request").addEventListener("submit", (event) => {
  event.preventDefault();
  start(event.submitter?.value ?? "generate");
});
$("#prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && client.state === "ready") {
    event.preventDefault();
    start("generate");
  }
});

client.connect();
