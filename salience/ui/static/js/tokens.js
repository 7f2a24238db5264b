// Token cells: one per token, coloured by its probability; hover or focus shows the
// top-k alternatives the server sent with it and, where the server serves an SAE, the token's
// most active features. The strip is one tab stop; arrow keys, Home and End move between
// tokens (a roving tabindex).

import { showToken } from "./vocab.js";

/** Background for a probability: red (unlikely) through yellow to green (likely), always light. */
export function probColor(p) {
  return `hsl(${Math.round(120 * p)} 75% 85%)`;
}

export class TokenStrip {
  #vocab;
  #tip;
  #sae;
  #cells = [];
  #count = 0; // cells that are not prompt tokens
  #features = new Map(); // position -> [[feature id, activation], ...], largest first

  /**
   * @param {HTMLElement} element the strip; @param {HTMLElement} tip the shared tooltip;
   * @param {{name: string, layer: number} | undefined} sae whose features the tokens carry (MODEL_INFO's saes entry)
   */
  constructor(element, vocab, tip, sae) {
    this.element = element;
    this.#vocab = vocab;
    this.#tip = tip;
    this.#sae = sae;
    element.setAttribute("role", "group");
    element.addEventListener("keydown", (event) => this.#key(event));
  }

  /** Plain text before the cells (the prompt of a generation). */
  addContext(text) {
    const span = document.createElement("span");
    span.className = "context";
    span.textContent = text;
    this.element.append(span);
  }

  /**
   * A token cell; `logprob` null for a token nothing predicted (the first of a scored text, or a
   * generation's prompt token, `prompt` true). `position` and `features` where the server sent them.
   */
  add({ token, text, logprob = null, alternatives, position, features, prompt = false }) {
    const cell = document.createElement("span");
    cell.className = "tok";
    cell.textContent = text;
    cell.dataset.token = token;
    cell.tabIndex = this.#cells.length === 0 ? 0 : -1;
    if (position != null) cell.dataset.position = position;
    if (features) this.#features.set(position, features);
    if (prompt) {
      cell.dataset.prompt = "";
      cell.style.color = "var(--muted)";
    } else {
      this.#count++;
    }
    if (logprob != null) {
      cell.dataset.logprob = logprob;
      cell.style.background = probColor(Math.exp(logprob));
    }
    const label = logprob == null ? "" : `, p ${percent(Math.exp(logprob))}`;
    cell.setAttribute("aria-label", `${showToken(text)}${label}`);
    const show = () => this.#show(cell, { token, logprob, alternatives, position, prompt });
    cell.addEventListener("mouseenter", show);
    cell.addEventListener("focus", show);
    cell.addEventListener("mouseleave", () => this.#hide(cell));
    cell.addEventListener("blur", () => this.#hide(cell));
    this.#cells.push(cell);
    this.element.append(cell);
  }

  /** The features of the token at `position`, when they arrive after its cell (prompt tokens). */
  setFeatures(position, features) {
    this.#features.set(position, features);
  }

  /** Cells other than a generation's prompt tokens. */
  get length() {
    return this.#count;
  }

  #key(event) {
    const at = this.#cells.indexOf(document.activeElement);
    if (at < 0) return;
    const to = { ArrowLeft: at - 1, ArrowRight: at + 1, Home: 0, End: this.#cells.length - 1 }[event.key];
    if (to === undefined || !this.#cells[to]) {
      if (event.key === "Escape") this.#hide(this.#cells[at]);
      return;
    }
    event.preventDefault();
    this.#cells[at].tabIndex = -1;
    this.#cells[to].tabIndex = 0;
    this.#cells[to].focus();
  }

  async #show(cell, { token, logprob, alternatives, position, prompt }) {
    const tip = this.#tip;
    tip.owner = cell;
    cell.setAttribute("aria-describedby", tip.id);
    const ids = Object.keys(alternatives ?? {}).map(Number);
    const rows = ids.map((id) => ({ id, logprob: alternatives[id] })).sort((a, b) => b.logprob - a.logprob);
    if (!rows.some((row) => row.id === token) && logprob != null) rows.push({ id: token, logprob, chosen: true });
    const head = caption(logprob, prompt);
    tip.replaceChildren(head, ...this.#featureList(position));
    place(tip, cell);
    if (rows.length === 0) return;
    let texts;
    try {
      texts = await this.#vocab.texts(rows.map((row) => row.id));
    } catch {
      return; // connection lost: the page says so already
    }
    if (tip.owner !== cell) return;
    const table = document.createElement("table");
    table.innerHTML = "<thead><tr><th>token</th><th>p</th><th>logprob</th></tr></thead>";
    const body = table.createTBody();
    rows.forEach((row, i) => {
      const tr = body.insertRow();
      if (row.id === token) tr.className = "chosen";
      const bar = `<span class="bar" style="width:${(100 * Math.exp(row.logprob)).toFixed(1)}%"></span>`;
      tr.innerHTML = `<td><code></code></td><td class="num">${bar}${percent(Math.exp(row.logprob))}</td><td class="num"></td>`;
      tr.cells[0].firstChild.textContent = showToken(texts[i]);
      tr.cells[2].textContent = row.logprob.toFixed(3);
    });
    head.after(table);
    place(tip, cell);
  }

  /** The token's features under a heading naming the SAE and layer: `#id activation` rows, largest first. */
  #featureList(position) {
    if (!this.#sae) return [];
    const heading = document.createElement("p");
    heading.className = "features-heading";
    heading.style.marginTop = "0.4rem";
    heading.textContent = `features of SAE ${this.#sae.name} at layer ${this.#sae.layer}`;
    const features = this.#features.get(position);
    if (!features?.length) {
      heading.textContent += features ? ": none active" : ": not read";
      return [heading];
    }
    const table = document.createElement("table");
    table.className = "features";
    const body = table.createTBody();
    for (const [id, activation] of features) {
      const tr = body.insertRow();
      tr.dataset.feature = id;
      tr.dataset.activation = activation;
      tr.innerHTML = `<td><code></code></td><td class="num"></td>`;
      tr.cells[0].firstChild.textContent = `#${id}`;
      tr.cells[1].textContent = activation.toFixed(2);
    }
    return [heading, table];
  }

  #hide(cell) {
    if (this.#tip.owner !== cell) return;
    this.#tip.owner = null;
    this.#tip.hidden = true;
  }
}

function caption(logprob, prompt) {
  const p = document.createElement("p");
  if (prompt) p.textContent = "prompt token";
  else if (logprob == null) p.textContent = "first token: nothing predicted it";
  else p.textContent = `alternatives (p of this token ${percent(Math.exp(logprob))})`;
  return p;
}

function place(tip, cell) {
  tip.hidden = false;
  const box = cell.getBoundingClientRect();
  const width = tip.offsetWidth;
  tip.style.left = `${Math.max(4, Math.min(box.left + scrollX, scrollX + innerWidth - width - 4))}px`;
  tip.style.top = `${box.bottom + scrollY + 4}px`;
}

export function percent(p) {
  return p >= 0.001 ? `${(100 * p).toFixed(1)}%` : p.toExponential(1);
}
