// The chat view: the conversation as messages, each reply streaming in its turn, and the whole
// conversation sent with every turn as GENERATE `messages` (the server renders it with the model's
// chat template, docs/lmtp.md#chat-messages), so the page still needs no tokenizer.
//
// As in the REPL's chat mode: the system prompt, when given, goes first every time (changing it
// changes it for the whole conversation); the reply's end-of-turn token is not part of what the
// assistant said; a reply stopped after some text keeps that text; an exchange whose reply failed,
// or was stopped before it said anything, is left out of the conversation; Reset empties the
// conversation and keeps the system prompt.

import { ChatTurn } from "./turn.js";

export class ChatView {
  #section;
  #client;
  #vocab;
  #tip;
  #settings;
  #exchanges = []; // [{user, assistant}] in the conversation
  #system = ""; // the system prompt the kept exchanges were rendered with
  #next = 0; // where the next turn's new tokens begin (its readouts start there)
  #running = null; // the ChatTurn whose reply is streaming
  #ready = false;
  #epoch = 0; // counts resets: a reply that ends after one does not join the new conversation

  /** @param settings () => {params, topLogprobs, manifest, steer, monitors}, read at each send */
  constructor({ section, client, vocab, tip, settings }) {
    this.#section = section;
    this.#client = client;
    this.#vocab = vocab;
    this.#tip = tip;
    this.#settings = settings;
    const form = section.querySelector("form");
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.#send();
    });
    this.#message.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.#send();
      }
    });
    section.querySelector(".reset").addEventListener("click", () => this.#reset());
  }

  /** Send only while the server is ready. */
  enable(ready) {
    this.#ready = ready;
    this.#sync();
  }

  get #message() {
    return this.#section.querySelector("#message");
  }

  #sync() {
    this.#section.querySelector(".send").disabled = !this.#ready || this.#running !== null;
  }

  /** The request's messages: the system prompt, the conversation so far, and the new user turn. */
  #messages(system, user) {
    const messages = system ? [{ role: "system", content: system }] : [];
    for (const { user, assistant } of this.#exchanges) {
      messages.push({ role: "user", content: user }, { role: "assistant", content: assistant });
    }
    return [...messages, { role: "user", content: user }];
  }

  async #send() {
    const user = this.#message.value.trim();
    if (!user || !this.#ready || this.#running) return;
    const system = this.#section.querySelector("#system").value.trim();
    // A new system prompt renders every earlier turn anew: read this turn from the start.
    const from = system === this.#system ? this.#next : 0;
    const turn = new ChatTurn({ client: this.#client, vocab: this.#vocab, tip: this.#tip, user, settings: this.#settings(), from });
    this.#section.querySelector(".conversation").append(turn.element);
    this.#message.value = "";
    this.#running = turn;
    this.#sync();
    const epoch = this.#epoch;
    const reply = await turn.run(this.#messages(system, user));
    if (this.#running === turn) this.#running = null;
    this.#sync();
    if (epoch !== this.#epoch) return;
    if (reply) {
      this.#exchanges.push({ user, assistant: reply.text });
      this.#system = system;
      this.#next = reply.end;
    } else if (this.#message.value === "") {
      this.#message.value = user; // to ask again
    }
  }

  #reset() {
    this.#running?.stop();
    this.#running = null;
    this.#epoch++;
    this.#exchanges = [];
    this.#next = 0;
    this.#section.querySelector(".conversation").replaceChildren();
    this.#sync();
  }
}
