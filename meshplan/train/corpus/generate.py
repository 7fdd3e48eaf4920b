"""Deterministic generator of the embedded training corpus (``corpus.txt`` next to this file).

The text is written from scratch by the grammar below, so it carries no third-party copyright;
it is distributed under the project's own licence (Apache-2.0). It mixes five kinds of
paragraph so that a tiny byte-level model has structure to learn at every scale:

- spelling and punctuation (a closed vocabulary of a few hundred English words),
- short stories about a fixed cast, where each character always has the same pronoun, home
  town and trade (long-range consistency),
- facts about an invented map that never contradict each other,
- arithmetic with correct answers and counting sequences,
- question/answer pairs and short lists.

Regenerate (byte-identical, Python's `random.Random` is stable across versions) with:

    python -m meshplan.train.corpus.generate > meshplan/train/corpus/corpus.txt
"""

from __future__ import annotations

import random
import sys

__all__ = ["generate", "SEED", "TARGET_BYTES"]

SEED = 20240607
TARGET_BYTES = 1_000_000   # ~1 MB: 7800 windows of 128 tokens, enough for ~100 steps of batch 64 without repeats

# name -> (pronoun subject, object, possessive, home town, trade)
CAST = {
    "Ada": ("she", "her", "her", "Port Ellis", "baker"),
    "Bram": ("he", "him", "his", "Larkmoor", "smith"),
    "Cora": ("she", "her", "her", "Fenwick", "weaver"),
    "Dov": ("he", "him", "his", "Port Ellis", "fisher"),
    "Elin": ("she", "her", "her", "Ashford", "potter"),
    "Farid": ("he", "him", "his", "Larkmoor", "miller"),
    "Greta": ("she", "her", "her", "Holloway", "carpenter"),
    "Hugo": ("he", "him", "his", "Fenwick", "glassblower"),
    "Ines": ("she", "her", "her", "Ashford", "teacher"),
    "Jonah": ("he", "him", "his", "Holloway", "shepherd"),
    "Kira": ("she", "her", "her", "Bramble Hill", "doctor"),
    "Lars": ("he", "him", "his", "Bramble Hill", "builder"),
    "Mina": ("she", "her", "her", "Stonebridge", "gardener"),
    "Nils": ("he", "him", "his", "Stonebridge", "sailor"),
    "Oona": ("she", "her", "her", "Westmere", "painter"),
    "Pavel": ("he", "him", "his", "Westmere", "clockmaker"),
}

# town -> (river, what it is known for, neighbour town, direction of the neighbour)
TOWNS = {
    "Port Ellis": ("the Sallow", "its harbor and its fish market", "Larkmoor", "north"),
    "Larkmoor": ("the Tarn", "its windmills", "Fenwick", "east"),
    "Fenwick": ("the Tarn", "its blue glass", "Ashford", "south"),
    "Ashford": ("the Wend", "its clay pits", "Holloway", "west"),
    "Holloway": ("the Wend", "its sheep and its wool", "Bramble Hill", "north"),
    "Bramble Hill": ("the Sallow", "its old stone hospital", "Stonebridge", "east"),
    "Stonebridge": ("the Mire", "its seven bridges", "Westmere", "south"),
    "Westmere": ("the Mire", "its lake and its painters", "Port Ellis", "west"),
}

ADJ = ["old", "small", "quiet", "bright", "heavy", "narrow", "warm", "cold", "green", "red", "wooden",
       "broken", "new", "tall", "round", "dusty", "clean", "strange", "little", "long"]
OBJ = ["box", "lamp", "key", "letter", "basket", "map", "coat", "bell", "cup", "book", "rope",
       "kettle", "hammer", "ladder", "bowl", "clock", "boat", "cart", "chair", "window"]
PLACE = ["the kitchen", "the market", "the barn", "the harbor", "the garden", "the workshop",
         "the station", "the school", "the bridge", "the square", "the mill", "the library"]
SPOT = ["under the table", "behind the door", "on the shelf", "near the stove", "by the gate",
        "in the corner", "beside the well", "on the roof", "inside the chest", "next to the stairs"]
WEATHER = ["It was raining", "The sun was out", "A cold wind blew", "Snow covered the roads",
           "The air was still", "Fog hung over the water", "It was a clear morning", "Thunder rolled in the hills"]
TIME = ["In the morning", "At noon", "In the evening", "Late at night", "Before dawn", "On Sunday",
        "After lunch", "At the end of the day"]
