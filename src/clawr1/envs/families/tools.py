"""Families of the `toolcall` env: calculator arithmetic, word problems, key-value chores,
search-then-answer and multi-step combinations of two or three tools.

Every maker returns (prompt, files, check, solution, template). Training and held-out templates
are separate lists; a maker picks from the list of its split, and the level decides how much of
the call is spelled out (0: the exact call, 1: the tool's name, 2: nothing).
"""

from __future__ import annotations

import random
from typing import Any

from clawr1.envs.calculator import calculate, format_number
from clawr1.envs.families import Family, spell

NAMES = ("Ana", "Ben", "Chloe", "Dev", "Eli", "Farah", "Gus", "Hana", "Ivo", "June", "Kofi", "Lena")
ITEMS = ("pencils", "apples", "tickets", "stamps", "candles", "bolts", "cups", "notebooks")
KEYS = ("color", "city", "pet", "team", "plan", "status", "owner", "size", "mode", "room")
VALUES = ("blue", "green", "Lisbon", "Oslo", "cat", "parrot", "red team", "draft", "done", "large", "quiet",
          "room 12", "amber", "ready")


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def _answer(value: str) -> dict[str, Any]:
    return {"type": "answer_contains", "text": value, "whole_word": True}


def _solution(calls: list[dict[str, Any]], answer: str) -> dict[str, Any]:
    return {"calls": calls, "answer": answer}


def _value(expr: str) -> str:
    return format_number(calculate(expr))


# -- arithmetic ---------------------------------------------------------------------------------

_ARITH_TRAIN = (("What is {e}?", "sum"), ("Compute {e}.", "product"), ("Work out {e} for me.", "mixed"))
_ARITH_HELDOUT = (("I need the value of {e}. What is it?", "difference"), ("How much is {e}?", "grouped"),
                  ("Please evaluate {e} and tell me the result.", "mixed"))


def _expression(rng: random.Random, shape: str) -> str:
    a, b, c = rng.randint(12, 99), rng.randint(3, 49), rng.randint(2, 9)
    return {"sum": f"{a} + {b * 7}", "product": f"{a} * {b}", "mixed": f"{a} * {c} + {b}",
            "difference": f"{a * c} - {b}", "grouped": f"({a} + {b}) * {c}"}[shape]


def arithmetic(rng: random.Random, level: int, heldout: bool):
    wording, shape = rng.choice(_ARITH_HELDOUT if heldout else _ARITH_TRAIN)
    expr = _expression(rng, shape)
    value, calls = _value(expr), [_call("calculator", expression=expr)]
    prompt = wording.format(e=expr) + spell(level, calls, heldout)
    return prompt, {}, _answer(value), _solution(calls, value), f"arith:{wording}"


# -- word problems ------------------------------------------------------------------------------

