"""The OpenAI API over HTTP, on the LMTP port (docs/openai.md).

Sans-IO protocol modules: requests.py (a body to an ApiRequest), extension.py (the `salience`
object), tools.py (`tools` and `tool_choice`), choices.py and readings.py (one choice's tokens to
text, finish and extension output), tool_calls.py (the calls in a reply),
responses.py (chunks and responses as bytes), errors.py (OpenAI's error object, and Salience's
errors as HTTP statuses); run.py drives the core engine; app.py is the aiohttp adapter. The
Responses API: responses_api.py (a body to a chat ApiRequest and its own fields),
response_events.py (response objects and stream events as bytes), response_store.py (stored
responses as sessions), responses_http.py (a response run on the chat path and answered).
"""
