// Concept readouts as a heatmap: tokens across, concepts down, one layer at a time.
//
// A readout arrives flat and layer-major (`readout[i * nConcepts + k]` is layer
// `layers[i]`, concept `concepts[k]`, see docs/readouts.md), raw. With a calibrated set
// (MODEL_INFO's `concept_info`) the page shows probabilities by default: each raw value
// through its concept's published map at that layer, p = 1 / (1 + exp(-(scale * raw +
// offset))), the number the server streams for `"readout_format": "probability"`, coloured
// from 0 (white) to 1 (red), each concept at its recommended layer unless a layer is chosen.
// Raw stays one click away. Cells keep the value unrounded (`data-value`, the focus line,
// tooltips); only the colour is scaled. The raw scale is symmetric around 0 and ends at the
// largest |value| in the layer, position 0 left out: the first token's residual is an
// attention sink, often a thousand times larger than the rest, and would wash everything else
// out (it is drawn at full colour). Monitor events mark their token's column; in a chat turn the
// chat template's own tokens (`<|im_start|>assistant\n`) have their header boxed in grey.

import { showToken } from "./vocab.js";

const NEGATIVE = [33, 102, 172];
const POSITIVE = [178, 24, 43];

const RECOMMENDED = -1; // the layer select's "each concept at its recommended layer"

/** The manifest's concept_info when every concept has a calibration, else null (raw only). */
export function calibration(manifest) {
  const info = manifest?.concept_info ?? [];
  return info.length > 0 && info.length === manifest.concepts.length && info.every(Boolean) ? info : null;
}

/** Colour for a value on a scale of ±`scale`: blue below 0, white at 0, red above. */
export function valueColor(value, scale) {
  const t = Math.max(-1, Math.min(1, value / scale));
  const end = t < 0 ? NEGATIVE : POSITIVE;
  const mix = end.map((c) => Math.round(255 + (c - 255) * Math.abs(t)));
  return `rgb(${mix.join(" ")})`;
}

/** " (prompt)", or with a chat prompt's role " (prompt, user)", " (prompt, template)"; "" when generated. */
function where(column) {
  if (!column.prompt) return "";
  return column.role ? ` (prompt, ${column.role})` : " (prompt)";
}

export class Heatmap {
  #concepts;
  #layers;
  #info; // concept_info per concept, or null: the set is not calibrated
  #columns = new Map(); // position -> {position, label, prompt, readout, monitors, role}
  #layer = 0; // an index into #layers, or RECOMMENDED
  #view = "raw"; // or "probability"
  #line = null; // concept index whose line is shown
  #active = { row: 0, col: 0 };
  #pending = false;