def _story(rng: random.Random, heldout: bool) -> tuple[str, str, str]:
    """(story, expression, template) from the split's stories."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, n = rng.randint(20, 90), rng.randint(2, 19), rng.randint(3, 12)
    train = [
        (f"A shop sells {item} at {b} dollars each. {name} buys {n} of them. How many dollars does {name} pay?",
         f"{b} * {n}", "shop"),
        (f"{name} has {a} {item} and gives {b} away. How many {item} does {name} have left?", f"{a} - {b}", "give"),
        (f"A train runs at {a} km per hour for {n} hours. How many km does it travel?", f"{a} * {n}", "train"),
        (f"{name} reads {b} pages a day for {n} days. How many pages is that?", f"{b} * {n}", "pages"),
    ]
    held = [
        (f"Each box holds {n} {item}. How many {item} fit in {b} boxes?", f"{n} * {b}", "boxes"),
        (f"{name} saved {a} dollars in March and {b} dollars in April. How much did {name} save in total?",
         f"{a} + {b}", "savings"),
        (f"A recipe needs {b} grams of sugar per cake. How many grams for {n} cakes, plus {a} grams for icing?",
         f"{b} * {n} + {a}", "recipe"),
    ]
    return rng.choice(held if heldout else train)


def word_problems(rng: random.Random, level: int, heldout: bool):
    story, expr, template = _story(rng, heldout)
    value, calls = _value(expr), [_call("calculator", expression=expr)]
    prompt = story + spell(level, calls, heldout)
    return prompt, {}, _answer(value), _solution(calls, value), f"word:{template}"


# -- key-value chores ---------------------------------------------------------------------------

def kv_chores(rng: random.Random, level: int, heldout: bool):
    k1, k2 = rng.sample(KEYS, 2)
    v1, v2 = rng.sample(VALUES, 2)
    store = {k1: v1, rng.choice([k for k in KEYS if k not in (k1, k2)]): rng.choice(VALUES)}
    chores = ("copy", "rename", "save") if heldout else ("set", "delete", "update")
    chore = rng.choice(chores)
    if chore in ("set", "save"):
        text = (f"Store the value '{v2}' under the key '{k2}'." if chore == "set"
                else f"Please remember that my {k2} is '{v2}'; save it in the store under '{k2}'.")
        calls, check = [_call("kv_set", key=k2, value=v2)], {"type": "kv_equals", "key": k2, "value": v2}
    elif chore == "delete":
        text = f"Remove the key '{k1}' from the store."
        calls, check = [_call("kv_delete", key=k1)], {"type": "kv_equals", "key": k1, "value": None}
    elif chore == "update":
        text = f"The store has '{k1}' set to '{v1}'. Change it to '{v2}'."
        calls, check = [_call("kv_set", key=k1, value=v2)], {"type": "kv_equals", "key": k1, "value": v2}
    elif chore == "copy":
        text = f"Copy whatever is stored under '{k1}' into a new key '{k2}' (keep '{k1}' as it is)."
        calls = [_call("kv_get", key=k1), _call("kv_set", key=k2, value=v1)]
        check = {"type": "all", "checks": [{"type": "kv_equals", "key": k2, "value": v1},
                                           {"type": "kv_equals", "key": k1, "value": v1}]}
    else:  # rename
        text = f"Rename the key '{k1}' to '{k2}': same value, and '{k1}' should be gone afterwards."
        calls = [_call("kv_get", key=k1), _call("kv_set", key=k2, value=v1), _call("kv_delete", key=k1)]
        check = {"type": "all", "checks": [{"type": "kv_equals", "key": k2, "value": v1},
                                           {"type": "kv_equals", "key": k1, "value": None}]}
    return text + spell(level, calls, heldout), store, check, _solution(calls, "done"), f"kv:{chore}"


# -- search, then answer ------------------------------------------------------------------------

#: (question about, answer, search words): facts of the shipped corpus. The first 12 train, the
#: rest are held out, so a held-out question is never one a trained model has seen answered.
FACTS = (
    ("the capital of Veloria", "Mirenth", "Veloria capital"),
    ("the year the Quillon engine was invented", "1871", "Quillon engine"),
    ("the length of the Tesk River in kilometres", "214", "Tesk River"),
    ("how long the Zephyr-9 drone can fly, in minutes", "42", "Zephyr-9 drone"),
    ("the year Orbit Cafe was founded", "2009", "Orbit Cafe"),
    ("the Pellan word for hello", "sorra", "Pellan hello"),
    ("the height of Mount Kelvo in metres", "2,845", "Mount Kelvo"),
    ("the national bird of Veloria", "tern", "national bird Veloria"),
    ("the month of the Mirenth lantern festival", "April", "lantern festival"),
    ("the temperature at which zorium melts", "1290", "zorium melts"),
    ("who created the Python programming language", "Guido", "Python programming language"),
    ("how many minutes marrow tea is brewed", "seven", "marrow tea"),
    ("who invented the Quillon engine", "Ada Brenner", "Quillon engine invented"),
    ("the year Mount Kelvo was first climbed", "1902", "Mount Kelvo climbed"),
    ("the currency of Veloria", "crown", "currency Veloria"),
    ("the most popular drink at Orbit Cafe", "cardamom latte", "Orbit Cafe drink"),
    ("the date of Harbour Day", "14th of June", "Harbour Day"),
    ("the battery capacity of the Zephyr-9 in mAh", "5200", "Zephyr-9 battery"),
    ("what the lumen fox eats", "beetles", "lumen fox eats"),
)
_SPLIT_FACTS = 12
_ASK_TRAIN = ("What is {q}?", "Tell me {q}.", "Find out {q}.", "Quick question: what is {q}?",
              "I'd like to know {q}.", "Please answer this: what is {q}?", "Give me {q}, please.")
_ASK_HELDOUT = ("I'm curious: do you know {q}?", "Could you look up {q} for me?")


def search_answer(rng: random.Random, level: int, heldout: bool):
    about, answer, words = rng.choice(FACTS[_SPLIT_FACTS:] if heldout else FACTS[:_SPLIT_FACTS])
    wording = rng.choice(_ASK_HELDOUT if heldout else _ASK_TRAIN)
    calls = [_call("search", query=words)]
    prompt = wording.format(q=about) + spell(level, calls, heldout)
    # whole words: "western gull" does not name the "tern", nor "420" the "42"
    return prompt, {}, _answer(answer), _solution(calls, answer), f"search:{wording}"


# -- multi-step: two or three tools -------------------------------------------------------------

def multi_step(rng: random.Random, level: int, heldout: bool):
    key, key2, out = rng.sample(("price", "total", "budget", "count", "score", "result", "stock"), 3)
    a, b, n = rng.randint(12, 80), rng.randint(5, 40), rng.randint(2, 9)
    kind = rng.choice(("sum-of-keys", "search-store") if heldout else ("compute-store", "read-compute"))
    if kind == "compute-store":
        expr = f"{a} * {n}"
        value = str(a * n)
        text = f"Work out {expr} and store the result under the key '{out}'."
        calls = [_call("calculator", expression=expr), _call("kv_set", key=out, value=value)]
        files, check, answer = {}, {"type": "kv_equals", "key": out, "value": value}, value
    elif kind == "read-compute":
        expr = f"{a} * {n}"
        value = str(a * n)
        text = f"The store holds the price of one ticket under '{key}'. What do {n} tickets cost?"
        calls = [_call("kv_get", key=key), _call("calculator", expression=expr)]
        files, check, answer = {key: str(a)}, _answer(value), value
    elif kind == "sum-of-keys":
        expr = f"{a} + {b}"
        value = str(a + b)
        text = f"Add up the numbers stored under '{key}' and '{key2}', and save the sum under '{out}'."
        calls = [_call("kv_get", key=key), _call("kv_get", key=key2), _call("calculator", expression=expr),
                 _call("kv_set", key=out, value=value)]
        files, check, answer = {key: str(a), key2: str(b)}, {"type": "kv_equals", "key": out, "value": value}, value
    else:  # search-store
        about, value, words = rng.choice(FACTS[_SPLIT_FACTS:])
        text = f"Find {about} in the documents and keep it in the store under the key '{out}'."
        calls = [_call("search", query=words), _call("kv_set", key=out, value=value)]
        files, check, answer = {}, {"type": "kv_equals", "key": out, "value": value}, value
    return text + spell(level, calls, heldout), files, check, _solution(calls, answer), f"multi:{kind}"


# One family, one kind of tool (multi-step offers all: choosing among them is part of its task).
_CALC, _STORE = ("calculator",), ("kv_set", "kv_get", "kv_delete", "kv_list")
FAMILIES = (
    Family("arithmetic", "toolcall", "calculator arithmetic: sums, products, mixed and grouped expressions",
           arithmetic, tools=_CALC),
    Family("word-problems", "toolcall", "word problems for the calculator: shops, trains, boxes, recipes",
           word_problems, tools=_CALC),
    Family("kv-chores", "toolcall", "key-value store chores: set, update, delete; held out: copy, rename, save",
           kv_chores, tools=_STORE),
    Family("search-answer", "toolcall", "search the shipped documents, then answer (held-out facts are new)",
           search_answer, train_size=200, tools=("search",)),
    Family("multi-step", "toolcall", "two to four tool calls: calculator+store, store+calculator; held out: "
           "sum of two keys, search+store", multi_step),
)
