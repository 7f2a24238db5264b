"""Eight LMQL queries of the kinds LMQL users write, timed one by one. Runs under LMQL 0.7.3's
own environment (tools/lmql_env.py), against any LMTP server; has no Salience import.

usage: python lmql_suite.py ENDPOINT MODEL_NAME TOKENIZER_DIR  -> one JSON line:
       {"queries": {query: [answer, seconds], ...}, "cpu_seconds": this process's CPU time}

Every query decodes greedily (or scores), so two servers on the same weights must give the
same answers. tests/lmtp/test_lmql.py checks three of them against the engine itself.
"""

import asyncio
import json
import resource
import sys
import time

import lmql

endpoint, name, tokenizer = sys.argv[1:4]
model = lmql.model(name, endpoint=endpoint, tokenizer=tokenizer)


@lmql.query(model=model, decoder="argmax")
async def capital():
    """lmql
    "Q: What is the capital of France?\nA:[ANSWER]" where STOPS_AT(ANSWER, "\n") and len(TOKENS(ANSWER)) < 10
    return ANSWER
    """


@lmql.query(model=model, decoder="argmax")
async def colour():
    """lmql
    "The colour of the clear sky is[COLOUR]" where COLOUR in [" blue", " green", " red"]
    return COLOUR
    """


@lmql.query(model=model, decoder="argmax")
async def fruits():
    """lmql
    "A list of three fruits:\n"
    items = []
    for i in range(3):
        "-[FRUIT]" where STOPS_AT(FRUIT, "\n") and len(TOKENS(FRUIT)) < 8
        items.append(FRUIT.strip())
    return items
    """


@lmql.query(model=model, decoder="argmax")
async def legs():
    """lmql
    "Q: How many legs does a spider have?\nA: [N]" where INT(N) and len(TOKENS(N)) < 4
    return N
    """


@lmql.query(model=model, decoder="argmax")
async def sentiment():
    """lmql
    "Review: Cold soup and a rude waiter.\nSentiment:[LABEL]" where LABEL in [" positive", " negative", " neutral"]
    return LABEL
    """


@lmql.query(model=model, decoder="argmax")
async def poem():
    """lmql
    "Write a short poem about the sea.\n\n[POEM]" where len(TOKENS(POEM)) < 40
    return POEM
    """


@lmql.query(model=model, decoder="argmax")
async def person():
    """lmql
    "Alice is thirty years old and lives in Paris.\n"
    "Name:[NAME]" where STOPS_AT(NAME, "\n") and len(TOKENS(NAME)) < 6
    "Age:[AGE]" where STOPS_AT(AGE, "\n") and len(TOKENS(AGE)) < 4
    "City:[CITY]" where STOPS_AT(CITY, "\n") and len(TOKENS(CITY)) < 6
    return [NAME.strip(), AGE.strip(), CITY.strip()]
    """


async def score():
    scored = await lmql.score("The colour of the clear sky is", [" blue", " green"], model=model)
    return [[round(float(s), 4) for s in token_scores] for token_scores in scored.token_scores]


QUERIES = [capital, colour, fruits, legs, sentiment, poem, person, score]


async def main() -> None:
    results = {}
    used = resource.getrusage(resource.RUSAGE_SELF)
    before = used.ru_utime + used.ru_stime
    for query in QUERIES:
        started = time.perf_counter()
        answer = await query()
        results[query.__name__] = [answer, time.perf_counter() - started]
    used = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"queries": results, "cpu_seconds": used.ru_utime + used.ru_stime - before}))


asyncio.run(main())
