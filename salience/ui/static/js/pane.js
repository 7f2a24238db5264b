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
import { StreamView } from "./stream.js";
import { TokenStrip } from "./tokens.js";

let panes = 0;

export class Pane {
  #vocab;
  #request;
  #strip;
  #stream;
  #heatmap = null;
  #prompt = [];

  /**
   * @param request {{mode: "generate" | "score", text: string, params: object, topLogprobs: number,
   *                  manifest: object | null, steer: object[], monitors: object[],
   *                  features: {sae: object, k: number} | null}} manifest null: no readouts; steer:
   *                  interventions; monitors: watched on every generated token; features: the SAE
   *                  (MODEL_INFO's saes entry) and how many of its features each token's tooltip lists
   */
  constructor({ client, vocab, tip, request }) {
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
    this.#strip = new TokenStrip(this.element.querySelector(".stream"), vocab, tip, request.features?.sae);
    if (request.manifest) {
      this.#heatmap = new Heatmap(request.manifest);
      this.element.querySelector(".stream").after(this.#heatmap.element);
    }
    this.#stream = new StreamView({ client, element: this.element, strip: this.#strip, heatmap: this.#heatmap });
    this.#stream.steered(request.steer);
    this.element.querySelector(".close").addEventListener("click", () => {
      this.#stream.stop();
      this.element.remove();
    });
  }

  async run() {
    this.#stream.state("tokenizing");
    try {
      this.#prompt = (await this.#stream.ask("TOKENIZE", { text: this.#request.text })).tokens;
      if (this.#prompt.length === 0) throw new Error("the prompt is empty");
      if (this.#heatmap) this.#labelPrompt();
      if (this.#request.mode === "generate") await this.#generate();
      else await this.#score();
    } catch (error) {
      this.#stream.fail(error.message);
    }
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
    await this.#stream.start("GENERATE", body);
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
    await this.#stream.start("SCORE", { ...body, text: true });
  }

  async #labelPrompt() {
    const texts = await this.#vocab.texts(this.#prompt).catch(() => []);
    texts.forEach((label, position) => this.#heatmap.set(position, { label, prompt: true }));
  }
}
