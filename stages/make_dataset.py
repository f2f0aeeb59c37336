"""Generate the embedded default conversation dataset: data/train.jsonl and data/heldout.jsonl.

Every conversation is made here from templates and a seeded RNG (no copied corpora). The tasks are
chosen so that an answer is (almost) a function of its prompt: arithmetic with worked steps, counting,
spelling, list reversal, sorting, unit conversion, records of made-up entities, numbers in words,
sentence transforms, multiplication tables and templated Python. A small LM learns them to a low loss,
and a drafter conditioned on that LM's hidden states can predict many tokens of the answer ahead.

    python stages/make_dataset.py --out data --train 2000 --heldout 100 --seed 0

Output is byte-for-byte deterministic for a given (seed, train, heldout): the test suite regenerates it
and compares with the committed files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# ---------------------------------------------------------------------------------------------- words

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "st", "tr", "sh"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
CODAS = ["", "", "", "n", "r", "l", "s", "m", "th"]

COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown"]
FRUITS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "pear", "plum", "melon"]
ANIMALS = ["cat", "dog", "horse", "rabbit", "fox", "owl", "bear", "wolf", "otter", "goat", "mouse", "eagle"]
TOOLS = ["hammer", "wrench", "ladder", "brush", "shovel", "needle", "rope", "lamp", "bucket", "saw"]
ADJS = ["small", "quiet", "happy", "old", "bright", "tired", "clever", "brave", "lazy", "gentle"]
VERBS = ["watched", "followed", "found", "carried", "painted", "visited", "helped", "chased", "opened", "cleaned"]
PLACES = ["river", "market", "garden", "bridge", "school", "forest", "harbor", "tower", "station", "farm"]
NOUNS = ANIMALS + TOOLS + ["teacher", "farmer", "baker", "sailor", "child", "doctor"]

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
        "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Show your steps.",
    "You are a patient tutor who explains things clearly.",
    "You are a concise assistant.",
    "You are a friendly assistant that answers in plain English.",
]


def pseudo_word(rng: random.Random, syllables: int | None = None) -> str:
    n = syllables or rng.randint(2, 3)
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(n))


# Made-up names and words come from fixed pools rather than fresh syllables each time: a 4-layer LM
# trained for minutes on a CPU learns to copy and spell a few hundred recurring words well, while
# never-seen syllable strings would leave copying half-learned.
NAMES = sorted({pseudo_word(random.Random(f"name-{i}")).capitalize() for i in range(160)})
MADE_UP_WORDS = sorted({pseudo_word(random.Random(f"word-{i}"), 2) for i in range(60)})
SPELL_WORDS = COLORS + FRUITS + ANIMALS + TOOLS + ADJS + PLACES + MADE_UP_WORDS


def name(rng: random.Random) -> str:
    return rng.choice(NAMES)


def in_words(n: int) -> str:
    """English words for 0 <= n < 1_000_000."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + in_words(rest))
    rest = n % 1000
    return in_words(n // 1000) + " thousand" + ("" if rest == 0 else " " + in_words(rest))


def join_list(items: list) -> str:
    return ", ".join(str(x) for x in items)


# ---------------------------------------------------------------------------------------------- tasks
# Each task returns (user prompt, assistant answer). Phrasings vary; answer templates stay regular.


def task_addition(rng):
    a, b = rng.randint(10, 9999), rng.randint(10, 999)
    user = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b} step by step.",
                       "Please add {b} to {a}."]).format(a=a, b=b)
    da, db = str(a)[::-1], str(b)[::-1]
    places = ["Ones", "Tens", "Hundreds", "Thousands", "Ten thousands"]
    lines, carry, digits = [f"Let's add {a} and {b} column by column."], 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry, d = divmod(s, 10)
        digits.append(str(d))
        lines.append(f"{places[i]}: {terms} = {s}, write {d}" + (", carry 1." if carry else "."))
    if carry:
        lines.append(f"{places[len(digits)]}: write the carry 1.")
    lines.append(f"So {a} + {b} = {a + b}.")
    return user, "\n".join(lines)