  /** @param {{concepts: string[], layers: number[], concept_info?: object[]}} manifest from MODEL_INFO's readout_manifest */
  constructor(manifest) {
    this.#concepts = manifest.concepts;
    this.#layers = manifest.layers;
    this.#info = calibration(manifest);
    this.#view = this.#info ? "probability" : "raw";
    this.#layer = this.#info ? RECOMMENDED : manifest.layers.length - 1;
    this.element = document.createElement("section");
    this.element.className = "readouts";
    this.element.innerHTML = `
      <div class="readout-controls">
        <label>show <select class="view">
          <option value="probability">probability</option><option value="raw">raw</option></select></label>
        <label>layer <select class="layer"></select></label>
        <div class="legend" aria-label="colour scale"><span class="lo"></span><span class="ramp"></span><span class="hi"></span></div>
        <span class="template-key" hidden><span class="swatch"></span> the chat template's own tokens</span>
      </div>
      <div class="heatmap-scroll"><table class="heatmap" tabindex="0" aria-label="concept readouts: arrow keys move between cells"></table></div>
      <p class="cell-info" aria-live="polite">Hover a cell or focus the table and use the arrow keys; click a concept for its line.</p>
      <figure class="concept-line" hidden></figure>`;
    const view = this.element.querySelector(".view");
    view.value = this.#view;
    view.options[0].disabled = !this.#info;
    view.title = this.#info ? "" : "this concept set has no calibration: raw projections only";
    view.addEventListener("change", () => {
      this.#view = view.value;
      this.#render();
    });
    const select = this.element.querySelector(".layer");
    if (this.#info) select.append(new Option("recommended", String(RECOMMENDED), false, true));
    select.append(...this.#layers.map((layer, i) => new Option(String(layer), String(i), false, i === this.#layer)));
    select.addEventListener("change", () => {
      this.#layer = Number(select.value);
      this.#render();
    });
    const table = this.element.querySelector(".heatmap");
    table.addEventListener("keydown", (event) => this.#key(event));
    table.addEventListener("focus", () => this.#describe());
    table.addEventListener("mouseover", (event) => {
      const cell = event.target.closest("td[data-col]"); // not the empty corner cell
      if (cell) this.#describe(cell);
    });
    table.addEventListener("click", (event) => {
      const button = event.target.closest("button[data-concept]");
      if (button) this.#toggleLine(Number(button.dataset.concept));
    });
  }

  /**
   * Create or update the column at `position` with the fields given ({label, prompt, readout, monitors,
   * role}). `role` names a chat prompt token's message role, or "template" for the chat template's own
   * tokens, whose header is drawn boxed in grey.
   */
  set(position, fields) {
    const column = this.#columns.get(position) ?? { position, label: "", prompt: false };
    for (const [key, value] of Object.entries(fields)) if (value !== undefined) column[key] = value;
    this.#columns.set(position, column);
    this.#schedule();
  }

  #schedule() {
    if (this.#pending) return;
    this.#pending = true;
    requestAnimationFrame(() => {
      this.#pending = false;
      this.#render();
    });
  }

  #sorted() {
    return [...this.#columns.values()].sort((a, b) => a.position - b.position);
  }

  /** The index into #layers concept `k` is shown at. */
  #layerOf(k) {
    if (this.#layer !== RECOMMENDED) return this.#layer;
    return this.#layers.indexOf(this.#info[k].recommended_layer);
  }

  #value(column, k) {
    const i = this.#layerOf(k);
    const raw = column.readout?.[i * this.#concepts.length + k];
    if (raw === undefined || this.#view === "raw") return raw;
    const fit = this.#info[k].layers.find((entry) => entry.layer === this.#layers[i]);
    return 1 / (1 + Math.exp(-(fit.scale * raw + fit.offset)));
  }

  #layerName(k) {
    return `layer ${this.#layers[this.#layerOf(k)]}`;
  }

  #scale(columns) {
    if (this.#view === "probability") return 1;
    const rest = columns.length > 1 ? columns.filter((column) => column.position > 0) : columns;
    const magnitudes = rest.flatMap((column) => this.#concepts.map((_, k) => Math.abs(this.#value(column, k) ?? 0)));
    const scale = Math.max(0, ...magnitudes);
    return scale > 0 ? scale : 1;
  }

  #render() {
    const columns = this.#sorted();
    const scale = this.#scale(columns);
    const table = this.element.querySelector(".heatmap");
    const head = document.createElement("thead");
    const headRow = head.insertRow();
    headRow.append(document.createElement("td"));
    for (const column of columns) {
      const th = document.createElement("th");
      th.scope = "col";
      th.className = column.prompt ? "prompt" : "";
      th.textContent = showToken(column.label);
      th.title = `position ${column.position}${where(column)}`;
      if (column.role) {
        th.dataset.role = column.role;
        th.classList.toggle("template", column.role === "template");
      }
      if (column.monitors?.length) {
        th.classList.add("monitor");
        th.dataset.monitors = column.monitors.map((m) => m.action).join(" ");
        const events = column.monitors.map(
          (m) => `monitor ${m.monitor} ${m.action}: ${m.concept} at layer ${m.layer}, p = ${m.probability.toFixed(3)}`,
        );
        th.title += `\n${events.join("\n")}`;
      }
      headRow.append(th);
    }
    const body = document.createElement("tbody");
    this.#concepts.forEach((concept, k) => {
      const tr = body.insertRow();
      const th = document.createElement("th");
      th.scope = "row";
      th.innerHTML = `<button type="button" data-concept="${k}" aria-pressed="${this.#line === k}"></button>`;
      th.firstChild.textContent = concept;
      th.firstChild.title = this.#writes(k);
      tr.append(th);
      columns.forEach((column, col) => {
        const td = tr.insertCell();
        const value = this.#value(column, k);
        td.dataset.row = k;
        td.dataset.col = col;
        td.dataset.position = column.position;
        if (value === undefined) {
          td.className = "none";
          td.title = "no readout: this token has not been through the model";
        } else {
          td.dataset.value = String(value);
          td.style.background = valueColor(value, scale);
          td.title = `${concept} · ${showToken(column.label)} · ${this.#layerName(k)}: ${value}`;
        }
      });
    });
    table.replaceChildren(head, body);
    this.element.querySelector(".template-key").hidden = !columns.some((column) => column.role === "template");
    this.#legend(scale);
    this.#markActive();
    this.#drawLine(columns);
  }

  /** What the concept's direction writes (its logit lens), for its row's tooltip. */
  #writes(k) {
    const writes = this.#info?.[k].writes;
    if (!writes) return "";
    const list = (tokens) => tokens.map((t) => JSON.stringify(t)).join(" ");
    return `writes at layer ${writes.layer}\nraises: ${list(writes.raises)}\nlowers: ${list(writes.lowers)}`;
  }

  #legend(scale) {
    const legend = this.element.querySelector(".legend");
    const probability = this.#view === "probability";
    const steps = probability ? [0, 0.25, 0.5, 0.75, 1] : [-1, -0.5, 0, 0.5, 1];
    const ramp = steps.map((t) => valueColor(t * scale, scale)).join(", ");
    legend.querySelector(".ramp").style.background = `linear-gradient(to right, ${ramp})`;
    legend.querySelector(".lo").textContent = probability ? "p = 0" : `≤ −${scale.toPrecision(3)}`;
    legend.querySelector(".hi").textContent = probability ? "1" : `≥ +${scale.toPrecision(3)}`;
  }

