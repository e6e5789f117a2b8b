"""Generate the tiny world's corpus (chat, math, code) and held-apart eval prompts from templates.

Everything here is written for this project (word lists, templates, replies), so the generated
text is CC0. Replies are deliberately regular - fixed phrasing, step-by-step arithmetic, small
functions from templates - so a 4-layer target learns them in minutes and a drafter can reach a
high acceptance length on its continuations. Seeded: the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from pipeline.core.io import atomic_write_text

SUBSETS = ("chat", "math", "code")
# how a subset is stored: chat and math in ShareGPT form, code in OpenAI messages form
FORMATS = {"chat": "sharegpt", "math": "sharegpt", "code": "openai"}
# a phrase every assistant reply of the subset contains (the tests look for it in the target's output)
KEYWORDS = {"chat": "anything else", "math": "The answer is", "code": "def "}

N_CONVERSATIONS = 200
N_EVAL = 20

# ---------------------------------------------------------------- chat
ANIMALS = {  # animal: (habitat, food, sound)
    "cat": ("house", "fish", "meow"), "dog": ("yard", "meat", "woof"), "cow": ("field", "grass", "moo"),
    "duck": ("pond", "seeds", "quack"), "owl": ("forest", "mice", "hoot"), "horse": ("stable", "hay", "neigh"),
    "sheep": ("meadow", "grass", "baa"), "frog": ("swamp", "insects", "croak"), "lion": ("savanna", "meat", "roar"),
    "bee": ("hive", "nectar", "buzz"), "pig": ("farm", "corn", "oink"), "goat": ("hills", "leaves", "bleat"),
    "mouse": ("barn", "cheese", "squeak"), "wolf": ("woods", "deer", "howl"),
}
THINGS = {
    "banana": "yellow", "apple": "red", "lemon": "yellow", "cherry": "red", "carrot": "orange",
    "pumpkin": "orange", "leaf": "green", "lime": "green", "plum": "purple", "grape": "purple",
    "cloud": "white", "snowball": "white", "crow": "black", "tomato": "red", "sky": "blue", "coal": "black",
}
TIPS = {
    "sleep": "go to bed at the same time every night",
    "studying": "study in short sessions and take small breaks",
    "cooking": "taste your food while you cook it",
    "running": "start slowly and run a little longer each week",
    "reading": "read a few pages every day before bed",
    "saving money": "write down everything you spend for one month",
    "writing": "write a short first draft and then edit it",
    "gardening": "water your plants early in the morning",
    "drawing": "draw simple shapes before you draw details",
    "music": "practice a little every day instead of a lot once a week",
}
NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Ivy", "Jack", "Kate", "Leo",
         "Mia", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tina", "Victor"]
CHAT_SYSTEM = "You are a friendly assistant. Answer in short, clear sentences."
CLOSING = "Is there anything else I can help you with?"


def _animal(rng: random.Random) -> tuple[str, str]:
    a = rng.choice(sorted(ANIMALS))
    where, food, sound = ANIMALS[a]
    form = rng.choice(["Can you describe a {a}?", "Tell me about the {a}.", "What do you know about a {a}?"])
    reply = (f"Sure! A {a} is an animal that lives in the {where}. A {a} likes to eat {food}. "
             f"A {a} says {sound}. {CLOSING}")
    return form.format(a=a), reply


def _thing(rng: random.Random) -> tuple[str, str]:
    t = rng.choice(sorted(THINGS))
    form = rng.choice(["What color is a {t}?", "Which color does a {t} have?"])
    return form.format(t=t), f"Sure! A {t} is usually {THINGS[t]}. {CLOSING}"


def _tip(rng: random.Random) -> tuple[str, str]:
    topic = rng.choice(sorted(TIPS))
    form = rng.choice(["Give me a tip about {t}.", "Do you have advice on {t}?"])
    return form.format(t=topic), f"Sure! Here is a tip about {topic}: {TIPS[topic]}. {CLOSING}"


def _greeting(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    form = rng.choice(["Hello! My name is {n}.", "Hi, I am {n}."])
    return form.format(n=name), f"Hello {name}! Nice to meet you. {CLOSING}"


CHAT_TURNS: list[Callable[[random.Random], tuple[str, str]]] = [_animal, _thing, _tip, _greeting]


def _chat_first(rng: random.Random) -> tuple[str, str, dict]:
    return (*rng.choice(CHAT_TURNS)(rng), {})


def _chat_next(rng: random.Random, state: dict) -> tuple[str, str]:
    return rng.choice([_animal, _thing, _tip])(rng)


# ---------------------------------------------------------------- math
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cookies", "stamps"]
MATH_SYSTEM = "You are a math tutor. Work step by step."


def _add_steps(a: int, b: int) -> str:
    return f"Step 1: Start with {a}.\nStep 2: Add {b}.\nStep 3: {a} + {b} = {a + b}.\nThe answer is {a + b}."


def _sub_steps(a: int, b: int) -> str:
    return f"Step 1: Start with {a}.\nStep 2: Take away {b}.\nStep 3: {a} - {b} = {a - b}.\nThe answer is {a - b}."


def _mul_steps(a: int, b: int) -> str:
    return (f"Step 1: Take {a} groups of {b}.\nStep 2: Multiply {a} by {b}.\nStep 3: {a} x {b} = {a * b}.\n"
            f"The answer is {a * b}.")


def _math_first(rng: random.Random) -> tuple[str, str, dict]:
    kind = rng.choice(["add", "sub", "mul", "story_add", "story_sub"])
    if kind == "add":
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        form = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute the sum of {a} and {b}."])
        return form.format(a=a, b=b), _add_steps(a, b), {"value": a + b}
    if kind == "sub":
        a = rng.randint(10, 99)
        b = rng.randint(1, a)
        form = rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}."])
        return form.format(a=a, b=b), _sub_steps(a, b), {"value": a - b}
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        form = rng.choice(["What is {a} x {b}?", "Multiply {a} by {b}.", "What is {a} times {b}?"])
        return form.format(a=a, b=b), _mul_steps(a, b), {"value": a * b}
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if kind == "story_add":
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        prompt = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        reply = (f"{name} starts with {a} {item}.\n{name} gets {b} more {item}.\n{a} + {b} = {a + b}.\n"
                 f"The answer is {a + b}.")
        return prompt, reply, {"value": a + b}
    a = rng.randint(10, 60)
    b = rng.randint(1, a)
    prompt = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
    reply = (f"{name} starts with {a} {item}.\n{name} gives away {b} {item}.\n{a} - {b} = {a - b}.\n"
             f"The answer is {a - b}.")
    return prompt, reply, {"value": a - b}


def _math_next(rng: random.Random, state: dict) -> tuple[str, str]:
    v = state["value"]
    if rng.random() < 0.5:
        d = rng.randint(1, 20)
        state["value"] = v + d
        return f"Now add {d} to that.", _add_steps(v, d)
    state["value"] = v * 2
    return "Now double it.", (f"Step 1: Take the last answer, {v}.\nStep 2: Multiply it by 2.\n"
                              f"Step 3: {v} x 2 = {v * 2}.\nThe answer is {v * 2}.")


# ---------------------------------------------------------------- code
BINARY = {  # op: (what the prompt asks, expression, what the reply says it returns)
    "add": ("adds two numbers", "a + b", "the sum of a and b"),
    "subtract": ("subtracts two numbers", "a - b", "a minus b"),
    "multiply": ("multiplies two numbers", "a * b", "the product of a and b"),
    "divide": ("divides two numbers", "a / b", "a divided by b"),
    "larger": ("returns the larger of two numbers", "max(a, b)", "the larger of a and b"),
    "smaller": ("returns the smaller of two numbers", "min(a, b)", "the smaller of a and b"),
}
LISTS = {  # op: (what the prompt asks, expression)
    "total": ("returns the sum of a list of numbers", "sum(xs)"),
    "biggest": ("returns the largest item in a list", "max(xs)"),
    "smallest": ("returns the smallest item in a list", "min(xs)"),
    "count": ("returns the length of a list", "len(xs)"),
    "average": ("returns the average of a list of numbers", "sum(xs) / len(xs)"),
    "reverse": ("reverses a list", "xs[::-1]"),
    "sort": ("returns a sorted copy of a list", "sorted(xs)"),
}
CHECKS = {  # op: (what the prompt asks, expression)
    "even": ("checks if a number is even", "n % 2 == 0"),
    "odd": ("checks if a number is odd", "n % 2 == 1"),
    "positive": ("checks if a number is positive", "n > 0"),
    "negative": ("checks if a number is negative", "n < 0"),
    "zero": ("checks if a number is zero", "n == 0"),
}
SUFFIXES = ["", "_numbers", "_values", "_items"]
CODE_SYSTEM = "You are a helpful coding assistant. Reply with Python code."


def _fn_name(rng: random.Random, op: str, prefix: str = "") -> str:
    return prefix + op + rng.choice(SUFFIXES)


def _code_reply(fname: str, args: str, expr: str, says: str) -> str:
    return (f"Here is the function:\n```python\ndef {fname}({args}):\n    return {expr}\n```\n"
            f"The function `{fname}` returns {says}.")


def _code_first(rng: random.Random) -> tuple[str, str, dict]:
    kind = rng.choice(["binary", "list", "check"])
    if kind == "binary":
        op = rng.choice(sorted(BINARY))
        asks, expr, says = BINARY[op]
        fname, args = _fn_name(rng, op), "a, b"
    elif kind == "list":
        op = rng.choice(sorted(LISTS))
        asks, expr = LISTS[op]
        fname, args, says = _fn_name(rng, op, "list_"), "xs", f"`{expr}`"
    else:
        op = rng.choice(sorted(CHECKS))
        asks, expr = CHECKS[op]
        fname, args, says = "is_" + op, "n", f"True when `{expr}` holds"
    prompt = f"Write a Python function named {fname} that {asks}."
    return prompt, _code_reply(fname, args, expr, says), {"fname": fname, "args": args, "expr": expr}


def _code_next(rng: random.Random, state: dict) -> tuple[str, str]:
    fname, args, expr = state["fname"], state["args"], state["expr"]
    if rng.random() < 0.5:
        call = {"a, b": "(6, 3)", "xs": "([3, 1, 2])", "n": "(4)"}[args]
        return "Show me how to call it.", (f"Here is a call:\n```python\nprint({fname}{call})\n```\n"
                                           f"This prints the result of `{fname}{call}`.")
    return "Add a docstring to it.", (f"Here is the function with a docstring:\n```python\ndef {fname}({args}):\n"
                                      f"    \"\"\"Return {expr}.\"\"\"\n    return {expr}\n```\n"
                                      f"The docstring says what `{fname}` returns.")


# ---------------------------------------------------------------- assembly
GENERATORS = {
    "chat": (_chat_first, _chat_next, CHAT_SYSTEM),
    "math": (_math_first, _math_next, MATH_SYSTEM),
    "code": (_code_first, _code_next, CODE_SYSTEM),
}


def _as_row(turns: list[tuple[str, str]], fmt: str) -> dict:
    if fmt == "openai":
        return {"messages": [{"role": r, "content": c} for r, c in turns]}
    role = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": role[r], "value": c} for r, c in turns]}


def generate_subset(subset: str, seed: int, n: int = N_CONVERSATIONS, n_eval: int = N_EVAL) -> tuple[list, list]:
    """(corpus rows, eval rows) of one subset; eval prompts never appear as a corpus user turn."""
    first, follow, system = GENERATORS[subset]
    rng = random.Random(f"{seed}/{subset}")
    held: list[str] = []
    while len(held) < n_eval:  # held-apart prompts are drawn first and then banned from the corpus
        prompt = first(rng)[0]
        if prompt not in held:
            held.append(prompt)
    banned = set(held)
    rows = []
    while len(rows) < n:
        prompt, reply, state = first(rng)
        if prompt in banned:
            continue
        turns = [("system", system)] if rng.random() < 0.25 else []
        turns += [("user", prompt), ("assistant", reply)]
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):  # about half are multi-turn
            prompt, reply = follow(rng, state)
            if prompt in banned:
                break
            turns += [("user", prompt), ("assistant", reply)]
        rows.append(_as_row(turns, FORMATS[subset]))
    return rows, [{"prompt": p} for p in held]


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)


def write_corpus(root: str | Path, seed: int) -> dict[str, int]:
    """Write corpus/{subset}.jsonl and eval/{subset}.jsonl under `root`; returns rows per file."""
    root = Path(root)
    counts = {}
    for subset in SUBSETS:
        rows, held = generate_subset(subset, seed)
        atomic_write_text(root / "corpus" / f"{subset}.jsonl", _jsonl(rows))
        atomic_write_text(root / "eval" / f"{subset}.jsonl", _jsonl(held))
        counts[f"corpus/{subset}"], counts[f"eval/{subset}"] = len(rows), len(held)
    return counts


def to_messages(row: dict) -> list[dict]:
    """One corpus row (either form) as OpenAI-style messages for the chat template."""
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    role = {"system": "system", "human": "user", "gpt": "assistant"}
    return [{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]]


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def load_conversations(root: str | Path) -> list[tuple[str, list[dict]]]:
    """(subset, messages) for every corpus row under root/corpus, subsets in fixed order."""
    return [(s, to_messages(r)) for s in SUBSETS for r in read_jsonl(Path(root) / "corpus" / f"{s}.jsonl")]
