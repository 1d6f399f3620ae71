"""Offline RULER-style long-context data on real text, in the format kvpress's RULER loader and scorer read.

Each example is one row of a DataFrame with the columns kvpress's ``evaluation/evaluate.py`` uses (``context``,
``question``, ``answer_prefix``, ``max_new_tokens``) and the ones its RULER scorer
(``benchmarks/ruler/calculate_metrics.py``) reads: ``task`` and ``answer``, a list of strings. The scorer lowercases
and checks each reference string for containment in the prediction: tasks whose name starts with ``qa`` score 1 if
any reference is found, every other task scores the fraction found (RULER's ``string_match_all``). Extra columns
(``length``, ``depth``, ``context_tokens``, ``seed``) are carried into evaluate.py's predictions.csv.

Tasks (after RULER, Hsieh et al. 2024; templates paraphrase RULER's, the haystacks are Austen's novels and RULER's
noise sentences, the key words come from Austen's vocabulary):

* ``niah_single_1``: one needle ("One of the special magic numbers for <key> is: <7 digits>.") in RULER's repeated
  noise sentences; ``niah_single_2``: the same in Austen.
* ``niah_multikey_1``: four needles with different keys in Austen, one of them asked for.
* ``niah_multivalue``: four needles with the same key and different values in Austen; all four are asked for.
* ``vt``: variable tracking, one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (5 variables) spread through the
  noise sentences; the answer is every variable holding the value.
* ``cwe``: common-words extraction: a numbered list of Austen words in which ten appear many times and the others
  at most three times; the answer is the ten frequent words.
* ``facts``: multi-fact QA on real text: four statements "<person> lives in <place>." with Austen's people and
  places, between the sentences of an Austen passage that names none of them; one person is asked for.
* ``characters``: who an unchanged Austen passage is about: "Who are the main characters ... and what happens to
  them?", answered freely; the reference is the two people the passage names most (fraction named), and the
  answer's agreement with the full cache's (ROUGE-L, :func:`kvpress_cpp.evaluation.results.agreement`) measures
  the rest.
* ``niah_depth_<d>``: the needle-in-a-haystack depth sweep: ``niah_single_2`` with the needle at depth d% of the
  Austen haystack (d in :data:`DEPTHS`).

Lengths are in tokens of the evaluation model's tokenizer: ``context`` + ``question`` hold ``length`` tokens within
:data:`LENGTH_TOLERANCE` (the chat template and answer prefix come on top). Everything is seeded: the same
(seed, tokenizer, lengths, counts) give the same rows.

    python -m kvpress_cpp.evaluation.ruler_data --lengths 2048 4096 --examples 4 --out /tmp/ruler
"""

from __future__ import annotations

import argparse
import bisect
import calendar
import functools
import random
import re
import string
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable

import pandas as pd

__all__ = ["TASKS", "DEPTHS", "NOISE", "LENGTH_TOLERANCE", "LengthTooShort", "generate", "shortest_length",
           "write_dataset", "default_tasks"]

#: RULER's noise haystack (its ``niah_single_1`` and ``vt`` tasks repeat these sentences).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: Needle depths (percent of the haystack) of the depth sweep.
DEPTHS = (0, 25, 50, 75, 100)
#: Relative tolerance on context + question tokens.
LENGTH_TOLERANCE = 0.03

_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
              "Memorize the ones that appear most often.\n")

_FACTS_INTRO = "Read the following passage from a novel carefully. I will ask you about some facts in it afterwards.\n"
_CHARACTERS_INTRO = "Read the following passage from a novel carefully. I will ask you about it afterwards.\n"
#: Places of Austen's novels: capitalised words never written in lowercase that are not people (checked by hand
#: against every such word seen 40 times or more).
_AUSTEN_PLACES = frozenset(
    "London Mansfield Hartfield Highbury Randalls Barton Longbourn Uppercross Netherfield Kellynch Lyme Meryton "
    "Sotherton Norland Pemberley Rosings Donwell Portsmouth Hertfordshire Bath Delaford Cleveland Northanger "
    "Woodston Fullerton Brighton Kent Devonshire Derbyshire Surrey Oxford Combe Hunsford Everingham Enscombe Weymouth "
    "Antigua".split())
#: Neither people nor places one lives in: titles, and countries (too broad an answer to "where").
_TITLES_AND_COUNTRIES = frozenset("Mrs Miss Lady Lord Colonel Captain Chapter England Ireland".split())