  #key(event) {
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (event.key === "Enter") {
      this.#toggleLine(this.#active.row);
      event.preventDefault();
      return;
    }
    const move = moves[event.key];
    if (!move) return;
    event.preventDefault();
    const columns = this.#columns.size;
    this.#active = {
      row: Math.max(0, Math.min(this.#concepts.length - 1, this.#active.row + move[0])),
      col: Math.max(0, Math.min(columns - 1, this.#active.col + move[1])),
    };
    this.#markActive();
    this.#describe();
  }

  #markActive() {
    const table = this.element.querySelector(".heatmap");
    table.querySelector("td.active")?.classList.remove("active");
    const cell = table.querySelector(`td[data-row="${this.#active.row}"][data-col="${this.#active.col}"]`);
    cell?.classList.add("active");
    cell?.scrollIntoView({ block: "nearest", inline: "nearest" });
  }

  #describe(cell = this.element.querySelector("td.active")) {
    if (!cell) return;
    const info = this.element.querySelector(".cell-info");
    const column = this.#sorted()[Number(cell.dataset.col)];
    const k = Number(cell.dataset.row);
    const at = `${this.#concepts[k]} at position ${column.position}${where(column)} (${showToken(column.label)}), ${this.#layerName(k)}`;
    info.textContent = `${at}: ${cell.dataset.value ?? "no readout"}`;
  }

  #toggleLine(k) {
    this.#line = this.#line === k ? null : k;
    this.#render();
  }

  #drawLine(columns) {
    const figure = this.element.querySelector(".concept-line");
    figure.hidden = this.#line === null;
    if (this.#line === null) return;
    const points = columns
      .map((column, x) => ({ x, column, value: this.#value(column, this.#line) }))
      .filter((point) => point.value !== undefined);
    const values = points.map((point) => point.value);
    const probability = this.#view === "probability";
    const lo = probability ? 0 : Math.min(0, ...values);
    const hi = probability ? 1 : Math.max(0, ...values);
    const base = probability ? 0.5 : 0; // the decision boundary, or zero
    const width = Math.max(columns.length - 1, 1);
    const y = (value) => (hi === lo ? 50 : 95 - (90 * (value - lo)) / (hi - lo));
    const svg = `<svg viewBox="-1 0 ${width + 2} 100" preserveAspectRatio="none" role="img">
      <line class="zero" x1="-1" x2="${width + 1}" y1="${y(base)}" y2="${y(base)}"></line>
      <polyline points="${points.map((point) => `${point.x},${y(point.value)}`).join(" ")}"></polyline></svg>`;
    const concept = this.#concepts[this.#line];
    figure.innerHTML = `<figcaption></figcaption>${svg}`;
    const range = values.length ? `: min ${Math.min(...values)}, max ${Math.max(...values)}` : "";
    figure.querySelector("figcaption").textContent =
      `${concept} (${this.#view}), ${this.#layerName(this.#line)}, over ${points.length} tokens${range}`;
    figure.querySelector("svg").setAttribute("aria-label", `${concept} over the tokens`);
  }
}
