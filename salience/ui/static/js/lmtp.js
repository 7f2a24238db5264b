// An LMTP client for the browser: one WebSocket, many streams, automatic reconnect.
//
// Every message is one line `TYPE <json>`; the server answers with `TOKEN [...]` and
// `MSG [...]` frames whose payloads name their `stream_id`. This client routes TOKEN
// payloads to the stream that asked (GENERATE, SCORE) and MSG payloads to the request
// that asked (TOKENIZE, DETOKENIZE, MODEL_INFO, DEFINE_CONCEPT, DELETE_CONCEPT), and keeps
// one STATUS subscription open so the page always knows whether the model is loading, ready,
// draining or stopping.
//
// Connection states, reported as `state` events: connecting, loading, ready, draining, stopping,
// lost (will reconnect by itself), unauthorized (close code 4401: waits for a new token).

const STATUS_ID = 0;
const UNAUTHORIZED = 4401;
const RETRY_MS = [500, 1000, 2000, 4000];

export class LmtpError extends Error {}

/** A payload's `readout` as numbers: base64 of little-endian float32 ("readout_encoding": "f32",
 * NaN where a value is not available), or a JSON list; undefined where the payload has none. */
export function readoutValues(readout) {
  if (typeof readout !== "string") return readout;
  const bytes = Uint8Array.from(atob(readout), (c) => c.charCodeAt(0));
  const view = new DataView(bytes.buffer);
  return Array.from({ length: bytes.length / 4 }, (_, i) => view.getFloat32(4 * i, true));
}

export class LmtpClient extends EventTarget {
  #url;
  #ws = null;
  #nextId = 1;
  #streams = new Map(); // stream_id -> onPayload(payload)
  #requests = new Map(); // stream_id -> {resolve, reject}
  #retries = 0;
  #timer = null;
  state = "connecting";
  modelInfo = null;

  /** @param {() => string} url the WebSocket URL, asked again at every (re)connect. */
  constructor(url) {
    super();
    this.#url = url;
  }

  connect() {
    clearTimeout(this.#timer);
    if (this.#ws) {
      this.#ws.onclose = null;
      this.#ws.close();
      this.#failAll("connection replaced");
    }
    this.#setState("connecting");
    const ws = new WebSocket(this.#url());
    this.#ws = ws;
    ws.onopen = () => {
      this.#retries = 0;
      this.#send(`STATUS ${JSON.stringify({ stream_id: STATUS_ID })}`);
    };
    ws.onmessage = (event) => this.#receive(event.data);
    ws.onclose = (event) => this.#closed(event);
  }

  /** Start a GENERATE or SCORE stream; `onPayload` gets each TOKEN payload of it. */
  stream(type, body, onPayload) {
    const stream_id = this.#nextId++;
    this.#streams.set(stream_id, onPayload);
    this.#send(`${type} ${JSON.stringify({ ...body, stream_id })}`);
    return stream_id;
  }

  cancel(stream_id) {
    if (this.#streams.has(stream_id)) this.#send(`CANCEL ${JSON.stringify({ stream_id })}`);
  }

  /** Send a request answered by one MSG payload (TOKENIZE, DETOKENIZE, MODEL_INFO, DEFINE_CONCEPT, ...). */
  request(type, body) {
    const stream_id = this.#nextId++;
    return new Promise((resolve, reject) => {
      this.#requests.set(stream_id, { resolve, reject });
      this.#send(`${type} ${JSON.stringify({ ...body, stream_id })}`);
    });
  }

  /** Read MODEL_INFO into `modelInfo` (at every ready, and after the concept list changed); returns it. */
  async loadModelInfo() {
    this.modelInfo = (await this.request("MODEL_INFO", {})).model_info;
    return this.modelInfo;
  }

  #send(line) {
    if (this.#ws?.readyState !== WebSocket.OPEN) throw new LmtpError(`not connected (${this.state})`);
    this.#ws.send(line);
  }

  #receive(line) {
    const space = line.indexOf(" ");
    const type = line.slice(0, space);
    for (const payload of JSON.parse(line.slice(space + 1))) {
      if (type === "TOKEN") this.#token(payload);
      else this.#msg(payload);
    }
  }

  #token(payload) {
    const onPayload = this.#streams.get(payload.stream_id);
    if (payload.error != null || payload.finish_reason != null) this.#streams.delete(payload.stream_id);
    onPayload?.(payload);
  }

  #msg(payload) {
    if (payload.stream_id === STATUS_ID && payload.status) {
      this.#status(payload.status);
      return;
    }
    const pending = this.#requests.get(payload.stream_id);
    if (!pending) {
      if (payload.error) console.warn("LMTP:", payload.error);
      return;
    }
    this.#requests.delete(payload.stream_id);
    if (payload.error != null) pending.reject(new LmtpError(payload.error));
    else pending.resolve(payload);
  }

  async #status(status) {
    if (status !== "ready") {
      this.#setState(status);
      return;
    }
    try {
      await this.loadModelInfo();
    } catch {
      return; // the connection went away meanwhile; its close handler reports that
    }
    this.#setState("ready");
  }

  #closed(event) {
    this.#ws = null;
    this.#failAll("connection lost");
    if (event.code === UNAUTHORIZED) {
      this.#setState("unauthorized", event.reason.replace(/^unauthorized:?\s*/, ""));
      return;
    }
    const delay = RETRY_MS[Math.min(this.#retries++, RETRY_MS.length - 1)];
    this.#setState("lost", `reconnecting in ${delay / 1000} s`);
    this.#timer = setTimeout(() => this.connect(), delay);
  }

  #failAll(reason) {
    for (const [stream_id, onPayload] of this.#streams) onPayload({ stream_id, error: reason });
    for (const { reject } of this.#requests.values()) reject(new LmtpError(reason));
    this.#streams.clear();
    this.#requests.clear();
  }

  #setState(state, detail = "") {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, detail } }));
  }
}
