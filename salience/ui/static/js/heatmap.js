// Concept readouts as a heatmap: tokens across, concepts down, one layer at a time.
//
// A readout arrives flat and layer-major (`readout[i * nConcepts + k]` is layer
// `layers[i]`, concept `concepts[k]`, see docs/readouts.md), raw. With a calibrated set
// (MODEL_INFO's `concept_info`) the page shows probabilities, computed here from the raw values
// with the maps the set publishes per concept and layer, as the server computes its
// `"readout_format"` of the same name:
// - running (the default): p = 1 / (1 + exp(-(running_scale * m + running_offset))), m the mean
//   raw value over the columns read so far (the pane's, or the chat turn's), in position order:
//   p that the text so far has the concept;
// - token: p = 1 / (1 + exp(-(scale * raw + offset))), the token's own value: p that this token
//   belongs to a text with the concept.
// Each concept at its recommended layer unless a layer is chosen, coloured from 0 (white) to
// 1 (red). Position 0 is not read in either view, nor counted in a running mean: the first
// token's residual is an attention sink, often a thousand times larger than the rest, and says
// nothing about the text; its cells are grey, off the colour scale. Raw stays one click away: the
// projections, on a scale symmetric around 0 that ends at the largest |value| in the layer,
// position 0 left out (it would wash everything else out; it is drawn at full colour). Cells keep
// the value unrounded (`data-value`, the focus line, tooltips); only the colour is scaled.
// Monitor events mark their token's column; in a chat turn the chat template's own tokens
// (`<|im_start|>assistant\n`) have their header boxed in grey. A concept's name has its held-out
// figures (`conceptFacts`) and what its direction writes as a tooltip.

import { showToken } from "./vocab.js";

const NEGATIVE = [33, 102, 172];
const POSITIVE = [178, 24, 43];

const RECOMMENDED = -1; // the layer select's "each concept at its recommended layer"

/** Why a probability view leaves position 0 unread (the REPL says the same). */
export const NOT_READ =
  "not read: the first token holds the model's attention-sink activations, which say nothing about the text";

/** What each view shows, in words: the legend's and the concept line's. */
export const VIEWS = {
  running: "running: p that the text so far has the concept",
  token: "token: p that this token belongs to a text with the concept",
  raw: "raw: the projection onto the concept's direction",
};

/**
 * The manifest's concept_info when every concept has a calibration, else null (raw only): a set
 * built by hand has null per concept, a live concept given as raw vectors only its name.
 */
export function calibration(manifest) {
  const info = manifest?.concept_info ?? [];
  const calibrated = info.every((concept) => concept?.layers?.length > 0);
  return info.length > 0 && info.length === manifest.concepts.length && calibrated ? info : null;
}

/** Whether every concept of a calibrated set publishes the running map (a set built before it does not). */
function runs(info) {
  return info.every((concept) => concept.layers.every((fit) => fit.running_scale != null));
}

const logistic = (x) => 1 / (1 + Math.exp(-x));

const percent = (x) => `${(100 * x).toFixed(1)}%`;

/**
 * A calibrated concept's held-out validation at `layer` (default: its recommended one), in lines:
 * its AUROC with the 95% interval, the share of ordinary (background) texts it reads above 0.5 with
 * its interval, how many examples it was fitted on, and the builder's warning if it has one.
 */
