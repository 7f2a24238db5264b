// One generation (or one scored text) in its own pane: its tokens, its readouts, its errors.
//
// The LMTP exchange of a generation with readouts:
//   TOKENIZE {"text": prompt}                       -> MSG {"tokens": [...]}
//   GENERATE {"prompt": tokens, "text": true, "top_logprobs": k, "readout": [[0, end]], ...}
//     -> TOKEN {"prompt": true, "position", "readout"}  one per prompt position, first
//     -> TOKEN {"token", "text", "logprob", "top_logprobs", "position", "readout"}  per token
//   CANCEL {"stream_id"} (Stop)                     -> last TOKEN has finish_reason "cancelled"
// With steering sliders set, GENERATE and SCORE also carry "steer": [{"direction", "layers", ...}];
// with monitors, GENERATE carries "monitors" and a token where one fires has "monitors" events.
// Where the server serves SAEs, GENERATE and SCORE carry "features": {"sae", "k", "ranges"} over every
// position, and each TOKEN (prompt ones too) has "position" and "features": [[id, activation], ...];
// the prompt then shows as token cells too, so every token's tooltip lists its features.
// (The last generated token's readout comes too: the server reads it out with one short pass.)
// Score mode reads a text the user wrote: SCORE its first token as prompt and the rest as
// `scored`, which gives every token a logprob, alternatives and a readout.

import { Heatmap } from "./heatmap.js";
import { describe } from "./steering.js";
import { TokenStrip } from "./tokens.js";

let panes = 0;

const count = (n) => `${n} token${n === 1 ? "" : "s"}`;

export class Pane {
  #client;
  #vocab;
  #request;
  #strip;
  #heatmap = null;
  #streamId = null;
  #prompt = [];

