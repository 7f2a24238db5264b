// One GENERATE or SCORE stream shown in an element: its state line, Stop, error, tokens into a
// strip, readouts into a heatmap, monitor events, and the LMTP lines it sent. A completion pane
// and a chat reply differ in what they send and how they are laid out, not in how a stream shows.

import { readoutValues } from "./lmtp.js";
import { describe } from "./steering.js";

const count = (n) => `${n} token${n === 1 ? "" : "s"}`;

export class StreamView {
  #client;
  #element;
  #strip;
  #heatmap;
  #streamId = null;

  /**
   * @param element holds `.state`, `.stop`, `.steered`, `.error`, `.monitor-events` and `.protocol pre`
   * @param strip the TokenStrip tokens go into; @param heatmap the Heatmap readouts go into, or null
   */
  constructor({ client, element, strip, heatmap }) {
    this.#client = client;
    this.#element = element;
    this.#strip = strip;
    this.#heatmap = heatmap;
    this.#part(".stop").addEventListener("click", () => this.stop());
  }

  /** Say what steered the stream, so streams side by side show what changed them. */
  steered(steer) {
    const line = this.#part(".steered");
    line.hidden = steer.length === 0;
    line.textContent = `steered: ${describe(steer)}`;
  }

  /**
   * Send a GENERATE or SCORE; resolves with its last payload (a finish_reason, or an error) when it
   * ends. `onPayload` sees every payload first (a chat's prompt_ids, say). `showEnd` false leaves the
   * token that ends a stream at a stop (a chat's end-of-turn marker) out of the strip; its heatmap
   * column stays.
   */
  start(type, body, { onPayload = () => {}, showEnd = true } = {}) {
    // Readouts as float32 in base64: a fifth of the bytes of JSON numbers, and nothing to parse.
    if (body.readout) body.readout_encoding = "f32";
    this.log(type, body);
    return new Promise((resolve) => {
      this.#streamId = this.#client.stream(type, body, (payload) => {
        onPayload(payload);
        if (this.#receive(payload, showEnd)) resolve(payload);
      });
      this.#part(".stop").disabled = type !== "GENERATE";
      this.state("streaming");
    });
  }

  stop() {
    if (this.#streamId !== null) this.#client.cancel(this.#streamId);
  }

  /** A request answered by one MSG (TOKENIZE, say), listed with the lines the stream sent. */
  ask(type, body) {
    this.log(type, body);
    return this.#client.request(type, body);
  }

  log(type, body) {
    this.#part(".protocol pre").textContent += `${type} ${JSON.stringify(body)}\n`;
  }

  state(text) {
    this.#part(".state").textContent = text;
  }

  fail(message) {
    this.#ended();
    const error = this.#part(".error");
    error.hidden = false;
    error.textContent = message;
    this.state("error");
  }

  /** Handle one TOKEN payload; true when it ends the stream. */
  #receive(payload, showEnd) {
    if (payload.error != null) {
      this.fail(payload.error);
      return true;
    }
    if (payload.prompt) {
      this.#heatmap?.set(payload.position, { prompt: true, readout: readoutValues(payload.readout) });
      if (payload.features) this.#strip.setFeatures(payload.position, payload.features);
      return false;
    }
    if (payload.token != null) {
      const { token, text, logprob, top_logprobs: alternatives, position, features } = payload;
      if (showEnd || payload.finish_reason !== "stop") {
        this.#strip.add({ token, text, logprob, alternatives, position, features });
      }
      this.#heatmap?.set(position, { label: text, readout: readoutValues(payload.readout), monitors: payload.monitors });
      if (payload.monitors) this.#monitored(payload.monitors);
      this.state(`streaming · ${count(this.#strip.length)}`);
    }
    if (payload.finish_reason == null) return false;
    this.#ended();
    const reason = payload.finish_reason === "cancelled" ? "stopped" : `done (${payload.finish_reason})`;
    this.state(`${reason} · ${count(this.#strip.length)}`);
    return true;
  }

  #ended() {
    this.#streamId = null;
    this.#part(".stop").disabled = true;
  }

  /** A line per monitor event under the tokens (the heatmap marks the token's column too). */
  #monitored(events) {
    const list = this.#part(".monitor-events");
    list.hidden = false;
    for (const m of events) {
      const item = document.createElement("li");
      item.dataset.action = m.action;
      item.textContent = `${m.action}: ${m.concept} token p = ${m.probability.toFixed(3)} at position ${m.position} (layer ${m.layer})`;
      list.append(item);
    }
  }

  #part(selector) {
    return this.#element.querySelector(selector);
  }
}