def task_multiply(rng):
    a, b = rng.choice([v for v in range(12, 100) if v % 10]), rng.randint(2, 9)
    user = rng.choice(["What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} x {b}."]).format(a=a, b=b)
    t, o = a // 10 * 10, a % 10
    ans = (f"Split {a} into {t} and {o}.\n{t} x {b} = {t * b}.\n{o} x {b} = {o * b}.\n"
           f"Add them: {t * b} + {o * b} = {a * b}.\nSo {a} x {b} = {a * b}.")
    return user, ans


def task_table(rng):
    n, upto = rng.randint(2, 12), rng.choice([10, 10, 12])
    user = rng.choice(["Write the multiplication table of {n} up to {u}.", "Show me the {n} times table.",
                       "List {n} x 1 through {n} x {u}."]).format(n=n, u=upto)
    if "times table" in user:
        upto = 10
    lines = [f"Here is the multiplication table of {n}:"]
    lines += [f"{n} x {i} = {n * i}" for i in range(1, upto + 1)]
    return user, "\n".join(lines)


def task_count(rng):
    kind = rng.randrange(3)
    if kind == 0:
        a = rng.randint(0, 80)
        b = a + rng.randint(8, 20)
        user = rng.choice(["Count from {a} to {b}.", "Please count up from {a} to {b}."]).format(a=a, b=b)
        nums = list(range(a, b + 1))
        return user, f"Counting from {a} to {b}:\n{join_list(nums)}.\nThat is {len(nums)} numbers."
    if kind == 1:
        b = rng.randint(0, 40)
        a = b + rng.randint(8, 20)
        user = f"Count down from {a} to {b}."
        nums = list(range(a, b - 1, -1))
        return user, f"Counting down from {a} to {b}:\n{join_list(nums)}.\nThat is {len(nums)} numbers."
    step = rng.choice([2, 3, 5, 10])
    a = rng.randint(0, 20) * step
    k = rng.randint(8, 15)
    nums = [a + step * i for i in range(k)]
    user = f"Count by {step}s starting at {a}, {k} numbers in total."
    return user, f"Counting by {step}s from {a}:\n{join_list(nums)}.\nThe last number is {nums[-1]}."


def task_spell(rng):
    w = rng.choice(SPELL_WORDS)
    user = rng.choice(['Spell the word "{w}" letter by letter.', 'How do you spell "{w}"?',
                       'Spell "{w}" and tell me how many letters it has.']).format(w=w)
    vowels = [c for c in w if c in "aeiou"]
    ans = (f'The word "{w}" is spelled:\n' + "-".join(w) + f"\nIt has {len(w)} letters. "
           f"The first letter is {w[0]} and the last letter is {w[-1]}.\n"
           f"It contains {len(vowels)} vowels: {join_list(vowels)}.")
    return user, ans


def task_reverse(rng):
    pool = rng.choice([COLORS, FRUITS, ANIMALS, TOOLS])
    items = rng.sample(pool, rng.randint(4, 7))
    user = rng.choice(["Reverse this list: {l}.", "Write these items in reverse order: {l}.",
                       "Here is a list: {l}. Give it back reversed."]).format(l=join_list(items))
    lines = ["Here is the list in reverse order:"] + [f"{i + 1}. {x}" for i, x in enumerate(reversed(items))]
    lines.append(f"The list has {len(items)} items; the first is now {items[-1]} and the last is {items[0]}.")
    return user, "\n".join(lines)


def task_sort(rng):
    nums = rng.sample(range(1, 100), rng.randint(4, 7))
    desc = rng.random() < 0.3
    order = "largest to smallest" if desc else "smallest to largest"
    user = rng.choice(["Sort these numbers from {o}: {l}.", "Put {l} in order from {o}."]).format(
        o=order, l=join_list(nums))
    s = sorted(nums, reverse=desc)
    ans = (f"Sorted from {order}: {join_list(s)}.\n"
           f"The smallest number is {min(nums)} and the largest is {max(nums)}.\n"
           f"There are {len(nums)} numbers in total.")
    return user, ans


