"""The embedded corpus: short children's stories generated from a small hand-written grammar. Torch-free.

Deterministic: the stories come from `random.Random` with a fixed seed (whose integer seeding and `choice` are
the same across Python versions) over lists, never sets, so every process and machine makes the same text.
The first n stories do not depend on how many are asked for. The structure is meant to be learned quickly
by a tiny byte-level model: frequent words, fixed sentence patterns, a hero whose name and pronoun recur
through the story, and counting ("one, two, three").
"""

from __future__ import annotations

import random

CORPUS_SEED = 20240611

HEROES = [
    ("Lily", "she"), ("Tom", "he"), ("Mia", "she"), ("Ben", "he"), ("Anna", "she"), ("Max", "he"),
    ("Sara", "she"), ("Leo", "he"), ("Emma", "she"), ("Sam", "he"), ("Lucy", "she"), ("Jack", "he"),
    ("Zoe", "she"), ("Finn", "he"), ("Ruby", "she"), ("Oscar", "he"), ("Ella", "she"), ("Hugo", "he"),
    ("Nora", "she"), ("Theo", "he"), ("Ivy", "she"), ("Milo", "he"), ("Rosa", "she"), ("Otto", "he"),
]  # fmt: skip
ANIMALS = [
    "cat", "dog", "rabbit", "fox", "bear", "duck", "mouse", "owl", "frog", "turtle", "lion", "pig",
    "goat", "bird", "squirrel", "deer", "horse", "hen", "hedgehog", "otter",
]  # fmt: skip
TRAITS = [
    "little", "big", "kind", "brave", "shy", "happy", "curious", "clever", "silly", "sleepy", "quiet",
    "funny", "gentle", "busy", "young", "old",
]  # fmt: skip
LOOKS = ["pretty", "shiny", "nice", "strange", "lovely", "tiny", "funny", "big", "old"]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "white", "brown", "golden", "silver"]
OBJECTS = [
    ("ball", "balls"), ("box", "boxes"), ("stone", "stones"), ("flower", "flowers"), ("leaf", "leaves"),
    ("kite", "kites"), ("shell", "shells"), ("cup", "cups"), ("hat", "hats"), ("key", "keys"),
    ("book", "books"), ("apple", "apples"), ("feather", "feathers"), ("button", "buttons"), ("bell", "bells"),
    ("ribbon", "ribbons"), ("acorn", "acorns"), ("boat", "boats"), ("drum", "drums"), ("egg", "eggs"),
]  # fmt: skip
PLACES = [
    "in the garden", "by the river", "in the forest", "on the hill", "near the lake", "at the park",
    "in the meadow", "behind the old barn", "under the big tree", "on the beach", "in the village",
    "at the farm", "next to the pond", "in the tall grass",
]  # fmt: skip
ACTIVITIES = [
    "play with a ball", "read books", "sing songs", "dig holes", "climb trees", "paint pictures",
    "jump in puddles", "pick flowers", "look at the stars", "bake cakes", "swim in the pond", "run fast",
    "build sand castles", "fly kites", "dance in the rain", "watch the clouds",
]  # fmt: skip
GOOD_FEELINGS = ["happy", "excited", "proud", "surprised", "glad"]
BAD_FEELINGS = ["sad", "scared", "worried", "tired", "cold"]
PROBLEMS = [
    ("it began to rain", "they sat under a big leaf and waited for the sun"),
    ("the wind blew the {thing} away", "they ran after it and caught it by the fence"),
    ("it got dark", "the moon came out and showed them the way home"),
    ("the {thing} fell into the water", "{friend} jumped in and brought it back"),
    ("they got lost", "they followed the path until they saw the farm"),
    ("a big dog barked at them", "the dog only wanted to play, so they played together"),
]  # fmt: skip
ENDINGS = [
    "From that day on, {hero} and {friend} were best friends.",
    "They played with the {thing} until the sun went down.",
    "{hero} went home and told {possessive} mom all about the {thing}.",
    "That night, {hero} went to sleep with a big smile.",
    "{hero} kept the {thing} forever, and {pronoun} never forgot that day.",
]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def stories(count: int) -> list[str]:
    """The first `count` stories of the corpus."""
    rng = random.Random(CORPUS_SEED)
    return [_story(rng) for _ in range(count)]


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _capitalized(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def _story(rng: random.Random) -> str:
    hero, pronoun = rng.choice(HEROES)
    friend, friend_pronoun = rng.choice([h for h in HEROES if h[0] != hero])
    animal, friend_animal = rng.choice(ANIMALS), rng.choice(ANIMALS)
    thing, things = rng.choice(OBJECTS)
    color = rng.choice(COLORS)
    words = {
        "hero": hero,
        "pronoun": pronoun,
        "possessive": "her" if pronoun == "she" else "his",
        "friend": friend,
        "thing": thing,
    }
    sentences = [
        rng.choice(
            [
                f"Once upon a time, there was {_a(rng.choice(TRAITS))} {animal} named {hero}.",
                f"{hero} was {_a(rng.choice(TRAITS))} {animal} who lived {rng.choice(PLACES)}.",
                f"There once lived {_a(rng.choice(TRAITS))} {animal} called {hero}.",
            ]
        ),
        rng.choice(
            [
                f"{_capitalized(pronoun)} loved to {rng.choice(ACTIVITIES)}.",
                f"Every day, {hero} liked to {rng.choice(ACTIVITIES)} {rng.choice(PLACES)}.",
                f"{hero} liked to {rng.choice(ACTIVITIES)} more than anything.",
            ]
        ),
        f"One {rng.choice(['day', 'morning', 'evening'])}, {hero} found {_a(color)} {thing} {rng.choice(PLACES)}.",
        rng.choice(
            [
                f'"What {_a(rng.choice(LOOKS))} {thing}!" said {hero}.',
                f"{hero} was very {rng.choice(GOOD_FEELINGS)}.",
                f'"What is this?" {pronoun} asked.',
            ]
        ),
    ]
    if rng.random() < 0.5:
        count = rng.randint(2, 6)
        counted = ", ".join(NUMBERS[1 : count + 1])
        total = _capitalized(NUMBERS[count])
        sentences.append(f"There were more {things}. {hero} counted them: {counted}. {total} {things}!")
    sentences.append(
        rng.choice(
            [
                f"Then {friend} the {friend_animal} came by.",
                f"{hero}'s friend {friend} the {friend_animal} came to see.",
                f"Soon {friend} the {friend_animal} walked over.",
            ]
        )
    )
    sentences += rng.choice(
        [
            [f'"Can I play too?" asked {friend}.', f'"Yes, let us play together," said {hero}.'],
            [f'"Hello, {hero}!" said {friend}.', f'"Hello, {friend}! Look at my {thing}," said {hero}.'],
        ]
    )
    sentences.append(f"{friend} smiled, and {friend_pronoun} sat down next to {hero}.")
    if rng.random() < 0.6:
        problem, solution = rng.choice(PROBLEMS)
        sentences.append(f"But then {problem.format(**words)}.")
        sentences.append(f"{hero} and {friend} were {rng.choice(BAD_FEELINGS)}.")
        sentences.append(f"{_capitalized(solution.format(**words))}.")
    sentences.append(rng.choice(ENDINGS).format(**words))
    sentences.append("The end.")
    return " ".join(sentences)