  /**
   * @param request {{mode: "generate" | "score", text: string, params: object, topLogprobs: number,
   *                  manifest: object | null, steer: object[], monitors: object[],
   *                  features: {sae: object, k: number} | null}} manifest null: no readouts; steer:
   *                  interventions; monitors: watched on every generated token; features: the SAE
   *                  (MODEL_INFO's saes entry) and how many of its features each token's tooltip lists
   */
  constructor({ client, vocab, tip, request }) {
    this.#client = client;
    this.#vocab = vocab;
    this.#request = request;
    const n = ++panes;
    this.element = document.createElement("article");
    this.element.className = "pane";
    this.element.setAttribute("aria-labelledby", `pane-${n}`);
    this.element.innerHTML = `
      <header>
        <h2 id="pane-${n}">#${n} ${request.mode}</h2>
        <span class="state" role="status"></span>
        <button type="button" class="stop" disabled>Stop</button>
        <button type="button" class="close" aria-label="close pane #${n}">×</button>
      </header>
      <p class="steered" hidden></p>
      <p class="error" role="alert" hidden></p>
      <div class="stream"></div>
      <ul class="monitor-events" aria-label="monitor events" hidden></ul>
      <details class="protocol"><summary>LMTP messages sent</summary><pre></pre></details>`;
    if (request.steer.length) {
      const steered = this.element.querySelector(".steered");
      steered.hidden = false;
      steered.textContent = `steered: ${describe(request.steer)}`;
    }
    this.#strip = new TokenStrip(this.element.querySelector(".stream"), vocab, tip, request.features?.sae);
    if (request.manifest) {
      this.#heatmap = new Heatmap(request.manifest);
      this.element.querySelector(".stream").after(this.#heatmap.element);
    }
    this.element.querySelector(".stop").addEventListener("click", () => this.stop());
    this.element.querySelector(".close").addEventListener("click", () => {
      this.stop();
      this.element.remove();
    });
  }

  async run() {
    this.#state("tokenizing");
    try {
      this.#prompt = (await this.#ask("TOKENIZE", { text: this.#request.text })).tokens;
      if (this.#prompt.length === 0) throw new Error("the prompt is empty");
      if (this.#heatmap) this.#labelPrompt();
      if (this.#request.mode === "generate") await this.#generate();
      else await this.#score();
    } catch (error) {
      this.#fail(error.message);
    }
  }

  stop() {
    if (this.#streamId !== null) this.#client.cancel(this.#streamId);
  }

  async #generate() {
    const { params, topLogprobs, text } = this.#request;
    const body = { prompt: this.#prompt, ...params, top_logprobs: topLogprobs, text: true };
    const end = this.#prompt.length + (params.max_tokens ?? 16);
    if (this.#heatmap) body.readout = [[0, end]];
    if (this.#request.steer.length) body.steer = this.#request.steer;
    if (this.#request.monitors.length) body.monitors = this.#request.monitors;
    this.#askFeatures(body, end);
    if (body.features) {
      // The prompt's tokens get cells of their own, so their features have a tooltip too.
      const texts = await this.#vocab.texts(this.#prompt);
      texts.forEach((label, position) => {
        this.#strip.add({ token: this.#prompt[position], text: label, position, prompt: true });
      });
    } else {
      this.#strip.addContext(text);
    }
    this.#start("GENERATE", body);
  }

  /** Ask for the SAE's top features at positions 0..end (where the page shows them). */
  #askFeatures(body, end) {
    const features = this.#request.features;
    if (features) body.features = { sae: features.sae.name, k: features.k, ranges: [[0, end]] };
  }

  async #score() {
    const [first] = await this.#vocab.texts(this.#prompt.slice(0, 1));
    this.#strip.add({ token: this.#prompt[0], text: first, logprob: null, position: 0 });
    const body = { prompt: this.#prompt.slice(0, 1), scored: this.#prompt.slice(1), top_logprobs: this.#request.topLogprobs };
    if (this.#heatmap) body.readout = [[0, this.#prompt.length]];
    if (this.#request.steer.length) body.steer = this.#request.steer;
    this.#askFeatures(body, this.#prompt.length);
    this.#start("SCORE", { ...body, text: true });
  }

  #start(type, body, onEnd = () => {}) {
    this.#log(type, body);
    this.#streamId = this.#client.stream(type, body, (payload) => {
      if (this.#receive(payload)) {
        this.#streamId = null;
        this.element.querySelector(".stop").disabled = true;
        onEnd();
      }
    });
    this.element.querySelector(".stop").disabled = type !== "GENERATE";
    this.#state("streaming");
  }

  /** Handle one TOKEN payload; true when it ends the stream. */
  #receive(payload) {
    if (payload.error != null) {
      this.#fail(payload.error);
      return false;
    }
    if (payload.prompt) {
      this.#heatmap?.set(payload.position, { prompt: true, readout: payload.readout });
      if (payload.features) this.#strip.setFeatures(payload.position, payload.features);
      return false;
    }
    if (payload.token != null) {
      const { token, text, logprob, top_logprobs: alternatives, position, features } = payload;
      this.#strip.add({ token, text, logprob, alternatives, position, features });
      this.#heatmap?.set(payload.position, { label: text, readout: payload.readout, monitors: payload.monitors });
      if (payload.monitors) this.#monitored(payload.monitors);
      this.#state(`streaming · ${count(this.#strip.length)}`);
    }
    if (payload.finish_reason == null) return false;
    const reason = payload.finish_reason === "cancelled" ? "stopped" : `done (${payload.finish_reason})`;
    this.#state(`${reason} · ${count(this.#strip.length)}`);
    return true;
  }

  /** A line per monitor event under the tokens (the heatmap marks the token's column too). */
  #monitored(events) {
    const list = this.element.querySelector(".monitor-events");
    list.hidden = false;
    for (const m of events) {
      const item = document.createElement("li");
      item.dataset.action = m.action;
      item.textContent = `${m.action}: ${m.concept} p = ${m.probability.toFixed(3)} at position ${m.position} (layer ${m.layer})`;
      list.append(item);
    }
  }

  async #labelPrompt() {
    const texts = await this.#vocab.texts(this.#prompt).catch(() => []);
    texts.forEach((label, position) => this.#heatmap.set(position, { label, prompt: true }));
  }

  #ask(type, body) {
    this.#log(type, body);
    return this.#client.request(type, body);
  }

  #log(type, body) {
    this.element.querySelector(".protocol pre").textContent += `${type} ${JSON.stringify(body)}\n`;
  }

  #state(text) {
    this.element.querySelector(".state").textContent = text;
  }

  #fail(message) {
    this.#streamId = null;
    this.element.querySelector(".stop").disabled = true;
    const error = this.element.querySelector(".error");
    error.hidden = false;
    error.textContent = message;
    this.#state("error");
  }
}
