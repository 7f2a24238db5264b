// One exchange of the chat view: the user's message, and the assistant's reply streaming into
// token cells with its own heatmap, Stop, error and monitor events (a StreamView, as a pane has).
//
// The LMTP exchange of a turn; the whole conversation goes each time and the server renders it:
//   GENERATE {"messages": [{"role", "content"}, ...], "text": true, "top_logprobs": k,
//             "readout": [[from, 1000000]], "steer"?, "monitors"?, ...sampling}
//     -> TOKEN {"prompt_ids": [...]}                   the conversation as the template rendered it
//     -> TOKEN {"prompt": true, "position", "readout"} per prompt position from `from`, first
//     -> TOKEN {"token", "text", "logprob", ...}       per reply token, the last one the model's
//                                                      end-of-turn token (finish_reason "stop")
//   TOKENIZE {"text": content}  once per message text: where its words sit in prompt_ids; the
//                               prompt tokens no message holds are the template's own
// `from` is where this turn's new tokens begin: the previous turn's prompt_ids and reply, counted
// in tokens. Reading only from there leaves the earlier turns to vLLM's prefix cache, which a pass
// that reads a position cannot use for it (docs/readouts.md, "Prefix cache").

import { Heatmap } from "./heatmap.js";
import { StreamView } from "./stream.js";
import { TokenStrip } from "./tokens.js";

const READ_ALL = 1_000_000; // a readout range may run past the prompt: every position from `from`

/**
 * The role of each prompt position: that of the message whose content holds it, or "template" for
 * the chat template's own tokens (role markers, separators, a default system prompt the template
 * adds). Each message's content, tokenized alone (`contents[i]`), is looked for in `promptIds` in
 * order, each after the one before. Null when one is not found (a template that rewrites content, or
 * tokenizes it differently in context): better no marks than a message's words marked as template.
 */
export function roles(promptIds, messages, contents) {
  const marked = promptIds.map(() => "template");
  let at = 0;
  for (const [i, ids] of contents.entries()) {
    if (ids.length === 0) continue;
    const found = indexOf(promptIds, ids, at);
    if (found < 0) return null;
    marked.fill(messages[i].role, found, found + ids.length);
    at = found + ids.length;
  }
  return marked;
}

function indexOf(haystack, needle, from) {
  search: for (let i = from; i + needle.length <= haystack.length; i++) {
    for (let j = 0; j < needle.length; j++) if (haystack[i + j] !== needle[j]) continue search;
    return i;
  }
  return -1;
}

/** A reply's token that ends the turn: its text is the template's marker, not the assistant's words. */
const endOfTurn = (payload) => payload.finish_reason === "stop" && payload.token != null;

export class ChatTurn {
  #vocab;
  #settings;
  #from;
  #stream;
  #heatmap = null;

  /**
   * @param user the user's message; @param from the position this turn's readouts start at
   * @param settings {{params, topLogprobs, manifest, steer, monitors}} as a completion pane's request
   */
  constructor({ client, vocab, tip, user, settings, from }) {
    this.#vocab = vocab;
    this.#settings = settings;
    this.#from = from;
    this.element = document.createElement("li");
    this.element.className = "exchange";
    this.element.innerHTML = `
      <div class="message user"><p class="role">user</p><p class="content"></p></div>
      <div class="message assistant">
        <header><p class="role">assistant</p><span class="state" role="status"></span>
          <button type="button" class="stop" disabled>Stop</button></header>
        <p class="steered" hidden></p>
        <p class="error" role="alert" hidden></p>
        <div class="stream" aria-label="reply"></div>
        <ul class="monitor-events" aria-label="monitor events" hidden></ul>
        <p class="note" hidden></p>
        <details class="protocol"><summary>LMTP messages sent</summary><pre></pre></details>
      </div>`;
    this.element.querySelector(".user .content").textContent = user;
    const stream = this.element.querySelector(".stream");
    const strip = new TokenStrip(stream, vocab, tip);
    if (settings.manifest) {
      this.#heatmap = new Heatmap(settings.manifest);
      stream.after(this.#heatmap.element);
    }
    this.#stream = new StreamView({ client, element: this.element, strip, heatmap: this.#heatmap });
    this.#stream.steered(settings.steer);
  }

  /**
   * Send the conversation and stream the reply. Resolves with `{text, end}` when the exchange joins
   * the conversation (`end`: the position after the reply's last token), null when it does not: an
   * error, or a reply stopped before it said anything.
   */
  async run(messages) {
    const { params, topLogprobs, steer, monitors } = this.#settings;
    const body = { messages, ...params, top_logprobs: topLogprobs, text: true };
    if (this.#heatmap) body.readout = [[this.#from, READ_ALL]];
    if (steer.length) body.steer = steer;
    if (monitors.length) body.monitors = monitors;
    let prompt = null;
    let text = "";
    let tokens = 0;
    const onPayload = (payload) => {
      if (payload.prompt_ids) {
        prompt = payload.prompt_ids;
        if (this.#heatmap) this.#label(prompt, messages);
      } else if (payload.token != null && !payload.prompt) {
        tokens++;
        if (!endOfTurn(payload)) text += payload.text;
      }
    };
    let last;
    try {
      last = await this.#stream.start("GENERATE", body, { onPayload, showEnd: false });
    } catch (error) {
      this.#stream.fail(error.message); // not connected
      last = { error: error.message };
    }
    const kept = last.error == null && prompt !== null && (last.finish_reason !== "cancelled" || text !== "");
    if (!kept) this.#note("left out of the conversation: the next turn does not send this exchange");
    this.element.classList.toggle("dropped", !kept);
    return kept ? { text, end: prompt.length + tokens } : null;
  }

  stop() {
    this.#stream.stop();
  }

  /** Label the heatmap's prompt columns (from `from`) with their text and role. */
  async #label(prompt, messages) {
    let texts, contents;
    try {
      [texts, contents] = await Promise.all([
        this.#vocab.texts(prompt.slice(this.#from)),
        Promise.all(messages.map((message) => this.#vocab.ids(message.content))),
      ]);
    } catch {
      return; // connection lost: the stream's error says so
    }
    const marked = roles(prompt, messages, contents);
    if (!marked) this.#note("role tokens not marked: a message's tokens were not found in the rendered prompt");
    texts.forEach((label, i) => {
      const position = this.#from + i;
      this.#heatmap.set(position, { label, prompt: true, role: marked?.[position] });
    });
  }

  #note(text) {
    const note = this.element.querySelector(".note");
    note.hidden = false;
    note.textContent = text;
  }
}
