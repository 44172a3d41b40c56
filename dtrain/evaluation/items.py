"""A multiple-choice item: a context, its candidate continuations, and which one is right."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]  # continuations of the context, each non-empty
    answer: int  # index of the right choice

    def __post_init__(self):
        if len(self.choices) < 2 or not all(self.choices):
            raise ValueError(f"an item needs two or more non-empty choices: {self.choices!r}")
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"answer {self.answer} is not one of {len(self.choices)} choices")
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"an item's choices must differ: {self.choices!r}")


def shuffled_item(context: str, right: str, wrong: list[str], rng) -> Item:
    """The right choice among the wrong ones at a position drawn from `rng`."""
    choices = [right, *wrong]
    rng.shuffle(choices)
    return Item(context, tuple(choices), choices.index(right))