CONVERSIONS = [  # (big unit, plural, small unit plural, factor)
    ("kilometer", "kilometers", "meters", 1000), ("meter", "meters", "centimeters", 100),
    ("kilogram", "kilograms", "grams", 1000), ("hour", "hours", "minutes", 60),
    ("minute", "minutes", "seconds", 60), ("day", "days", "hours", 24), ("week", "weeks", "days", 7),
    ("liter", "liters", "milliliters", 1000), ("foot", "feet", "inches", 12), ("dozen", "dozens", "items", 12),
]


def task_convert(rng):
    one, many, small, f = rng.choice(CONVERSIONS)
    n = rng.randint(2, 15)
    user = rng.choice(["Convert {n} {m} to {s}.", "How many {s} are in {n} {m}?"]).format(n=n, m=many, s=small)
    ans = (f"One {one} is {f} {small}.\nSo {n} {many} is {n} x {f} = {n * f} {small}.\n"
           f"Answer: {n} {many} = {n * f} {small}.")
    return user, ans


ENTITY_KINDS = {
    "city": ["population", "river", "founded"],
    "planet": ["moons", "star", "color"],
    "robot": ["model", "maker", "battery"],
    "ship": ["crew", "captain", "port"],
}


def entity_record(rng):
    kind = rng.choice(sorted(ENTITY_KINDS))
    n = name(rng)
    vals = {
        "population": rng.randint(1000, 90000), "river": name(rng), "founded": rng.randint(1200, 1990),
        "moons": rng.randint(0, 9), "star": name(rng), "color": rng.choice(COLORS),
        "model": f"{rng.choice('ABCDEFGHKLMNPRSTXZ')}-{rng.randint(10, 999)}", "maker": name(rng),
        "battery": rng.randint(2, 48), "crew": rng.randint(3, 300), "captain": name(rng), "port": name(rng),
    }
    return kind, n, {k: vals[k] for k in ENTITY_KINDS[kind]}


def describe(kind, n, r):
    if kind == "city":
        return (f"{n} is a city with a population of {r['population']}. It was founded in {r['founded']} "
                f"and lies on the river {r['river']}.")
    if kind == "planet":
        return f"{n} is a {r['color']} planet that orbits the star {r['star']}. It has {r['moons']} moons."
    if kind == "robot":
        return (f"{n} is a robot of model {r['model']}, built by {r['maker']}. "
                f"Its battery lasts {r['battery']} hours.")
    return f"{n} is a ship with a crew of {r['crew']}. Its captain is {r['captain']} and its home port is {r['port']}."


def task_entity(rng):
    kind, n, r = entity_record(rng)
    fields = "; ".join(f"{k}: {v}" for k, v in r.items())
    user = rng.choice(["Here is a record about the {k} {n}. {f}. Write a short description.",
                       "Describe the {k} {n} using this data: {f}."]).format(k=kind, n=n, f=fields)
    lines = [describe(kind, n, r), "", "Summary:"] + [f"- {k}: {v}" for k, v in r.items()]
    return user, "\n".join(lines)


def task_words(rng):
    n = rng.choice([rng.randint(0, 99), rng.randint(100, 999), rng.randint(1000, 99999)])
    user = rng.choice(["Write {n} in words.", "How do you say the number {n} in English words?",
                       "Spell out the number {n}."]).format(n=n)
    d = len(str(n))
    ans = (f"The number {n} in words is: {in_words(n)}.\n"
           f"It is written with {d} digit{'s' if d > 1 else ''}: {'-'.join(str(n))}.")
    return user, ans


def sentence(rng):
    return (f"The {rng.choice(ADJS)} {rng.choice(NOUNS)} {rng.choice(VERBS)} the {rng.choice(NOUNS)} "
            f"near the {rng.choice(PLACES)}.")


