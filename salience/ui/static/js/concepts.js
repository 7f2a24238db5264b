// Live concepts: the "Define a concept" form, and the live concepts listed with a delete each.
//
// The server fits a concept from examples while it serves (seconds to a minute; streams keep
// streaming), then every new request reads and steers along it:
//   DEFINE_CONCEPT {"name", "positive": [...], "negative": [...]}
//     -> MSG {"concept", "version", "concept_info", "table"}  (table: the held-out validation)
//   DELETE_CONCEPT {"name"} -> MSG {"concept", "deleted": true, "version"}
// Either changes the served concept list, so the page reads MODEL_INFO again and rebuilds what
// depends on it (`onChange`) before its next request; a running generation keeps its manifest.

const MIN_EXAMPLES = 4; // per class, as the server checks
const MAX_EXAMPLES = 256;

/** The non-blank lines of a textarea, trimmed. */
const lines = (textarea) =>
  textarea.value
    .split("\n")
    .map((line) => line.trim())
    .filter(Boolean);

export class ConceptForm {
  #section;
  #client;
  #onChange;
  #ready = false;
  #fitting = false;

  /**
   * @param section the #concepts element (the form, its status line and table, the live list)
   * @param client the page's LmtpClient
   * @param onChange called with the new MODEL_INFO after a define or a delete
   */
  constructor(section, client, onChange) {
    this.#section = section;
    this.#client = client;
    this.#onChange = onChange;
    section.querySelector("form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.#define();
    });
  }

  /** Offered with a concept set only (live concepts take its spare columns); lists manifest.live. */
  show(manifest) {
    this.#section.hidden = !manifest;
    const items = (manifest?.live ?? []).map((name) => {
      const item = document.createElement("li");
      item.innerHTML = `<span></span> <button type="button" class="quiet">delete</button>`;
      item.querySelector("span").textContent = name;
      const button = item.querySelector("button");
      button.setAttribute("aria-label", `delete ${name}`);
      button.addEventListener("click", () => this.#delete(name));
      return item;
    });
    const list = this.#section.querySelector(".live");
    list.replaceChildren(...items);
    list.hidden = items.length === 0;
    this.#sync();
  }

  /** Define and delete are sent only while the server is ready. */
  enable(ready) {
    this.#ready = ready;
    this.#sync();
  }

  #sync() {
    this.#section.querySelector(".define").disabled = !this.#ready || this.#fitting;
    for (const button of this.#section.querySelectorAll(".live button")) button.disabled = !this.#ready;
  }

  /** DEFINE_CONCEPT's body from the form, or an Error saying what the form lacks. */
  #definition() {
    const name = this.#section.querySelector("#concept-name").value.trim();
    if (!name) throw new Error("give the concept a name");
    const body = { name };
    for (const side of ["positive", "negative"]) {
      body[side] = lines(this.#section.querySelector(`#concept-${side}`));
      const n = body[side].length;
      if (n < MIN_EXAMPLES || n > MAX_EXAMPLES) {
        throw new Error(`${n} ${side} example${n === 1 ? "" : "s"}: give ${MIN_EXAMPLES} to ${MAX_EXAMPLES}, one per line`);
      }
    }
    return body;
  }

  async #define() {
    const table = this.#section.querySelector(".table");
    table.hidden = true;
    let body;
    try {
      body = this.#definition();
    } catch (error) {
      this.#say(error.message, true);
      return;
    }
    this.#fitting = true;
    this.#sync();
    this.#say("fitting on the server…");
    try {
      const reply = await this.#client.request("DEFINE_CONCEPT", body);
      table.textContent = reply.table;
      table.hidden = false;
      this.#say(`defined ${reply.concept} (concepts version ${reply.version})`);
      await this.#refresh();
    } catch (error) {
      this.#say(error.message, true);
    } finally {
      this.#fitting = false;
      this.#sync();
    }
  }

  async #delete(name) {
    try {
      const reply = await this.#client.request("DELETE_CONCEPT", { name });
      this.#say(`deleted ${reply.concept} (concepts version ${reply.version})`);
      await this.#refresh();
    } catch (error) {
      this.#say(error.message, true);
    }
  }

  async #refresh() {
    this.#onChange(await this.#client.loadModelInfo());
  }

  #say(text, error = false) {
    const status = this.#section.querySelector(".status");
    status.textContent = text;
    status.classList.toggle("bad", error);
  }
}