FEEL = ["happy", "tired", "worried", "surprised", "calm", "curious", "proud", "hungry"]
VERB_OBJ = [("fixed", "fix"), ("carried", "carry"), ("opened", "open"), ("cleaned", "clean"),
            ("painted", "paint"), ("moved", "move"), ("sold", "sell"), ("found", "find")]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "gray"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
                "eighteen", "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _plural(word: str) -> str:
    return word + ("es" if word.endswith(("x", "s", "ch", "sh")) else "s")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _story(r: random.Random) -> str:
    name, other = r.sample(sorted(CAST), 2)
    he, him, his, town, trade = CAST[name]
    o_he, _, _, o_town, o_trade = CAST[other]
    adj, obj = r.choice(ADJ), r.choice(OBJ)
    done, do = r.choice(VERB_OBJ)
    lines = [
        f"{r.choice(TIME)} in {town}, {name} the {trade} went to {r.choice(PLACE)}.",
        f"{r.choice(WEATHER)}, and {he} felt {r.choice(FEEL)}.",
        f"{_cap(he)} found {_a(adj)} {obj} {r.choice(SPOT)}.",
    ]
    if r.random() < 0.6:
        lines.append(f'"Can you help me {do} this {obj}?" {name} asked {other}.')
        if o_town == town:
            lines.append(f'"Of course," said {other}, who also lived in {town}.')
        else:
            lines.append(f'"Of course," said {other}, who had come from {o_town} that day.')
        lines.append(f"Together they {done} the {obj}, and {other} the {o_trade} went home.")
    else:
        lines.append(f"{_cap(he)} {done} the {obj} alone and put it {r.choice(SPOT)}.")
    lines.append(f"Then {name} went back to {his} work, because a {trade} has much to do.")
    return " ".join(lines)


def _fact(r: random.Random) -> str:
    town = r.choice(sorted(TOWNS))
    river, known, neighbour, direction = TOWNS[town]
    people = [n for n in sorted(CAST) if CAST[n][3] == town]
    kind = r.randrange(4)
    if kind == 0:
        return (f"{town} lies on the river {river[4:]}. It is known for {known}. "
                f"{neighbour} is to the {direction} of {town}.")
    if kind == 1:
        who = " and ".join(people) if people else "nobody we know"
        return f"The people of {town} we know are {who}. The river that runs through {town} is {river}."
    if kind == 2:
        name = r.choice(people) if people else r.choice(sorted(CAST))
        he, _, his, home, trade = CAST[name]
        return f"{name} lives in {home}. {_cap(he)} works as {_a(trade)}, and {his} town is known for {TOWNS[home][1]}."
    return f"If you walk {direction} from {town}, you reach {neighbour}. Both towns trade in {_plural(r.choice(OBJ))}."


def _arithmetic(r: random.Random) -> str:
    out = []
    for _ in range(r.randint(3, 6)):
        a, b = r.randint(0, 99), r.randint(0, 99)
        op = r.randrange(4)
        if op == 0:
            out.append(f"{a} + {b} = {a + b}.")
        elif op == 1:
            a, b = max(a, b), min(a, b)
            out.append(f"{a} - {b} = {a - b}.")
        elif op == 2:
            a, b = a % 13, b % 13
            out.append(f"{a} x {b} = {a * b}.")
        else:
            a, b = a % 21, b % 21
            if a + b <= 20:
                out.append(f"{_cap(NUMBER_WORDS[a])} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}.")
            else:
                out.append(f"The sum of {a} and {b} is {a + b}.")
    return " ".join(out)


def _sequence(r: random.Random) -> str:
    kind = r.randrange(4)
    if kind == 0:
        start = r.randint(0, 12)
        return "Counting: " + ", ".join(NUMBER_WORDS[start:start + r.randint(4, 8)]) + "."
    if kind == 1:
        start = r.randrange(7)
        days = [DAYS[(start + i) % 7] for i in range(r.randint(3, 7))]
        return f"After {days[0]} comes {days[1]}. The days go: " + ", ".join(days) + "."
    if kind == 2:
        start = r.randrange(12)
        months = [MONTHS[(start + i) % 12] for i in range(r.randint(3, 6))]
        return "The months in order: " + ", ".join(months) + "."
    step, start = r.randint(2, 9), r.randint(1, 20)
    return f"Add {step} each time: " + ", ".join(str(start + step * i) for i in range(6)) + "."


def _qa(r: random.Random) -> str:
    name = r.choice(sorted(CAST))
    he, _, his, home, trade = CAST[name]
    town = r.choice(sorted(TOWNS))
    kind = r.randrange(5)
    if kind == 0:
        return f"Q: Where does {name} live?\nA: {name} lives in {home}."
    if kind == 1:
        return f"Q: What does {name} do?\nA: {_cap(he)} is {_a(trade)}."
    if kind == 2:
        return f"Q: Which river runs through {town}?\nA: {_cap(TOWNS[town][0])} runs through {town}."
    if kind == 3:
        color, obj = r.choice(COLORS), r.choice(OBJ)
        return f"Q: What color is {name}'s {obj}?\nA: {_cap(his)} {obj} is {color}. It was {color} yesterday too."
    return f"Q: What is {town} known for?\nA: {town} is known for {TOWNS[town][1]}."


def _list(r: random.Random) -> str:
    name = r.choice(sorted(CAST))
    items = r.sample(OBJ, r.randint(3, 5))
    body = "\n".join(f"- {_a(r.choice(ADJ))} {item}" for item in items)
    return f"Things {name} keeps in the {r.choice(['shed', 'attic', 'cellar', 'shop'])}:\n{body}"


_KINDS = ((_story, 5), (_fact, 2), (_arithmetic, 2), (_sequence, 1), (_qa, 2), (_list, 1))


def generate(*, seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    """The corpus text: paragraphs separated by blank lines, ASCII only, about target_bytes long."""
    r = random.Random(seed)
    makers = [m for m, w in _KINDS for _ in range(w)]
    parts: list[str] = []
    size = 0
    while size < target_bytes:
        p = r.choice(makers)(r)
        parts.append(p)
        size += len(p) + 2
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(generate())
