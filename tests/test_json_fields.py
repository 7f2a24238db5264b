"""JSON leaves and their tokens (core/probes/json_fields.py), checked against `json.loads` of the
same text: every scalar of the parsed document has exactly one leaf, at its path, whose characters
parse back to it."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from salience.core.probes.json_fields import Cursor, Leaf, Span, leaves, path, pattern, spans


def parsed_leaves(value: Any, steps: tuple = ()) -> list[tuple[str, Any]]:
    """(path, value) of each scalar of a parsed document, in document order."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in parsed_leaves(item, (*steps, key))]
    if isinstance(value, list):
        return [leaf for i, item in enumerate(value) for leaf in parsed_leaves(item, (*steps, i))]
    return [(path(steps), value)]


def value_at(text: str, leaf: Leaf) -> Any:
    """The leaf's value read back from its characters (a string's quotes sit just outside them)."""
    if text[leaf.start - 1 : leaf.start] == '"' and text[leaf.end : leaf.end + 1] == '"':
        return json.loads(text[leaf.start - 1 : leaf.end + 1])
    return json.loads(text[leaf.start : leaf.end])


DOCUMENTS = [
    '{"city": "Paris", "population": 2102650, "capital": true, "mayor": null}',
    '{"a": {"b": {"c": [1, 2.5e-3, -0, {"d": false}]}}, "e": []}',
    '  [ "x" , [ [ ] , [ 3 ] ] , { } , "y" ]\n',
    r"""{"quote \"k\"": "a \"b\" \\ c \u00e9\n", "two words": "x", "": 1, "it's": 2}""",
    '{"name": "Zürich 😀", "日本": ["東京", "大阪"], "n": -12.75E+2}',
    '"a bare string"',
    "42",
    "null",
    '{"items": [{"name": "a", "tags": ["x", "y"]}, {"name": "b", "tags": []}]}',
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_leaves_match_json_loads(text: str) -> None:
    found = leaves(text)
    assert [leaf.path for leaf in found] == [p for p, _ in parsed_leaves(json.loads(text))]
    for leaf, (_, value) in zip(found, parsed_leaves(json.loads(text)), strict=True):
        assert value_at(text, leaf) == value
        assert type(value_at(text, leaf)) is type(value)


def test_paths_use_jsonpath_and_bracket_names_that_are_not_identifiers() -> None:
    assert path(()) == "$"
    assert path(("items", 2, "name")) == "$.items[2].name"
    assert path(("two words", "it's", "a\\b", "_x1", "")) == "$['two words']['it\\'s']['a\\\\b']._x1['']"
    text = DOCUMENTS[3]
    assert [leaf.path for leaf in leaves(text)] == ["$['quote \"k\"']", "$['two words']", "$['']", "$['it\\'s']"]


def test_a_string_excludes_its_quotes_and_keeps_its_escapes_as_written() -> None:
    text = r'{"s": "a\"b\u00e9", "t": ""}'
    s, t = leaves(text)
    assert text[s.start : s.end] == r"a\"b\u00e9"
    assert (t.start, t.end) == (text.index('""') + 1, text.index('""') + 1)


def test_multibyte_characters_count_as_characters() -> None:
    text = '{"é": "😀x", "n": 1}'
    emoji, n = leaves(text)
    assert text[emoji.start : emoji.end] == "😀x" and text[n.start : n.end] == "1"
    assert emoji.path == "$['é']"


@pytest.mark.parametrize(
    ("text", "complete"),
    [
        ('{"a": "done", "b": "cut sh', ["$.a"]),  # max_tokens in a string
        ('{"a": 1, "b": 12', ["$.a"]),  # a number at the end of an open document may go on
        ('{"a": [true, fal', ["$.a[0]"]),
        ('{"a": 1} trailing', ["$.a"]),  # what follows the document is not read
        ('{"a" 1}', []),  # not JSON from there on
        ('{"a": 1,, "b": 2}', ["$.a"]),
        ("[1, 2", ["$[0]"]),
        ("", []),
        ("-", []),
        ("12", ["$"]),  # a whole document that is a number
    ],
)
def test_a_cut_or_broken_document_keeps_the_leaves_it_completed(text: str, complete: list[str]) -> None:
    assert [leaf.path for leaf in leaves(text)] == complete


def test_deep_nesting_needs_no_recursion() -> None:
    text = "[" * 5000 + "7" + "]" * 5000
    (leaf,) = leaves(text)
    assert leaf.path == "$" + "[0]" * 5000 and text[leaf.start : leaf.end] == "7"


def test_tokens_are_those_holding_a_character_of_the_value() -> None:
    # A token straddles the key and the value ('":"P'), another the value's end and the next key.
    texts = ['{"', "city", '":"P', "aris", '","', "n", '":', "4", "2", "}", ""]
    text = "".join(texts)
    city, n = spans(leaves(text), texts)
    assert (city.leaf.path, city.first, city.last) == ("$.city", 2, 3)
    assert text[city.leaf.start : city.leaf.end] == "Paris" in "".join(texts[city.first : city.last + 1])
    assert (n.leaf.path, n.first, n.last) == ("$.n", 7, 8)


def test_a_token_without_text_holds_no_character_and_an_empty_string_no_token() -> None:
    # A character split over two tokens: the first adds no text (the detokenizer waits for the
    # rest), so it holds none of the value; the value's first token is the one that completes it.
    texts = ['{"a": "', "", "é", "b", '", "e": "', '"}']
    text = "".join(texts)
    a, e = spans(leaves(text), texts)
    assert (a.first, a.last) == (2, 3)
    assert e == Span(Leaf("$.e", text.index('""') + 1, text.index('""') + 1), None, None)


def test_one_token_may_hold_several_leaves() -> None:
    texts = ['{"a":', " [1, 2, 3]", "}"]
    found = spans(leaves("".join(texts)), texts)
    assert [(s.leaf.path, s.first, s.last) for s in found] == [("$.a[0]", 1, 1), ("$.a[1]", 1, 1), ("$.a[2]", 1, 1)]


def pieces(text: str, seed: int) -> list[str]:
    """`text` cut into random pieces of 0 to 4 characters, as tokens' texts."""
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < len(text):
        size = rng.randint(0, 4)
        out.append(text[pos : pos + size])
        pos += size
    return out


@pytest.mark.parametrize("text", [d for d in DOCUMENTS if d.lstrip()[0] in "{["])
@pytest.mark.parametrize("seed", range(5))
def test_a_cursor_fed_token_by_token_finds_each_tokens_leaves_as_the_whole_scan_does(text: str, seed: int) -> None:
    texts = pieces(text, seed)
    cursor = Cursor()
    fed = [set(cursor.feed(piece)) for piece in texts]
    holding: list[set[str]] = [set() for _ in texts]
    for span in spans(leaves(text), texts):
        for i in range(span.first, span.last + 1) if span.first is not None else ():
            if texts[i]:  # a token without text, between two of the value's, holds none of it
                holding[i].add(span.leaf.path)
    assert fed == holding


def test_a_cursor_names_the_value_being_written() -> None:
    cursor = Cursor()
    assert [cursor.feed(piece) for piece in ['{"n": 1', "2", ', "s": "a', "b", '", "t": tr', "ue}"]] == [
        ("$.n",),
        ("$.n",),
        ("$.s",),  # its comma ends the number, whose characters came before
        ("$.s",),
        ("$.t",),
        ("$.t",),
    ]


@pytest.mark.parametrize(
    ("query", "inside", "outside"),
    [
        ("$.city", ["$.city"], ["$.city_name", "$.cities[0]", "$.x.city"]),
        ("$.items[2].name", ["$.items[2].name"], ["$.items[1].name", "$.items[2].names"]),
        ("$.items[*].name", ["$.items[0].name", "$.items[12].name"], ["$.items[0].tags[0]", "$.name"]),
        ("$.items", ["$.items[0].name", "$.items[3]"], ["$.itemsx", "$.x.items[0]"]),
        ("$['two words']", ["$['two words']", "$['two words'].a"], ["$['two words x']"]),
        ("$['city']", ["$.city"], ["$.cityx"]),
        ('$["it\'s"]', ["$['it\\'s']"], ["$.its"]),
        ("$.*.id", ["$.a.id", "$['b c'].id"], ["$[0].id", "$.a.b.id"]),
        ("$", ["$", "$.a", "$[0]"], []),
    ],
)
def test_a_pattern_names_a_leaf_or_the_leaves_under_a_container(query: str, inside: list, outside: list) -> None:
    found = pattern(query)
    assert all(found.match(p) for p in inside) and not any(found.match(p) for p in outside)


@pytest.mark.parametrize("query", ["city", "$.", "$[x]", "$.a b", "$['a]", "$..a", '$["a\\x"]'])
def test_a_bad_pattern_is_a_value_error(query: str) -> None:
    with pytest.raises(ValueError):
        pattern(query)
