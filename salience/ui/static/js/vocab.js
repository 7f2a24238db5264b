// Token texts without a tokenizer in the browser: the server decodes them (DETOKENIZE).
//
// Each id is decoded alone, so a piece shows as the model sees it (" the", "\n"); texts are
// cached per model for the page's lifetime.

export class Vocab {
  #client;
  #texts = new Map(); // token id -> Promise<string>

  constructor(client) {
    this.#client = client;
  }

  /** @returns {Promise<string[]>} the text of each id, in order. */
  texts(ids) {
    return Promise.all(ids.map((id) => this.#text(id)));
  }

  #text(id) {
    let text = this.#texts.get(id);
    if (!text) {
      text = this.#client.request("DETOKENIZE", { tokens: [id] }).then((reply) => reply.text);
      text.catch(() => this.#texts.delete(id)); // ask again next time
      this.#texts.set(id, text);
    }
    return text;
  }
}

/** A token's text as a label: whitespace made visible, nothing invisible. */
export function showToken(text) {
  if (text === "") return "∅";
  return text.replaceAll(" ", "␣").replaceAll("\n", "↵").replaceAll("\t", "⇥");
}
