"""The built-in synthetic multi-hop set: a seeded fictional world of people, films and towns, asked 2Wiki-style."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from orthrus_rag.data.types import Passage, QAExample

_SYLLABLES = ["ka", "ri", "lo", "ven", "mar", "tho", "sel", "dra", "bel", "nor", "fi", "ga", "lu", "ze", "pra",
              "mo", "tan", "vi", "es", "ril", "dor", "ca", "sha", "len", "ob", "quin", "ru", "sta", "wen", "yo"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_ADJS = ["Silent", "Crimson", "Last", "Hidden", "Golden", "Broken", "Distant", "Winter", "Wild", "Quiet", "Iron",
         "Painted", "Lonely", "Bright", "Secret", "Falling"]
_NOUNS = ["Harbor", "Garden", "Road", "Mirror", "Orchard", "Bridge", "Lantern", "Valley", "Promise", "Tower",
          "River", "Letter", "Island", "Dancer", "Storm", "Circus"]
_GENRES = ["drama", "comedy", "western", "thriller", "musical", "war film", "romance", "mystery"]
_JOBS = ["merchant", "painter", "politician", "novelist", "composer", "engineer", "actor", "physician"]
_FEATURES = ["old stone bridge", "weekly market", "cathedral", "harbour", "wool mills", "spring festival"]
_TYPE_CYCLE = ["compositional"] * 9 + ["comparison"] * 5 + ["bridge_comparison"] * 4 + ["inference"] * 2
_CONTEXT_SIZE = 10


@dataclass
class _Place:
    name: str
    country: str
    nationality: str
    founded: int


@dataclass
class _Person:
    name: str
    male: bool
    born: tuple[int, int, int]  # (year, month, day): compares chronologically
    place: _Place
    job: str
    father: _Person | None = None
    mother: _Person | None = None
    spouse: _Person | None = None
    children: list[_Person] = field(default_factory=list)

    @property
    def date(self) -> str:
        return f"{_MONTHS[self.born[1] - 1]} {self.born[2]}, {self.born[0]}"


@dataclass
class _Film:
    title: str
    year: int
    genre: str
    director: _Person
    stars: list[_Person]


class _World:
    """People over three generations, towns in a few countries, and films by some of the people."""

    def __init__(self, rng: random.Random, num_families: int) -> None:
        self.rng = rng
        self.used: set[str] = set()
        stems = [self._unique(lambda: self._word(2)) for _ in range(4)]
        roots = [s + "r" if s[-1] in "aeiou" else s for s in stems]  # Zeri -> Zeriria, Zeririan
        countries = [(r + "ia", r + "ian") for r in roots]
        self.places = [_Place(self._unique(lambda: self._word(2) + rng.choice(["ton", "burg", "ford", "vale"])),
                              *rng.choice(countries), rng.randint(1100, 1800)) for _ in range(num_families // 2 + 6)]
        self.people: list[_Person] = []
        gen0 = [(self._person(True, self._word(2), 1840), self._person(False, self._word(2), 1842))
                for _ in range(num_families)]
        gen1 = [(self._child(f, m, True), self._child(f, m, False)) for f, m in (self._marry(*c) for c in gen0)]
        gen2 = []
        for i, (son, _) in enumerate(gen1):  # the son of family i marries the daughter of family i + 1
            father, mother = self._marry(son, gen1[(i + 1) % len(gen1)][1])
            gen2 += [self._child(father, mother, rng.random() < 0.5) for _ in range(rng.randint(1, 2))]
        self.grandchildren = gen2
        directors = rng.sample([p for p, _ in gen1] + [d for _, d in gen1] + gen2, num_families)
        self.films = []
        for d in directors:
            d.job = "film director"
            for _ in range(rng.randint(1, 2)):
                year = min(d.born[0] + rng.randint(25, 55), 2020)
                title = self._unique(lambda: f"The {rng.choice(_ADJS)} {rng.choice(_NOUNS)}", f" ({year} film)")
                actors = [p for p in self.people if p.job == "actor"]
                stars = rng.sample(actors if len(actors) >= 2 else self.people, 2)
                self.films.append(_Film(title, year, rng.choice(_GENRES), d, stars))
        self.paragraphs = {p.name: self._person_text(p) for p in self.people}
        self.paragraphs.update({f.title: self._film_text(f) for f in self.films})
        self.paragraphs.update({p.name: self._place_text(p) for p in self.places})

    def _word(self, syllables: int) -> str:
        return "".join(self.rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()

    def _unique(self, make: Callable[[], str], suffix: str = "") -> str:
        """A fresh title from `make()`; on a clash try once more with `suffix` (like "(1954 film)"), then retry."""
        while True:
            name = make()
            for candidate in (name, name + suffix):
                if candidate.lower() not in self.used:
                    self.used.add(candidate.lower())
                    return candidate

    def _person(self, male: bool, surname: str, year: int) -> _Person:
        rng = self.rng
        name = self._unique(lambda: f"{self._word(rng.randint(2, 3))} {surname}")
        born = (year + rng.randint(0, 30), rng.randint(1, 12), rng.randint(1, 28))
        person = _Person(name, male, born, rng.choice(self.places), rng.choice(_JOBS))
        self.people.append(person)
        return person

    def _child(self, father: _Person, mother: _Person, male: bool) -> _Person:
        child = self._person(male, father.name.split()[-1], max(father.born[0], mother.born[0]) + 20)
        child.father, child.mother = father, mother
        father.children.append(child)
        mother.children.append(child)
        return child

    def _marry(self, a: _Person, b: _Person) -> tuple[_Person, _Person]:
        a.spouse, b.spouse = b, a
        return a, b

    def _person_text(self, p: _Person) -> str:
        he, his = ("He", "His") if p.male else ("She", "Her")
        a = "an" if p.place.nationality[0] in "AEIOU" else "a"
        parts = [f"{p.name} (born {p.date}) is {a} {p.place.nationality} {p.job}.",
                 f"{he} was born in {p.place.name}, {p.place.country}."]
        if p.father and p.mother:
            parts.append(f"{his} father is {p.father.name} and {his.lower()} mother is {p.mother.name}.")
        else:
            parts.append(f"Little is recorded about {his.lower()} early life.")
        if p.spouse:
            kids = f", with whom {he.lower()} had {len(p.children)} children" if len(p.children) > 1 else ""
            parts.append(f"{he} married {p.spouse.name}{kids}.")
        return " ".join(parts)

    def _film_text(self, f: _Film) -> str:
        return (f"{f.title} is a {f.year} {f.director.place.nationality} {f.genre} directed by {f.director.name}. "
                f"It stars {f.stars[0].name} and {f.stars[1].name}. The film was shot in {f.director.place.name}.")

    def _place_text(self, p: _Place) -> str:
        return (f"{p.name} is a small town in the {self.rng.choice(['north', 'south', 'east', 'west'])} of "
                f"{p.country}. It was founded in {p.founded}. The town is known for its "
                f"{self.rng.choice(_FEATURES)}.")


_Question = tuple[str, list[str], list[str]]  # (question, golden answers, supporting titles)


def _compositional(w: _World, rng: random.Random) -> _Question:
    f = rng.choice(w.films)
    d, gold = f.director, [f.title, f.director.name]
    kind = rng.choice(["mother", "father", "place", "date", "nationality"])
    if kind in ("mother", "father"):
        return f"Who is the {kind} of the director of film {f.title}?", [getattr(d, kind).name], gold
    if kind == "place":
        return f"Where was the director of film {f.title} born?", [d.place.name], gold
    if kind == "date":
        alias = f"{d.born[2]} {_MONTHS[d.born[1] - 1]} {d.born[0]}"
        return f"When was the director of film {f.title} born?", [d.date, alias], gold
    return f"What nationality is the director of film {f.title}?", [d.place.nationality], gold


def _pick_two(rng: random.Random, items: list, key: Callable) -> tuple:
    """Two items whose keys differ (so a comparison has one answer)."""
    while True:
        a, b = rng.sample(items, 2)
        if key(a) != key(b):
            return a, b


def _comparison(w: _World, rng: random.Random) -> _Question:
    kind, first = rng.choice(["film", "person", "place"]), rng.random() < 0.5
    if kind == "film":
        a, b = _pick_two(rng, w.films, lambda f: f.year)
        key, names = (lambda f: f.year), (a.title, b.title)
        q = f"Which film came out {'first' if first else 'more recently'}, {a.title} or {b.title}?"
    elif kind == "person":
        a, b = _pick_two(rng, w.people, lambda p: p.born)
        key, names = (lambda p: p.born), (a.name, b.name)
        q = f"Who was born {'first' if first else 'later'}, {a.name} or {b.name}?"
    else:
        a, b = _pick_two(rng, w.places, lambda p: p.founded)
        key, names = (lambda p: p.founded), (a.name, b.name)
        q = f"Which town was founded {'first' if first else 'more recently'}, {a.name} or {b.name}?"
    answer = names[0] if (key(a) < key(b)) == first else names[1]
    return q, [answer], list(names)


def _bridge_comparison(w: _World, rng: random.Random) -> _Question:
    a, b = _pick_two(rng, w.films, lambda f: f.director.born)
    first = rng.random() < 0.5
    q = f"Which film has the director born {'first' if first else 'later'}, {a.title} or {b.title}?"
    answer = a.title if (a.director.born < b.director.born) == first else b.title
    return q, [answer], [a.title, a.director.name, b.title, b.director.name]


def _inference(w: _World, rng: random.Random) -> _Question:
    p = rng.choice(w.grandchildren)
    if rng.random() < 0.2 and p.father.spouse:  # in-law: through the spouse of p's father
        return f"Who is the father-in-law of {p.father.name}?", [p.mother.father.name], [p.father.name, p.mother.name]
    side, elder = rng.choice(["paternal", "maternal"]), rng.choice(["grandfather", "grandmother"])
    parent = p.father if side == "paternal" else p.mother
    answer = parent.father if elder == "grandfather" else parent.mother
    return f"Who is the {side} {elder} of {p.name}?", [answer.name], [p.name, parent.name]


_MAKERS = {"compositional": _compositional, "comparison": _comparison, "bridge_comparison": _bridge_comparison,
           "inference": _inference}


def make_synthetic(num_questions: int = 60, seed: int = 0) -> list[QAExample]:
    """`num_questions` 2Wiki-style questions (types in 2Wiki's mix) over a world built from `seed`."""
    if num_questions < 0:
        raise ValueError(f"num_questions must be >= 0, got {num_questions}")
    rng = random.Random(seed)
    world = _World(rng, num_families=max(6, -(-num_questions // 4)))
    titles = list(world.paragraphs)
    examples: list[QAExample] = []
    seen: set[str] = set()
    cycle: list[str] = []
    for _ in range(50 * num_questions):
        if len(examples) == num_questions:
            break
        if not cycle:
            cycle = rng.sample(_TYPE_CYCLE, len(_TYPE_CYCLE))
        qtype = cycle[-1]
        question, answers, gold = _MAKERS[qtype](world, rng)
        if question in seen:
            continue
        seen.add(question)
        cycle.pop()
        # NOTE: hard distractors first: entities named in the gold paragraphs (spouses, siblings' parents, stars)
        related = [t for t in titles if t not in gold and any(t in world.paragraphs[g] for g in gold)]
        others = [t for t in titles if t not in gold and t not in related]
        picked = rng.sample(related, min(3, len(related)))
        picked += rng.sample(others, _CONTEXT_SIZE - len(gold) - len(picked))
        order = rng.sample(gold + picked, len(gold) + len(picked))
        ex_id = f"synthetic_{len(examples)}"
        context = [Passage(f"{ex_id}#{k}", t, world.paragraphs[t]) for k, t in enumerate(order)]
        examples.append(QAExample(ex_id, question, answers, qtype, gold, context))
    if len(examples) < num_questions:
        raise RuntimeError(f"synthetic world ran out of distinct questions at {len(examples)} of {num_questions}")
    return examples
