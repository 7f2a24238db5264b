// The steering controls: per concept a slider (alpha of an `add`) and the layer it acts at.
//
// A slider at 0 leaves its concept alone. The others become the request's `steer` list
// (docs/steering.md), applied at every position, prompt and generated:
//   {"direction": "french", "layers": [15], "op": "add", "value": 24, "positions": "all"}

const RANGE = 64; // sliders run from -RANGE to +RANGE: middle-layer projections are in the tens

export class SteeringControls {
  #fieldset;
  #rows = [];

  constructor(fieldset) {
    this.#fieldset = fieldset;
  }

  /**
   * Build a row per direction from MODEL_INFO's `steering` (null: the server does not steer).
   * Shown again after a reconnect or a change to the concepts: a direction still offered keeps
   * its slider and layer.
   */
  show(steering) {
    const kept = new Map(this.#rows.map(({ name, slider, select }) => [name, { value: slider.value, layer: select.value }]));
    this.#fieldset.querySelector(".controls").replaceChildren();
    this.#rows = [];
    this.#fieldset.hidden = !steering;
    if (!steering) return;
    for (const [name, layers] of Object.entries(steering.directions)) this.#add(name, layers, kept.get(name));
  }

  #add(name, layers, kept) {
    const row = document.createElement("div");
    row.className = "steer";
    row.dataset.direction = name;
    const id = `steer-${this.#rows.length}`; // live concepts are named by users: names stay text
    row.innerHTML = `
      <label for="${id}"></label>
      <input id="${id}" type="range" min="${-RANGE}" max="${RANGE}" step="1" value="0">
      <output for="${id}">0</output>
      <label>layer <select></select></label>`;
    row.querySelector("label").textContent = name;
    const slider = row.querySelector("input");
    const output = row.querySelector("output");
    const select = row.querySelector("select");
    select.setAttribute("aria-label", `${name} layer`);
    for (const layer of layers) select.add(new Option(String(layer), String(layer)));
    select.value = String(layers[Math.floor(layers.length / 2)]);
    const sync = () => {
      output.value = slider.value;
      row.classList.toggle("active", Number(slider.value) !== 0);
    };
    slider.addEventListener("input", sync);
    if (kept) {
      slider.value = kept.value;
      if (layers.map(String).includes(kept.layer)) select.value = kept.layer;
      sync();
    }
    this.#fieldset.querySelector(".controls").append(row);
    this.#rows.push({ name, slider, select });
  }

  /** The interventions the sliders ask for; empty when every slider is at 0. */
  interventions() {
    return this.#rows
      .filter(({ slider }) => Number(slider.value) !== 0)
      .map(({ name, slider, select }) => ({
        direction: name,
        layers: [Number(select.value)],
        op: "add",
        value: Number(slider.value),
        positions: "all",
      }));
  }

  reset() {
    for (const { slider } of this.#rows) {
      slider.value = "0";
      slider.dispatchEvent(new Event("input"));
    }
  }
}

/** "french +24 @15, code -8 @20": how a pane says what it was steered by. */
export function describe(steer) {
  return steer.map((s) => `${s.direction} ${s.value > 0 ? "+" : ""}${s.value} @${s.layers.join(",")}`).join(", ");
}
