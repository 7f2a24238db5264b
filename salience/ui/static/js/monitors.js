// The monitor controls: watch a concept's calibrated probability on every generated token.
//
// Each row becomes one of the request's `monitors` (docs/readouts.md#monitors):
//   {"concept": "code", "above": 0.9, "action": "stop"}   // or "below", "flag", "layer"
// `flag` marks each token where the condition starts to hold; `stop` ends the generation there.
// The server watches the token view's p (each token's own) at the concept's recommended layer; the
// chosen concept's held-out figures there are shown under the controls, so a threshold is set
// knowing how often ordinary text crosses 0.5.

import { calibration, conceptFacts } from "./heatmap.js";

export class MonitorControls {
  #fieldset;

  #info = [];

  constructor(fieldset) {
    this.#fieldset = fieldset;
    fieldset.querySelector(".add").addEventListener("click", () => this.#add());
    fieldset.querySelector(".concept").addEventListener("change", () => this.#facts());
  }

  /**
   * Offer the calibrated concepts of MODEL_INFO's readout_manifest (none: no monitors). Shown
   * again after a reconnect or a change to the concepts: the chosen concept stays chosen, and
   * monitors on a concept no longer offered are dropped.
   */
  show(manifest) {
    const info = calibration(manifest);
    const offered = info ? manifest.concepts : [];
    this.#info = info ?? [];
    this.#fieldset.hidden = !info;
    const select = this.#fieldset.querySelector(".concept");
    const chosen = select.value;
    select.replaceChildren(
      ...offered.map((name, k) => {
        const option = new Option(name, name);
        option.title = conceptFacts(info[k]).join("\n");
        return option;
      }),
    );
    if (offered.includes(chosen)) select.value = chosen;
    this.#facts();
    for (const row of this.#fieldset.querySelectorAll(".list li")) {
      if (!offered.includes(JSON.parse(row.dataset.monitor).concept)) row.remove();
    }
  }

  /** The chosen concept's held-out figures at its recommended layer, its warning included. */
  #facts() {
    const line = this.#fieldset.querySelector(".facts");
    const k = this.#fieldset.querySelector(".concept").selectedIndex;
    const info = this.#info[k];
    line.hidden = !info;
    line.textContent = info ? conceptFacts(info).join("\n") : "";
    line.classList.toggle("warned", Boolean(info?.warning));
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
