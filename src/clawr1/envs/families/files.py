"""The `terminal` env's family: file chores in a sandboxed directory.

Training chores: create a file, count lines, sort lines, upper-case a file. Held-out chores:
append a line, copy a file, count words, keep the lines that match a word. Each reference
solution is one shell command; the checker compares the resulting file exactly.
"""

from __future__ import annotations

import random

from clawr1.envs.families import Family, spell

WORDS = ("alpha", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper", "kestrel",
         "lagoon", "maple", "nectar", "orchid", "pebble")
FILES = ("notes", "list", "items", "log", "words", "names", "data", "todo")


def _lines(rng: random.Random, k: int) -> list[str]:
    return rng.sample(WORDS, k)


def file_chores(rng: random.Random, level: int, heldout: bool):
    src, dst = (f"{name}.txt" for name in rng.sample(FILES, 2))
    lines = _lines(rng, rng.randint(3, 7))
    body = "\n".join(lines) + "\n"
    chore = rng.choice(("append", "copy", "words", "grep") if heldout else ("create", "count", "sort", "upper"))
    files = {src: body}
    if chore == "create":
        text = " ".join(lines[:2])
        files = {}
        prompt, command, want = f"Create a file named {dst} that contains the text: {text}", \
            f"echo '{text}' > {dst}", text
    elif chore == "count":
        prompt, command, want = f"Count the lines of {src} and write only the number into {dst}.", \
            f"wc -l < {src} > {dst}", str(len(lines))
    elif chore == "sort":
        prompt, command, want = f"Sort the lines of {src} alphabetically and save the result in {dst}.", \
            f"sort {src} > {dst}", "\n".join(sorted(lines))
    elif chore == "upper":
        prompt, command, want = f"Write the contents of {src} in capital letters into {dst}.", \
            f"tr a-z A-Z < {src} > {dst}", "\n".join(line.upper() for line in lines)
    elif chore == "append":
        extra = rng.choice([w for w in WORDS if w not in lines])
        dst = src
        prompt, command, want = f"Add the word {extra} as a new last line of {src}.", \
            f"echo {extra} >> {src}", "\n".join([*lines, extra])
    elif chore == "copy":
        prompt, command, want = f"Make an exact copy of {src} called {dst}.", f"cp {src} {dst}", "\n".join(lines)
    elif chore == "words":
        files = {src: " ".join(lines[:3]) + "\n" + " ".join(lines[3:]) + "\n"}
        prompt, command, want = f"How many words are in {src}? Put just that number in {dst}.", \
            f"wc -w < {src} > {dst}", str(len(lines))
    else:  # grep
        letter = rng.choice(sorted({w[0] for w in lines}))
        kept = [w for w in lines if w.startswith(letter)]
        prompt = f"Keep only the lines of {src} that start with the letter {letter}, in a new file {dst}."
        command, want = f"grep '^{letter}' {src} > {dst}", "\n".join(kept)
    calls = [{"name": "run", "arguments": {"command": command}}]
    check = {"type": "file_equals", "path": dst, "text": want}
    return prompt + spell(level, calls, heldout), files, check, {"calls": calls, "answer": "done"}, f"files:{chore}"


FAMILIES = (
    Family("file-chores", "terminal", "shell file chores: create, count, sort, upper-case; held out: append, copy, "
           "count words, grep", file_chores, train_size=200, heldout_size=48),
)