export function conceptFacts(info, layer = info.recommended_layer) {
  const fit = info.layers.find((entry) => entry.layer === layer);
  const which = layer === info.recommended_layer ? "the recommended layer" : `recommended: ${info.recommended_layer}`;
  const lines = [`held out at layer ${layer} (${which}), ${info.method}:`];
  if (!fit) return [...lines, "no figures at this layer"];
  let auroc = `AUROC ${fit.auroc.toFixed(3)}`;
  if (fit.auroc_interval) auroc += ` (95% interval ${fit.auroc_interval.map((x) => x.toFixed(3)).join("–")})`;
  lines.push(auroc);
  if (fit.background_fpr != null) {
    let fpr = `background false positives ${percent(fit.background_fpr)}`;
    if (fit.background_fpr_interval) fpr += ` (95% interval ${fit.background_fpr_interval.map(percent).join("–")})`;
    const texts = fit.background_texts ?? info.n_background;
    lines.push(`${fpr}: the share of ${texts} ordinary texts read above p = 0.5`);
  } else {
    lines.push("background false positives: not measured (no ordinary texts)");
  }
  if (info.n_positive != null) {
    const pairs = info.n_pairs ? ` (${info.n_pairs} matched pairs)` : "";
    lines.push(`${info.n_positive} positive, ${info.n_negative} negative examples${pairs}`);
  }
  if (info.warning) lines.push(`warning: ${info.warning}`);
  return lines;
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
  #view = "raw"; // or "running", "token"
  #line = null; // concept index whose line is shown
  #active = { row: 0, col: 0 };
  #pending = false;

  /** @param {{concepts: string[], layers: number[], concept_info?: object[]}} manifest from MODEL_INFO's readout_manifest */
  constructor(manifest) {
    this.#concepts = manifest.concepts;
    this.#layers = manifest.layers;
    this.#info = calibration(manifest);
    const running = Boolean(this.#info) && runs(this.#info);
    this.#view = running ? "running" : this.#info ? "token" : "raw";
    this.#layer = this.#info ? RECOMMENDED : manifest.layers.length - 1;
    this.element = document.createElement("section");
    this.element.className = "readouts";
    this.element.innerHTML = `
      <div class="readout-controls">
        <label>show <select class="view">
          <option value="running">running</option><option value="token">token</option>
          <option value="raw">raw</option></select></label>
        <label>layer <select class="layer"></select></label>
        <div class="legend" aria-label="colour scale"><span class="lo"></span><span class="ramp"></span><span class="hi"></span>
          <span class="what"></span></div>
        <span class="unread-key" hidden><span class="swatch"></span> not read (position 0)</span>
        <span class="template-key" hidden><span class="swatch"></span> the chat template's own tokens</span>
      </div>
      <div class="heatmap-scroll"><table class="heatmap" tabindex="0" aria-label="concept readouts: arrow keys move between cells"></table></div>
      <p class="cell-info" aria-live="polite">Hover a cell or focus the table and use the arrow keys; click a concept for its line.</p>
      <figure class="concept-line" hidden></figure>`;
    const view = this.element.querySelector(".view");
    view.value = this.#view;
    for (const option of view.options) option.title = VIEWS[option.value];
    view.options[0].disabled = !running;
    view.options[1].disabled = !this.#info;
    if (!this.#info) view.title = "this concept set has no calibration: raw projections only";
    else if (!running) view.options[0].title = "this concept set was built before running calibrations: rebuild it";
    view.addEventListener("change", () => {
      this.#view = view.value;
      this.#render();
    });
    this.element.querySelector(".unread-key").title = NOT_READ;
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

  get #probability() {
    return this.#view !== "raw";
  }

  /**
   * Concept `k`'s value in every column (sorted by position), in the view shown: a number; null
   * where a probability view does not read (position 0); undefined where the column has no readout
   * yet. The running view's mean runs over these columns in position order, as the server's over
   * the positions a request reads, position 0 never counted.
   */
  #row(columns, k) {
    const i = this.#layerOf(k);
    const at = i * this.#concepts.length + k;
    if (!this.#probability) return columns.map((column) => column.readout?.[at]);
    const fit = this.#info[k].layers.find((entry) => entry.layer === this.#layers[i]);
    let sum = 0;
    let count = 0;
    return columns.map((column) => {
      const raw = column.readout?.[at];
      if (raw === undefined) return undefined;
      if (column.position === 0) return null;
      if (this.#view === "token") return logistic(fit.scale * raw + fit.offset);
      sum += raw;
      count += 1;
      return logistic(fit.running_scale * (sum / count) + fit.running_offset);
    });
  }

  #layerName(k) {
    return `layer ${this.#layers[this.#layerOf(k)]}`;
  }

  #scale(columns, rows) {
    if (this.#probability) return 1;
    const keep = columns.map((column) => columns.length === 1 || column.position > 0);
    const magnitudes = rows.flatMap((row) => row.filter((_, c) => keep[c]).map((value) => Math.abs(value ?? 0)));
    const scale = Math.max(0, ...magnitudes);
    return scale > 0 ? scale : 1;
  }

  #render() {
    const columns = this.#sorted();
    const rows = this.#concepts.map((_, k) => this.#row(columns, k));
    const scale = this.#scale(columns, rows);
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
          (m) => `monitor ${m.monitor} ${m.action}: ${m.concept} at layer ${m.layer}, token p = ${m.probability.toFixed(3)}`,
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
      th.firstChild.title = this.#about(k);
      const warning = this.#info?.[k].warning;
      if (warning) {
        const mark = document.createElement("span");
        mark.className = "warning";
        mark.textContent = "!";
        mark.title = `warning: ${warning}`;
        mark.setAttribute("role", "img");
        mark.setAttribute("aria-label", mark.title);
        th.append(mark);
      }
      tr.append(th);
      columns.forEach((column, col) => {
        const td = tr.insertCell();
        const value = rows[k][col];
        td.dataset.row = k;
        td.dataset.col = col;
        td.dataset.position = column.position;
        const at = `${concept} · ${showToken(column.label)} · ${this.#layerName(k)}`;
        if (value === undefined) {
          td.className = "none";
          td.title = "no readout: this token has not been through the model";
        } else if (value === null) {
          td.className = "unread";
          td.title = `${at}: ${NOT_READ}`;
        } else {
          td.dataset.value = String(value);
          td.style.background = valueColor(value, scale);
          td.title = `${at}: ${value}`;
        }
      });
    });
    table.replaceChildren(head, body);
    this.element.querySelector(".template-key").hidden = !columns.some((column) => column.role === "template");
    this.element.querySelector(".unread-key").hidden = !rows.some((row) => row.includes(null));
    this.#legend(scale);
    this.#markActive();
    this.#drawLine(columns, rows);
  }

  /** The concept's row tooltip: its held-out figures at the layer shown, and what its direction writes. */
  #about(k) {
    const info = this.#info?.[k];
    if (!info) return "";
    const lines = conceptFacts(info, this.#layers[this.#layerOf(k)]);
    const writes = info.writes;
    if (writes) {
      const list = (tokens) => tokens.map((t) => JSON.stringify(t)).join(" ");
      lines.push(`writes at layer ${writes.layer}`, `raises: ${list(writes.raises)}`, `lowers: ${list(writes.lowers)}`);
    }
    return lines.join("\n");
  }

  #legend(scale) {
    const legend = this.element.querySelector(".legend");
    const probability = this.#probability;
    const steps = probability ? [0, 0.25, 0.5, 0.75, 1] : [-1, -0.5, 0, 0.5, 1];
    const ramp = steps.map((t) => valueColor(t * scale, scale)).join(", ");
    legend.querySelector(".ramp").style.background = `linear-gradient(to right, ${ramp})`;
    legend.querySelector(".lo").textContent = probability ? "p = 0" : `≤ −${scale.toPrecision(3)}`;
    legend.querySelector(".hi").textContent = probability ? "1" : `≥ +${scale.toPrecision(3)}`;
    const layer = this.#layer === RECOMMENDED ? "each concept at its recommended layer" : this.#layerName(0);
    legend.querySelector(".what").textContent = `${VIEWS[this.#view]} (${layer})`;
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
    const value = cell.classList.contains("unread") ? NOT_READ : (cell.dataset.value ?? "no readout");
    info.textContent = `${at}, ${this.#view}: ${value}`;
  }

  #toggleLine(k) {
    this.#line = this.#line === k ? null : k;
    this.#render();
  }

  #drawLine(columns, rows) {
    const figure = this.element.querySelector(".concept-line");
    figure.hidden = this.#line === null;
    if (this.#line === null) return;
    const points = columns
      .map((column, x) => ({ x, column, value: rows[this.#line][x] }))
      .filter((point) => point.value != null);
    const values = points.map((point) => point.value);
    const probability = this.#probability;
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
    const unread = rows[this.#line].includes(null) ? " (position 0 not read)" : "";
    figure.querySelector("figcaption").textContent =
      `${concept} (${VIEWS[this.#view]}), ${this.#layerName(this.#line)}, over ${points.length} tokens${unread}${range}`;
    figure.querySelector("svg").setAttribute("aria-label", `${concept} over the tokens`);
  }
}
