"""Run under LMQL 0.7.3's own environment (tools/lmql_env.py), against a Salience server.

usage: python lmql_queries.py ENDPOINT MODEL_NAME TOKENIZER_DIR  -> one JSON line of results
"""

import asyncio
import json
import sys

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


async def main() -> None:
    answer, chosen = await asyncio.gather(capital(), colour())
    scored = await lmql.score("The colour of the clear sky is", [" blue", " green"], model=model)
    print(
        json.dumps(
            {
                "capital": answer,
                "colour": chosen,
                "score_tokens": [list(map(float, s)) for s in scored.token_scores],
            }
        )
    )


asyncio.run(main())
