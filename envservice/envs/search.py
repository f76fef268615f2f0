"""Search-R1-style multi-hop question answering over a BM25 (bm25s) index of a synthetic knowledge base.

No QA corpus ships on PyPI, so the knowledge base is generated from a fixed seed: people, cities, countries
and companies with relations (born in, works for, headquartered in, located in, led by, founded in), one
passage per entity. Every question needs two hops (e.g. "In which country is the city where Mira Taldor was
born?": find Mira Taldor's passage, then the city's). Actions: `search[query]` returns the top-k passages;
`answer[text]` ends the episode with exact-match reward (case, punctuation, articles and spaces ignored).

The state an observation shows (`STATE_KEY`) is the question and the passages found so far, as a set: what the
agent knows when it acts next. A search that finds nothing new, in whatever words, leaves it as it was.
"""

from __future__ import annotations

import functools
import random
import re
import string
import threading
from dataclasses import dataclass
from typing import Any

import bm25s

from envservice.envs.base import STATE_KEY, Param, StepResult, Task, TextEnv
from envservice.envs.base import clip_text, content_digest
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

KB_SEED = 20_26
COUNTS = {"country": 30, "city": 120, "company": 150, "person": 600}
TEST_FRACTION = 10
"""Every 10th question (after a seeded shuffle) is a test question."""

DEFAULT_TOP_K = 3
MAX_TOP_K = 10
ACTION_RE = re.compile(r"^\s*(search|answer)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)
ACTION_HELP = "Use search[query] to look something up or answer[text] to give the final answer."

_SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "tor", "sel", "qui", "dan", "bel", "nor", "fa", "zu", "ren", "ost",
              "lia", "mar", "tes", "gor", "pha", "vin", "del", "sha", "kor", "an", "el", "is", "um", "ber", "cal")
_JOBS = ("chemist", "pilot", "architect", "violinist", "engineer", "botanist", "journalist", "surgeon", "painter")
_INDUSTRIES = ("shipping", "software", "textiles", "mining", "biotech", "aerospace", "publishing", "energy")


@dataclass(frozen=True)
class Question:
    """A two-hop question with the searches that answer it."""

    text: str
    answer: str
    hops: tuple[str, str]
    """The entity of each hop: searching their names finds the two passages needed."""


@dataclass(frozen=True)
class KnowledgeBase:
    """Passages (title, text) and the questions they answer."""

    passages: tuple[tuple[str, str], ...]
    questions: tuple[Question, ...]


def _name(rng: random.Random, used: set[str], syllables: int) -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()
        if name not in used:
            used.add(name)
            return name


