// Tokens without a tokenizer in the browser: the server decodes them (DETOKENIZE) and
// tokenizes texts (TOKENIZE).
//
// Each id is decoded alone, so a piece shows as the model sees it (" the", "\n"); texts and
// token lists are cached per model for the page's lifetime.

export class Vocab {
  #client;
  #texts = new Map(); // token id -> Promise<string>
  #ids = new Map(); // text -> Promise<number[]>

  constructor(client) {
    this.#client = client;
  }

  /** @returns {Promise<string[]>} the text of each id, in order. */
  texts(ids) {
    return Promise.all(ids.map((id) => this.#text(id)));
  }

  /** @returns {Promise<number[]>} the text's token ids, as TOKENIZE gives them (no special tokens). */
  ids(text) {
    let ids = this.#ids.get(text);
    if (!ids) {
      ids = this.#client.request("TOKENIZE", { text }).then((reply) => reply.tokens);
      ids.catch(() => this.#ids.delete(text));
      this.#ids.set(text, ids);
    }
    return ids;
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
