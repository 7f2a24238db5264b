// The monitor controls: watch a concept's calibrated probability on every generated token.
//
// Each row becomes one of the request's `monitors` (docs/readouts.md#monitors):
//   {"concept": "code", "above": 0.9, "action": "stop"}   // or "below", "flag", "layer"
// `flag` marks each token where the condition starts to hold; `stop` ends the generation there.

import { calibration } from "./heatmap.js";

export class MonitorControls {
  #fieldset;

  constructor(fieldset) {
    this.#fieldset = fieldset;
    fieldset.querySelector(".add").addEventListener("click", () => this.#add());
  }

  /**
   * Offer the calibrated concepts of MODEL_INFO's readout_manifest (none: no monitors). Shown
   * again after a reconnect or a change to the concepts: the chosen concept stays chosen, and
   * monitors on a concept no longer offered are dropped.
   */
  show(manifest) {
    const calibrated = calibration(manifest) !== null;
    const offered = calibrated ? manifest.concepts : [];
    this.#fieldset.hidden = !calibrated;
    const select = this.#fieldset.querySelector(".concept");
    const chosen = select.value;
    select.replaceChildren(...offered.map((name) => new Option(name, name)));
    if (offered.includes(chosen)) select.value = chosen;
    for (const row of this.#fieldset.querySelectorAll(".list li")) {
      if (!offered.includes(JSON.parse(row.dataset.monitor).concept)) row.remove();
    }
  }

  #add() {
    const field = (name) => this.#fieldset.querySelector(`.${name}`).value;
    const monitor = { concept: field("concept"), [field("side")]: Number(field("threshold")), action: field("action") };
    const row = document.createElement("li");
    row.dataset.monitor = JSON.stringify(monitor);
    const sign = monitor.above !== undefined ? `> ${monitor.above}` : `< ${monitor.below}`;
    row.innerHTML = `<span></span> <button type="button" class="quiet">remove</button>`;
    row.querySelector("span").textContent = `${monitor.concept} ${sign} → ${monitor.action}`;
    row.querySelector("button").addEventListener("click", () => row.remove());
    this.#fieldset.querySelector(".list").append(row);
  }

  /** The request's `monitors` (the server checks them: a bad one comes back as the pane's error). */
  monitors() {
    if (this.#fieldset.hidden) return [];
    return [...this.#fieldset.querySelectorAll(".list li")].map((row) => JSON.parse(row.dataset.monitor));
  }
}
