"""A seeded corpus of Wikipedia-like distractor passages for scale tests: fictional people, towns, films and
societies in FlashRAG's shape (a title, then ~100 words of text: its wiki-18 passages are 100-word cuts).

Passage `i` depends only on (`seed`, `i`), so any slice of a corpus is generated on its own (`start`), in any
order, and two runs agree; lengths follow a clipped normal around `mean_words`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from orthrus_rag.data.types import Passage

_SYL = ["ka", "ri", "lo", "ven", "mar", "tho", "sel", "dra", "bel", "nor", "fi", "ga", "lu", "ze", "pra", "mo", "tan",
        "vi", "es", "ril", "dor", "ca", "sha", "len", "ob", "quin", "ru", "sta", "wen", "yo", "bra", "cel", "dun"]
_KINDS = ["person", "town", "film", "society", "river"]
_JOBS = ["merchant", "painter", "politician", "novelist", "composer", "engineer", "actor", "physician", "botanist"]
_GENRES = ["drama", "comedy", "western", "thriller", "musical", "war film", "romance", "mystery", "documentary"]
_FILLERS = [
    "{name} is mentioned in several regional histories written during the following century.",
    "Records kept in the archives of {place} describe the period in some detail.",
    "Historians have disputed parts of this account since the first surveys were published.",
    "A later edition added photographs and a map of the surrounding district.",
    "The local council recognised the contribution with a small plaque near the market square.",
    "Little of the original correspondence survives, although copies were made in {year}.",
    "The subject was revisited in a lecture series at the university of {place} in {year}.",
    "Contemporary newspapers reported on the events with varying degrees of accuracy.",
    "Several relatives of {name} later settled in the coastal towns of {country}.",
    "An exhibition about {name} opened in {place} in {year} and toured the country.",
]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYL) for _ in range(syllables)).capitalize()


def _passage(seed: int, i: int, mean_words: int) -> Passage:
    rng = random.Random(f"{seed}:{i}")  # NOTE: a string seed hashes stably across runs and Python versions
    kind = rng.choice(_KINDS)
    name = f"{_word(rng, rng.randint(2, 3))} {_word(rng, 2)}"
    place, country = _word(rng, 2) + rng.choice(["ton", "burg", "ford", "vale"]), _word(rng, 2) + "ia"
    year = rng.randint(1100, 2020)
    if kind == "person":
        title = name
        lead = (f"{name} (born {year}) was a {rng.choice(_JOBS)} from {place}, {country}. "
                f"{name.split()[0]} studied in {_word(rng, 2)}ton before moving to {place}.")
    elif kind == "town":
        title = place
        lead = (f"{place} is a town in the {rng.choice(['north', 'south', 'east', 'west'])} of {country}, "
                f"founded in {year}. Its population grew quickly after the railway arrived.")
    elif kind == "film":
        film = f"The {_word(rng, 2)} {_word(rng, 2)}"
        title = f"{film} ({year} film)"
        lead = (f"{film} is a {year} {country[:-1]}an {rng.choice(_GENRES)} directed by {name}. "
                f"It was shot on location in {place}.")
    elif kind == "society":
        title = f"{place} {rng.choice(['Society', 'Guild', 'Academy', 'Club'])}"
        lead = f"The {title} is an association founded in {year} in {place}, {country}, by {name}."
    else:
        title = f"{_word(rng, 2)} River"
        lead = f"The {title} flows through {country} for {rng.randint(20, 900)} kilometres, passing {place}."
    target = max(20, min(250, int(rng.gauss(mean_words, mean_words * 0.15))))
    sentences, fillers = [lead], []
    while sum(len(s.split()) for s in sentences) < target:  # whole sentences, none twice in a row
        fillers = fillers or rng.sample(_FILLERS, len(_FILLERS))
        sentences.append(fillers.pop().format(name=name, place=place, country=country, year=rng.randint(1100, 2020)))
    return Passage(f"gen-{seed}-{i}", title, " ".join(sentences))


def generate_passages(n: int, seed: int = 0, start: int = 0, mean_words: int = 100) -> Iterator[Passage]:
    """Passages `start` .. `start + n - 1` of the seeded corpus."""
    if n < 0 or start < 0 or mean_words < 1:
        raise ValueError(f"n and start must be non-negative and mean_words positive, got {n}, {start}, {mean_words}")
    for i in range(start, start + n):
        yield _passage(seed, i, mean_words)