class LengthTooShort(ValueError):
    """A task's refusal of a length too short for its example; ``length`` is the length refused."""

    def __init__(self, message: str, length: int):
        super().__init__(message)
        self.length = length


MAX_NEW_TOKENS = {"niah": 16, "niah_multivalue": 48, "vt": 30, "cwe": 48, "facts": 24, "characters": 48}


@functools.lru_cache(maxsize=1)
def _austen_sentences() -> tuple[str, ...]:
    from kvpress_cpp.texts import austen_text

    text = re.sub(r"\s+", " ", austen_text())
    return tuple(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", text) if len(s) > 1)


@functools.lru_cache(maxsize=1)
def _austen_words() -> tuple[str, ...]:
    """Lowercase Austen words of 5-9 letters seen at least 20 times: the vocabulary of keys and of ``cwe``."""
    counts = Counter(re.findall(r"\b[a-z]{5,9}\b", " ".join(_austen_sentences())))
    return tuple(sorted(w for w, c in counts.items() if c >= 20))


@functools.lru_cache(maxsize=1)
def _austen_characters() -> frozenset[str]:
    """Names of Austen's people: capitalised words seen at least 20 times, never in lowercase, not a title, a place,
    a country, a month or a weekday, nor a plural."""
    text = " ".join(_austen_sentences())
    lower = set(re.findall(r"\b[a-z]{3,}\b", text))
    counts = Counter(re.findall(r"\b[A-Z][a-z]{2,}\b", text))
    not_names = _TITLES_AND_COUNTRIES | _AUSTEN_PLACES | set(calendar.month_name) | set(calendar.day_name)
    names = {w for w, c in counts.items() if c >= 20 and w.lower() not in lower and w not in not_names}
    return frozenset(w for w in names if w[:-1] not in names)  # not a family's plural (the Bertrams)


class _Sentences:
    """Sentences with their token counts (tokenised one by one: joined with spaces, the counts add up to within a
    token or two per thousand)."""

    def __init__(self, sentences: list[str], count: Callable[[list[str]], list[int]]):
        self.sentences = sentences
        self.tokens = count(sentences)


def _token_counter(tokenizer) -> Callable[[list[str]], list[int]]:
    def count(texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in tokenizer([" " + t for t in texts], add_special_tokens=False).input_ids]
    return count


def _austen_haystack(rng: random.Random, tokens: int, count) -> _Sentences:
    """Consecutive Austen sentences from a random place, about ``tokens`` tokens long."""
    sentences = _austen_sentences()
    # A sentence is at least a token, and half the novels (~15k sentences, ~450k tokens) hold more than any context:
    # the candidates never run off the end, and a start is drawn for any length (32k included).
    reach = min(tokens, len(sentences) // 2)
    start = rng.randrange(len(sentences) - reach)
    candidates = list(sentences[start:start + reach])
    picked, total = [], 0
    for sentence, n in zip(candidates, count(candidates)):
        if total + n > tokens:
            # Fill the rest with the longest word prefix of the next sentence that fits (bisection on words).
            words, lo, hi = sentence.split(), 0, len(sentence.split())
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if count([" ".join(words[:mid])])[0] <= tokens - total else (lo, mid - 1)
            if lo:
                picked.append(" ".join(words[:lo]))
            break
        picked.append(sentence)
        total += n
    return _Sentences(picked, count)


def _noise_haystack(tokens: int, count) -> _Sentences:
    unit = [s + "." for s in NOISE.rstrip(".").split(". ")]
    per_unit = sum(count(unit))
    return _Sentences(unit * max(1, tokens // per_unit), count)


def _insert(haystack: _Sentences, items: list[str], depths: list[float]) -> str:
    """The haystack with items[i] placed between sentences at depth depths[i] (fraction of its tokens)."""
    cumulative = [0]
    for n in haystack.tokens:
        cumulative.append(cumulative[-1] + n)
    slots: dict[int, list[str]] = {}
    for item, depth in sorted(zip(items, depths), key=lambda p: p[1]):
        target = depth * cumulative[-1]
        index = bisect.bisect_left(cumulative, target)  # the first sentence boundary at or after the target...
        if index > 0 and target - cumulative[index - 1] < cumulative[index] - target:
            index -= 1  # ...or the one before it, whichever is nearer
        slots.setdefault(index, []).append(item)
    out = []
    for i, sentence in enumerate(haystack.sentences + [""]):
        out.extend(slots.get(i, []))
        if sentence:
            out.append(sentence)
    return " ".join(out)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _keys(rng: random.Random, n: int) -> list[str]:
    """n distinct hyphenated word pairs (never a phrase of the haystack: Austen has no such hyphenations)."""
    words = _austen_words()
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in keys:
            keys.append(key)
    return keys


def _fit(build: Callable[[int], dict], length: int, count) -> dict:
    """Call build(haystack_tokens) and adjust the haystack until context + question hold `length` tokens within
    the tolerance (build reports its own length as row['context_tokens'] + question tokens)."""
    budget = length
    for _ in range(6):
        row = build(budget)
        total = count([row["context"]])[0] + count([row["question"]])[0]
        if abs(total - length) <= LENGTH_TOLERANCE * length / 2:
            break
        budget += length - total
    if abs(total - length) > LENGTH_TOLERANCE * length:
        # Short lengths: a task's fixed text (needles, instructions) or its haystack's steps (RULER's noise comes in
        # 5-sentence units) can leave no fit within the tolerance. The row is kept, and said to be off.
        warnings.warn(f"ruler_data: a row of {length} tokens holds {total} ({(total - length) / length:+.1%}), "
                      f"outside the {LENGTH_TOLERANCE:.0%} tolerance: the task's fixed text or its haystack's steps "
                      f"are too coarse for this length", stacklevel=3)
    row["context_tokens"] = count([row["context"]])[0]
    return row


def _niah(rng, length, count, *, noise: bool, n_keys: int = 1, n_values: int = 1, depth: float | None = None):
    keys, values = _keys(rng, n_keys), [[_number(rng) for _ in range(n_values)] for _ in range(n_keys)]
    needles = [_NEEDLE.format(key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    depths = [depth if depth is not None else rng.random() for _ in needles]
    asked = rng.randrange(n_keys)
    key, answer = keys[asked], values[asked]
    plural = n_values > 1
    haystack_seed = rng.random()  # every refit of the length starts the haystack at the same sentence

    def build(tokens: int) -> dict:
        haystack = (_noise_haystack(tokens, count) if noise
                    else _austen_haystack(random.Random(haystack_seed), tokens, count))
        context = _NIAH_INTRO + _insert(haystack, needles, depths) + "\n"
        question = (f"What are all the special magic numbers for {key} mentioned in the provided text?" if plural
                    else f"What is the special magic number for {key} mentioned in the provided text?")
        prefix = (f" Answer: The special magic numbers for {key} mentioned in the provided text are" if plural
                  else f" Answer: The special magic number for {key} mentioned in the provided text is")
        return {"context": context, "question": question, "answer_prefix": prefix, "answer": answer}

    return _fit(build, length, count)


def _vt(rng, length, count, hops: int = 4):
    letters = string.ascii_uppercase
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(letters) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(rng.random() for _ in chain)

    def build(tokens: int) -> dict:
        context = _VT_INTRO + _insert(_noise_haystack(tokens, count), chain, depths) + "\n"
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, {len(names)} "
                  f"variables are assigned the value {value}, they are:")
        return {"context": context, "question": question, "answer_prefix": prefix, "answer": names}

    return _fit(build, length, count)


def _cwe(rng, length, count, n_common: int = 10, rare_max: int = 3):
    words = list(_austen_words())
    rng.shuffle(words)
    common, rare_pool = words[:n_common], words[n_common:]
    word_tokens = sum(count(common)) / n_common

    def build(tokens: int) -> dict:
        # Items "<i>. <word>": the index digits are one token each, plus ". " and the word.
        items = int(tokens / (word_tokens + 2 + len(str(int(tokens / (word_tokens + 4))))))
        # Each common word more often than any rare one, and all of them in the list: a list too short for that has
        # no answer.
        freq = min(max(6, items // (2 * n_common)), items // n_common)
        if freq <= rare_max:
            raise LengthTooShort(f"cwe: a length of {length} tokens leaves room for {items} list items, too few "
                                 f"for {n_common} common words {rare_max + 1} times each (a longer length is needed)",
                                 length)
        listing = [w for w in common for _ in range(freq)]
        item_rng = random.Random(f"{len(listing)}-{common[0]}")
        rare = iter(rare_pool)
        while len(listing) < items:
            listing += [next(rare)] * item_rng.randint(1, rare_max)
        listing = listing[:items]
        item_rng.shuffle(listing)
        context = _CWE_INTRO + " ".join(f"{i + 1}. {w}" for i, w in enumerate(listing)) + "\n"
        question = f"Question: What are the {n_common} most common words in the above list?"
        prefix = f" Answer: The top {n_common} words that appear most often in the list are:"
        return {"context": context, "question": question, "answer_prefix": prefix, "answer": common}

    return _fit(build, length, count)


def _facts(rng, length, count, n_facts: int = 4):
    """Multi-fact QA on real text: ``n_facts`` statements "<person> lives in <place>." about Austen's people and
    places, placed between the sentences of an Austen passage that names none of them; the question asks where one
    of the people lives (the others are distractors of the same form). Asking for two at once was tried: SmolLM2
    answers the first and stops, 31% uncompressed on 8 examples, against 50% for one."""
    people, places = sorted(_austen_characters()), sorted(_AUSTEN_PLACES)
    haystack_seed, depths, order = rng.random(), [rng.random() for _ in range(n_facts)], rng.random()

    def build(tokens: int) -> dict:
        haystack = _austen_haystack(random.Random(haystack_seed), tokens, count)
        named = set(re.findall(r"\b[A-Z][a-z]+\b", " ".join(haystack.sentences)))
        pick = random.Random(order)  # the same people and places at every refit of the length
        who = pick.sample([p for p in people if p not in named], n_facts)
        where = pick.sample([p for p in places if p not in named], n_facts)
        facts = [f"{person} lives in {place}." for person, place in zip(who, where)]
        question = f"Question: Where does {who[0]} live, according to the passage above?"
        return {"context": _FACTS_INTRO + _insert(haystack, facts, depths) + "\n", "question": question,
                "answer_prefix": f" Answer: {who[0]} lives in", "answer": [where[0]]}

    return _fit(build, length, count)


def _characters(rng, length, count, named: int = 2):
    """Who the passage is about, on real text: an Austen passage, unchanged; the answer is the ``named`` people it
    names most often (each at least three times, strictly more often than the next). A free answer that
    summarises the passage: its agreement with the full cache's answer (ROUGE-L) is the measure beyond the names."""
    characters = _austen_characters()
    question = ("Question: Who are the main characters of the passage above, and what happens to them? "
                "Answer in two or three sentences.")
    for _ in range(100):  # passages until one has `named` clear protagonists
        haystack_seed = rng.random()

        def build(tokens: int) -> dict:
            context = " ".join(_austen_haystack(random.Random(haystack_seed), tokens, count).sentences)
            mentions = Counter(w for w in re.findall(r"\b[A-Z][a-z]{2,}\b", context) if w in characters)
            ranked = mentions.most_common(named + 1) + [("", 0)] * (named + 1)  # a passage may name no one
            clear = ranked[named - 1][1] >= 3 and ranked[named - 1][1] > ranked[named][1]
            return {"context": _CHARACTERS_INTRO + context + "\n", "question": question, "answer_prefix": " Answer:",
                    "answer": [w for w, _ in ranked[:named]] if clear else []}

        row = _fit(build, length, count)
        if row["answer"]:
            return row
    raise LengthTooShort(f"characters: no {length}-token passage with {named} clear protagonists in 100 tries", length)


#: task name → (builder(rng, length, count) → row, max_new_tokens)
TASKS: dict[str, tuple[Callable, int]] = {
    "niah_single_1": (functools.partial(_niah, noise=True), MAX_NEW_TOKENS["niah"]),
    "niah_single_2": (functools.partial(_niah, noise=False), MAX_NEW_TOKENS["niah"]),
    "niah_multikey_1": (functools.partial(_niah, noise=False, n_keys=4), MAX_NEW_TOKENS["niah"]),
    "niah_multivalue": (functools.partial(_niah, noise=False, n_values=4), MAX_NEW_TOKENS["niah_multivalue"]),
    "vt": (_vt, MAX_NEW_TOKENS["vt"]),
    "cwe": (_cwe, MAX_NEW_TOKENS["cwe"]),
    "facts": (_facts, MAX_NEW_TOKENS["facts"]),
    "characters": (_characters, MAX_NEW_TOKENS["characters"]),
    **{f"niah_depth_{d}": (functools.partial(_niah, noise=False, depth=d / 100), MAX_NEW_TOKENS["niah"])
       for d in DEPTHS},
}


def default_tasks() -> list[str]:
    return list(TASKS)


def generate(tokenizer, length: int, examples: int | dict[str, int | range], seed: int = 0,
             tasks: list[str] | None = None) -> pd.DataFrame:
    """Rows of every task at ``length`` tokens: ``examples`` per task (or a dict task → count, or task → range of
    example indices: example i of a task is the same whichever range it is generated in). A length too short for
    a task raises :class:`LengthTooShort`, naming the shortest length these examples are generated at."""
    try:
        return _generate(tokenizer, length, examples, seed, tasks)
    except LengthTooShort as error:
        shortest = shortest_length(tokenizer, length, examples, seed, tasks)
        raise LengthTooShort(f"{error}; the shortest length these examples are generated at is {shortest}",
                             length) from None


def shortest_length(tokenizer, length: int, examples: int | dict[str, int | range], seed: int = 0,
                    tasks: list[str] | None = None) -> int:
    """The shortest length above ``length`` (one the generator refuses) at which :func:`generate` builds these
    examples, found with the generator itself (doubling, then bisection): it depends on the tokenizer and on the
    examples drawn."""
    def fits(n: int) -> bool:
        try:
            with warnings.catch_warnings():  # rows outside the tolerance are kept: not a refusal
                warnings.simplefilter("ignore")
                _generate(tokenizer, n, examples, seed, tasks)
        except LengthTooShort:
            return False
        return True

    refused, fitted = max(length, 0), max(2 * length, 1)
    while not fits(fitted):
        refused, fitted = fitted, 2 * fitted
    while fitted - refused > 1:
        middle = (refused + fitted) // 2
        refused, fitted = (refused, middle) if fits(middle) else (middle, fitted)
    return fitted


def _generate(tokenizer, length: int, examples: int | dict[str, int | range], seed: int,
              tasks: list[str] | None) -> pd.DataFrame:
    if length < 1:  # _fit divides by the length
        raise LengthTooShort(f"a length of {length} tokens holds no example", length)
    count = _token_counter(tokenizer)
    rows = []
    for task in tasks or (list(examples) if isinstance(examples, dict) else default_tasks()):
        build, max_new_tokens = TASKS[task]
        n = examples[task] if isinstance(examples, dict) else examples
        for i in (n if isinstance(n, range) else range(n)):
            rng = random.Random(f"{seed}-{task}-{length}-{i}")
            row = build(rng, length, count)
            depth = int(task.rsplit("_", 1)[1]) if task.startswith("niah_depth_") else -1
            rows.append({**row, "task": task, "max_new_tokens": max_new_tokens, "length": length, "depth": depth,
                         "seed": seed, "index": i})
    return pd.DataFrame(rows)


def write_dataset(df: pd.DataFrame, root: Path) -> list[Path]:
    """Write ``<root>/<length>/test.parquet`` per length: a folder ``datasets.load_dataset(root, data_dir=<length>,
    split="test")`` reads, which is what kvpress's evaluate.py calls with ``data_dir``."""
    paths = []
    for length, part in df.groupby("length"):
        folder = Path(root) / str(length)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "test.parquet"
        part.reset_index(drop=True).to_parquet(path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="dataset root: writes <out>/<length>/test.parquet")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--examples", type=int, default=4, help="examples per task and length")
    parser.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS))
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="tokenizer that lengths are counted in (the embedded default, or a HF name/path)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.examples < 1:  # 0 wrote nothing and failed in pandas' groupby; the results CLI refuses it alike
        parser.error(f"--examples must be at least 1, got {args.examples}")
    if bad := [n for n in args.lengths if n < 1]:  # a negative length wrote a folder named after it
        parser.error(f"--lengths are context lengths in tokens, at least 1: got {bad}")
    for name in ("lengths", "tasks"):  # a repeated value wrote its examples twice, weighing them twice in a score
        values = getattr(args, name) or []
        if repeated := sorted({v for v in values if values.count(v) > 1}):
            parser.error(f"--{name} repeats {repeated}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out}: not a directory")
    from kvpress_cpp.evaluation.models import DEFAULT_MODEL_NAME, load_tokenizer
    from kvpress_cpp.models import local_model_problem

    if args.model != DEFAULT_MODEL_NAME and (problem := local_model_problem(args.model)):
        parser.error(f"--model {args.model}: {problem}")
    tokenizer = load_tokenizer(args.model)
    try:  # shortest first: a length too short for a task is refused before the long ones are generated
        df = pd.concat([generate(tokenizer, n, args.examples, args.seed, args.tasks) for n in sorted(args.lengths)])
    except LengthTooShort as error:
        parser.error(f"--lengths {error.length}: {error}")
    for path in write_dataset(df, Path(args.out)):
        print("wrote", path)


if __name__ == "__main__":
    main()