def task_sentence(rng):
    s = sentence(rng)
    kind = rng.randrange(4)
    words = s[:-1].split()
    if kind == 0:
        return f'Rewrite this sentence in capital letters: "{s}"', f'In capital letters:\n"{s.upper()}"'
    if kind == 1:
        k = rng.randint(2, 3)
        return f'Repeat this sentence {k} times: "{s}"', "\n".join(f"{i + 1}. {s}" for i in range(k))
    if kind == 2:
        rev = " ".join(reversed(words))
        return (f'Reverse the order of the words in: "{s}"',
                f'The words in reverse order are:\n"{rev}"\nThe sentence has {len(words)} words.')
    lines = [f"The sentence has {len(words)} words:"] + [f"{i + 1}. {w}" for i, w in enumerate(words)]
    return f'List the words of this sentence one per line: "{s}"', "\n".join(lines)


def task_code(rng):
    fn = rng.choice(["scale", "adjust", "score", "price", "offset", "bonus"]) + "_" + rng.choice(FRUITS + ANIMALS)
    kind = rng.randrange(3)
    if kind == 0:
        m, c = rng.randint(2, 9), rng.randint(1, 20)
        user = f"Write a Python function called {fn} that returns x times {m} plus {c}."
        code = (f"def {fn}(x):\n    \"\"\"Return x times {m} plus {c}.\"\"\"\n    result = x * {m}\n"
                f"    result = result + {c}\n    return result")
        x = rng.randint(1, 9)
        tail = f"For example, {fn}({x}) returns {x} * {m} + {c} = {x * m + c}."
    elif kind == 1:
        k = rng.randint(1, 50)
        user = f"Write a Python function called {fn} that keeps the numbers in a list greater than {k}."
        code = (f"def {fn}(numbers):\n    \"\"\"Return the numbers greater than {k}.\"\"\"\n    kept = []\n"
                f"    for n in numbers:\n        if n > {k}:\n            kept.append(n)\n    return kept")
        xs = rng.sample(range(1, 100), 5)
        tail = f"For example, {fn}([{join_list(xs)}]) returns [{join_list([v for v in xs if v > k])}]."
    else:
        op = rng.choice(["sum", "max", "min"])
        user = f"Write a Python function called {fn} that returns the {op} of a list of numbers."
        code = (f"def {fn}(numbers):\n    \"\"\"Return the {op} of the numbers.\"\"\"\n    return {op}(numbers)")
        xs = rng.sample(range(1, 100), 4)
        val = {"sum": sum, "max": max, "min": min}[op](xs)
        tail = f"For example, {fn}([{join_list(xs)}]) returns {val}."
    return user, f"Here is the function:\n\n```python\n{code}\n```\n\n{tail}"


TASKS = [task_addition, task_multiply, task_table, task_count, task_spell, task_reverse, task_sort,
         task_convert, task_entity, task_words, task_sentence, task_code]


def conversation(rng: random.Random) -> list[dict]:
    msgs = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    task = rng.choice(TASKS)
    for t in range(turns):
        # Follow-ups mostly stay on the same task, as users do ("now do the same for ...").
        if t > 0 and rng.random() < 0.3:
            task = rng.choice(TASKS)
        user, answer = task(rng)
        if t > 0 and rng.random() < 0.5:
            user = rng.choice(["Now another one. ", "Thanks. Next: ", "Good. "]) + user
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return msgs


def make_splits(n_train: int, n_heldout: int, seed: int) -> tuple[list, list]:
    """Train and held-out conversations; no held-out first prompt appears anywhere in train."""
    train_rng, held_rng = random.Random(f"train-{seed}"), random.Random(f"heldout-{seed}")
    train, seen = [], set()
    while len(train) < n_train:
        c = conversation(train_rng)
        key = json.dumps(c)
        if key not in seen:
            seen.add(key)
            train.append(c)
    train_prompts = {m["content"] for c in train for m in c if m["role"] == "user"}
    heldout = []
    while len(heldout) < n_heldout:
        c = conversation(held_rng)
        if not any(m["content"] in train_prompts for m in c if m["role"] == "user"):
            heldout.append(c)
    return train, heldout


def write_jsonl(path: Path, convs: list) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}, ensure_ascii=True) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data", help="output directory (train.jsonl, heldout.jsonl)")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--heldout", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = make_splits(args.train, args.heldout, args.seed)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", heldout)
    print(f"wrote {len(train)} train and {len(heldout)} held-out conversations to {out}")


if __name__ == "__main__":
    main()