def _entities(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """Countries, cities, companies and people with their relations (names are unique across the KB)."""
    used: set[str] = set()
    countries = [{"name": _name(rng, used, 3)} for _ in range(COUNTS["country"])]
    cities = [{"name": _name(rng, used, 2), "country": rng.choice(countries)["name"],
               "population": rng.randrange(20, 3000) * 1000} for _ in range(COUNTS["city"])]
    people = [{"name": f"{_name(rng, used, 2)} {_name(rng, used, 3)}", "job": rng.choice(_JOBS),
               "born_in": rng.choice(cities)["name"]} for _ in range(COUNTS["person"])]
    companies = [{"name": f"{_name(rng, used, 2)} {rng.choice(('Labs', 'Works', 'Group', 'Systems'))}",
                  "industry": rng.choice(_INDUSTRIES), "city": rng.choice(cities)["name"],
                  "founded": rng.randrange(1850, 2020), "ceo": people[i]["name"]}
                 for i in range(COUNTS["company"])]
    for person in people:
        person["employer"] = rng.choice(companies)["name"]
    return {"country": countries, "city": cities, "company": companies, "person": people}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _passages(entities: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    ceo_of = {c["ceo"]: c["name"] for c in entities["company"]}
    passages = [(c["name"], f"{c['name']} is a country.") for c in entities["country"]]
    passages += [(c["name"], f"{c['name']} is a city in {c['country']} with about {c['population']:,} inhabitants.")
                 for c in entities["city"]]
    passages += [(c["name"], f"{c['name']} is {_article(c['industry'])} {c['industry']} company founded in {c['founded']}. It is "
                             f"headquartered in {c['city']} and led by its CEO {c['ceo']}.") for c in entities["company"]]
    for p in entities["person"]:
        lead = f" {p['name']} is also the CEO of {ceo_of[p['name']]}." if p["name"] in ceo_of else ""
        passages.append((p["name"], f"{p['name']} is {_article(p['job'])} {p['job']} born in {p['born_in']}. "
                                    f"{p['name']} works for {p['employer']}.{lead}"))
    return passages


def _questions(entities: dict[str, list[dict[str, Any]]]) -> list[Question]:
    city = {c["name"]: c for c in entities["city"]}
    company = {c["name"]: c for c in entities["company"]}
    questions = []
    for p in entities["person"]:
        name, employer, born = p["name"], company[p["employer"]], p["born_in"]
        questions += [
            Question(f"In which country is the city where {name} was born?", city[born]["country"], (name, born)),
            Question(f"In which city is the company that {name} works for headquartered?", employer["city"],
                     (name, employer["name"])),
            Question(f"In which year was the company that {name} works for founded?", str(employer["founded"]),
                     (name, employer["name"])),
        ]
    person = {p["name"]: p for p in entities["person"]}
    for c in entities["company"]:
        questions += [
            Question(f"In which city was the CEO of {c['name']} born?", person[c["ceo"]]["born_in"], (c["name"], c["ceo"])),
            Question(f"In which country is {c['name']} headquartered?", city[c["city"]]["country"], (c["name"], c["city"])),
        ]
    return questions


@functools.lru_cache(maxsize=1)
def knowledge_base() -> KnowledgeBase:
    """The knowledge base of seed `KB_SEED` (the same in every process)."""
    entities = _entities(random.Random(KB_SEED))
    questions = _questions(entities)
    random.Random(KB_SEED + 1).shuffle(questions)
    return KnowledgeBase(tuple(_passages(entities)), tuple(questions))


def split_questions(split: str) -> list[Question]:
    """The questions of a split (train and test never share a question)."""
    questions = knowledge_base().questions
    if split == "test":
        return list(questions[::TEST_FRACTION])
    return [q for i, q in enumerate(questions) if i % TEST_FRACTION]


class Retriever:
    """A bm25s index of the knowledge base's passages (built once per process, read-only afterwards)."""

    _instance: "Retriever | None" = None
    _lock = threading.Lock()

    def __init__(self, passages: tuple[tuple[str, str], ...]) -> None:
        self.passages = passages
        self.tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        ids = self.tokenizer.tokenize([f"{t}. {x}" for t, x in passages], return_as="ids", show_progress=False)
        self.index = bm25s.BM25()
        self.index.index(ids, show_progress=False)

    @classmethod
    def shared(cls) -> "Retriever":
        """The process-wide index."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(knowledge_base().passages)
            return cls._instance

    def search(self, query: str, k: int) -> list[tuple[str, str]]:
        """The top-k passages for `query` (empty when no query word is in the index)."""
        ids = self.tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)
        if not ids[0]:
            return []
        docs, scores = self.index.retrieve(ids, k=k, show_progress=False, n_threads=1)
        return [self.passages[int(d)] for d, s in zip(docs[0], scores[0]) if s > 0]


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style exact match)."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(word for word in text.split() if word not in ("a", "an", "the"))


def _top_k(task: Task) -> int:
    value = task.params.get("top_k", DEFAULT_TOP_K)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOP_K:
        raise EnvServiceError(ErrorCode.bad_request, f"params.top_k={value!r} is invalid: give an integer in 1..{MAX_TOP_K}")
    return value


class SearchQAEnv(TextEnv):
    """Answer a two-hop question by searching a knowledge base: search[query], then answer[text]."""

    description = ("Multi-hop QA over a BM25-indexed synthetic knowledge base (Search-R1 style); actions: "
                   "search[query] returns top-k passages, answer[text] ends with exact-match reward.")
    splits = {split: [f"q-{i}" for i in range(len(split_questions(split)))] for split in ("train", "test")}
    params = {"top_k": Param(f"Passages returned per search, 1..{MAX_TOP_K} (default {DEFAULT_TOP_K}).", int)}

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The question and its answer (`top_k` only changes how many passages a search shows)."""
        question = split_questions(task.split)[task.index]
        return content_digest("search", question.text, question.answer)

    def __init__(self) -> None:
        self._question: Question | None = None
        self._top_k = DEFAULT_TOP_K
        self._correct = False
        self._found: set[str] = set()
        """Titles of the passages the episode's searches returned."""

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Pose the task's question."""
        self._top_k = _top_k(task)
        self._question = split_questions(task.split)[task.index]
        self._correct = False
        self._found = set()
        Retriever.shared()
        observation = f"Question: {self._question.text}\n{ACTION_HELP}"
        return observation, {"question": self._question.text, STATE_KEY: self.state_key}

    @property
    def state_key(self) -> str:
        """The question and the passages found so far, in any order (module docstring)."""
        return content_digest("search-state", self._question.text, sorted(self._found))

    def step(self, action: str) -> StepResult:
        """Run a search (reward 0) or take the answer (ends the episode; reward 1 on exact match)."""
        match = ACTION_RE.match(action)
        if match is None:
            return (f"Invalid action {clip_text(action)!r}. {ACTION_HELP}", 0.0, False, False,
                    {"invalid": True, STATE_KEY: self.state_key})
        kind, argument = match.group(1).lower(), match.group(2).strip()
        if kind == "search":
            return self._search(argument), 0.0, False, False, {STATE_KEY: self.state_key}
        self._correct = normalize_answer(argument) == normalize_answer(self._question.answer)
        verdict = "correct" if self._correct else "incorrect"
        observation = f"Your answer {clip_text(argument)!r} is {verdict}."
        return observation, float(self._correct), True, False, {"correct": self._correct, STATE_KEY: self.state_key}

    def evaluate(self) -> tuple[float, bool]:
        """Score 1 for an exactly matching answer, else 0."""
        return float(self._correct), self._correct

    def gold_actions(self) -> list[str]:
        """Search each hop's entity, then answer (an oracle for tests)."""
        first, second = self._question.hops
        return [f"search[{first}]", f"search[{second}]", f"answer[{self._question.answer}]"]

    def _search(self, query: str) -> str:
        results = Retriever.shared().search(query, self._top_k)
        self._found.update(title for title, _ in results)
        if not results:
            return f"No passage matches {clip_text(query)!r}."
        return "\n".join(f"[{i}] {title}: {text}" for i, (title, text) in enumerate(results, 1))
