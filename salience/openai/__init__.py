"""The OpenAI API over HTTP, on the LMTP port (docs/openai.md).

Sans-IO protocol modules: requests.py (a body to an ApiRequest), extension.py (the `salience`
object), choices.py and readings.py (one choice's tokens to text, finish and extension output),
responses.py (chunks and responses as bytes), errors.py (OpenAI's error object, and Salience's
errors as HTTP statuses); run.py drives the core engine; app.py is the aiohttp adapter.
"""
