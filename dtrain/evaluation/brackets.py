"""brackets: which bracket closes an unfinished Python expression.

Generated from a seed: nested calls, subscripts, lists and dicts of names and numbers, cut
where the innermost bracket is still open; the choices are ")", "]" and "}". The right one is
known by construction (the innermost open bracket's partner), and the training code of the
default data is full of them, so a model that learns it scores above chance (1/3).
"""

from __future__ import annotations

import random

from dtrain.evaluation.items import Item, shuffled_item

NAMES = ("x", "self", "data", "items", "key", "value", "args", "result", "name", "path", "i")
FUNCS = ("len", "str", "int", "list", "sorted", "print", "max", "min", "self.get", "os.path.join")
CLOSE = {"(": ")", "[": "]", "{": "}"}


def _atom(rng: random.Random) -> str:
    return rng.choice(NAMES) if rng.random() < 0.7 else str(rng.randrange(100))


def _opening(rng: random.Random, depth: int) -> tuple[str, str]:
    """The text that opens one more bracket, and that bracket."""
    kind = rng.choice("([{") if depth else rng.choice("([")
    if kind == "(":
        return f"{rng.choice(FUNCS)}(", "("
    if kind == "[":
        return (f"{rng.choice(NAMES)}[", "[") if rng.random() < 0.5 else ("[", "[")
    return f"{{{_atom(rng)!r}: ".replace("'", '"'), "{"


def _expression(rng: random.Random) -> tuple[str, str]:
    """An expression with 1 to 3 brackets open, ending inside the innermost; its closer."""
    text, stack = "", []
    for depth in range(rng.randint(1, 3)):
        opened, bracket = _opening(rng, depth)
        text += opened
        stack.append(bracket)
        if rng.random() < 0.5:  # an argument or element before the next bracket opens
            text += f"{_atom(rng)}, "
    text += _atom(rng)
    return text, CLOSE[stack[-1]]


def brackets(n: int, seed: int) -> list[Item]:
    rng = random.Random(f"brackets-{seed}")
    out = []
    for _ in range(n):
        expr, closer = _expression(rng)
        context = f"{rng.choice(NAMES)} = {expr}"
        wrong = [c for c in CLOSE.values() if c != closer]
        out.append(shuffled_item(context, closer, wrong, rng))
    return out
