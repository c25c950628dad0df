"""More templated training prompts: the ``math-extra`` and ``chat-extra`` sources (kinds the first templates lack).

The first templated sources (:mod:`d3d_hf.prompts.synthetic`: ``math`` and ``chat``) stay as they are, so that the
recipes recorded with them rebuild the same prompts. These sources widen the mix with kinds of their own:

* :func:`more_math_word_problems` (``math-extra[:N]``): unit conversion, averages, area and perimeter, ratios,
  simple interest, time arithmetic, multi-step inventory and work-rate problems;
* :func:`more_chat_instructions` (``chat-extra[:N]``): emails and letters with a purpose, speeches, dialogues, product
  descriptions, reviews, rewriting in another tone, explanations of how things work, step-by-step how-tos, planning,
  decisions, brain teasers, and tasks over a text given in the request (summarising, classifying reviews, turning
  notes into JSON or a table).

Deterministic given ``seed``; kinds are interleaved round-robin, so any prefix is a balanced mix. Ids are
``"math-extra/<i>"`` and ``"chat-extra/<i>"``. Every prompt passes the evaluation guard of
:func:`~d3d_hf.prompts.load_prompt_sources` (word for word and near-duplicates).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .prompt import Prompt
from .synthetic import _NAMES, _round_robin, chat_instructions, math_word_problems

_SUBJECTS = (
    "a neighbourhood cleanup day", "learning to cook", "a new bus route", "a community garden", "a school science fair",
    "a charity bake sale", "moving to a new city", "starting a podcast", "a book club", "a weekend hiking trip",
    "adopting a rescue dog", "a small online shop", "a family reunion", "a coding bootcamp", "a local art exhibition",
    "a power outage", "a library renovation", "a running club", "a recycling programme at work", "a music festival",
    "a team offsite", "a new coffee machine in the office", "a volunteer tutoring project", "a bicycle repair workshop",
    "a farmers' market", "a city marathon", "a museum night", "a language exchange meetup", "a robotics competition",
    "a photography course", "a houseplant swap", "a snow day", "a road trip across the country", "a job promotion",
)  # fmt: skip
_THINGS = (
    "a refrigerator", "a rainbow", "a microwave oven", "a bicycle gear system", "the internet", "a compass",
    "a vaccine", "a credit card", "an airplane wing", "a thermostat", "a solar eclipse", "a battery", "a search engine",
    "a lighthouse", "the stock market", "a noise-cancelling headphone", "GPS", "a hot-air balloon", "yeast in bread",
    "a dishwasher", "earthquake-resistant buildings", "a QR code", "a heat pump", "the immune system", "a touchscreen",
    "a canal lock", "a wind turbine", "a 3D printer", "the seasons", "a password manager", "photosynthesis in algae",
)  # fmt: skip
_GOALS = (
    "get better sleep", "save for a holiday", "learn to play the guitar", "run a first 10 km race", "read more books",
    "keep a tidy desk", "prepare for a job interview", "start a vegetable garden", "eat less sugar", "learn to swim",
    "organise a birthday party on a budget", "study for a history exam", "make new friends after moving",
    "spend less time on the phone", "learn basic car maintenance", "plan a week of healthy lunches",
    "write a first short story", "improve their handwriting", "teach a parent to use a smartphone",
)  # fmt: skip
_TONES = ("more formal", "friendlier", "shorter and clearer", "more persuasive", "suitable for a ten-year-old")
_PRODUCTS = (
    "a reusable water bottle", "a folding umbrella", "a desk lamp", "noise-cancelling earbuds", "a hiking backpack",
    "a cast-iron pan", "a smart watch", "a board game about trains", "a wool scarf", "an electric kettle",
)  # fmt: skip
_CHAT_EXTRA_TEMPLATES: tuple[str, ...] = (
    "Write an email to my landlord about {subject}. Keep it polite and under 150 words.",
    "Write a short speech I could give to open {subject}.",
    "Write a dialogue between two friends who disagree about {subject}.",
    "Write a product description for {product} for an online shop.",
    "Write a short, honest review of {product} that mentions one good point and one bad point.",
    "Rewrite this sentence to be {tone}: \"We regret to inform you that the event about {subject} is cancelled.\"",
    "How does {thing} work? Explain it step by step in simple words.",
    "What would happen if {thing} suddenly stopped working for a whole day? Give a few examples.",
    "Give me a step-by-step plan to help someone {goal}.",
    "My friend wants to {goal} but keeps giving up. What advice would you give them?",
    "I have to choose between organising {subject} this month or next month. What should I consider?",
    "Write a to-do list for {subject}, grouped into before, during and after.",
    "Write a short news report about {subject} in a small town.",
    "Write a limerick about {product}.",
    "Explain the difference between {thing} and {other_thing} in a short paragraph.",
    "Write a text message inviting a friend to {subject}, in a casual tone.",
    "Pretend you are a tour guide and describe {subject} to a group of visitors.",
    "What questions should I ask before buying {product}? List five.",
)
_PUZZLE_PEOPLE = ("Anna", "Bruno", "Chen", "Dana", "Eli")


def _review_block(r: random.Random) -> str:
    good = ("works perfectly", "arrived early", "is great value", "feels sturdy", "exceeded my expectations")
    bad = ("broke after a week", "arrived late", "is overpriced", "feels flimsy", "was not as described")
    lines = []
    for i in range(r.randint(3, 5)):
        product = r.choice(_PRODUCTS)
        verdict = r.choice(good) if r.random() < 0.5 else r.choice(bad)
        lines.append(f"{i + 1}. \"The {product.split(' ', 1)[1]} {verdict}.\"")
    return "\n".join(lines)


def _classify_reviews(r: random.Random) -> str:
    return (
        "Label each of these customer reviews as positive or negative, and give a one-word reason for each:\n\n"
        + _review_block(r)
    )


def _notes_to_json(r: random.Random) -> str:
    people = r.sample(_NAMES, r.randint(2, 4))
    notes = " ".join(
        f"{p} will bring {r.choice(('drinks', 'chairs', 'a speaker', 'snacks', 'plates', 'a tent'))} to "
        f"{r.choice(_SUBJECTS)} on {r.choice(('Monday', 'Tuesday', 'Friday', 'Saturday', 'Sunday'))}."
        for p in people
    )
    fmt = r.choice(("a JSON list of objects with the keys name, item and day", "a Markdown table with three columns"))
    return f"Turn these notes into {fmt}:\n\n{notes}"


def _summarise_notes(r: random.Random) -> str:
    subject = r.choice(_SUBJECTS)
    a, b, c = r.sample(_NAMES, 3)
    budget = r.randint(2, 40) * 50
    return (
        f"Summarise these meeting notes in two sentences:\n\nMeeting about {subject}. {a} said the budget is "
        f"${budget} and asked everyone to keep receipts. {b} will book the venue by Friday. {c} worried that the date "
        f"clashes with another event and will check with the council. The next meeting is in two weeks."
    )


def _ordering_puzzle(r: random.Random) -> str:
    people = r.sample(_PUZZLE_PEOPLE, 3)
    a, b, c = people
    return (
        f"{a} is taller than {b}. {c} is shorter than {b}. Who is the tallest and who is the shortest? "
        "Explain your reasoning."
    )


def _chat_template(text: str) -> Callable[[random.Random], str]:
    def make(r: random.Random) -> str:
        thing, other_thing = r.sample(_THINGS, 2)
        return text.format(
            subject=r.choice(_SUBJECTS), product=r.choice(_PRODUCTS), tone=r.choice(_TONES), thing=thing,
            other_thing=other_thing, goal=r.choice(_GOALS),
        )  # fmt: skip

    return make


def _math_unit_conversion(r: random.Random) -> str:
    a = r.choice(_NAMES)
    laps, lap_m = r.randint(4, 20), r.choice((200, 250, 400, 500))
    return (
        f"{a} ran {laps} laps of a track that is {lap_m} metres long. How many kilometres did {a} run? If {a} "
        "wants to run 10 kilometres in total, how many more laps are needed?"
    )


def _math_average(r: random.Random) -> str:
    a = r.choice(_NAMES)
    scores = [r.randint(5, 19) * 5 for _ in range(r.randint(3, 5))]
    return (
        f"{a}'s test scores this term were {', '.join(map(str, scores[:-1]))} and {scores[-1]}. What is {a}'s "
        "average score, and what score would the next test need to raise the average by 5 points?"
    )


def _math_area(r: random.Random) -> str:
    w, length = r.randint(3, 15), r.randint(4, 20)
    price = r.randint(2, 12)
    return (
        f"A rectangular garden is {w} metres wide and {length} metres long. How much fencing is needed to go around "
        f"it, and how much does it cost to cover the garden with turf at ${price} per square metre?"
    )


def _math_ratio(r: random.Random) -> str:
    a, b = r.sample(_NAMES, 2)
    x, y = r.randint(1, 5), r.randint(1, 5)
    total = (x + y) * r.randint(3, 20)
    return f"{a} and {b} share ${total} in the ratio {x}:{y}. How much does each of them get?"


def _math_interest(r: random.Random) -> str:
    a = r.choice(_NAMES)
    principal, rate, years = r.choice((500, 1000, 1500, 2000, 5000)), r.choice((2, 3, 4, 5, 10)), r.randint(2, 6)
    return (
        f"{a} puts ${principal} in a savings account that pays {rate}% simple interest per year. How much interest "
        f"does {a} earn in {years} years, and what is the total in the account then?"
    )


def _math_time(r: random.Random) -> str:
    a = r.choice(_NAMES)
    start_h, start_m = r.randint(7, 11), r.choice((0, 15, 30, 45))
    tasks = [r.choice((15, 20, 25, 30, 40, 45, 50)) for _ in range(3)]
    return (
        f"{a} starts homework at {start_h}:{start_m:02d} a.m. Math takes {tasks[0]} minutes, reading {tasks[1]} "
        f"minutes and a science project {tasks[2]} minutes, with a 10-minute break after each of the first two. At "
        "what time does the homework end?"
    )


def _math_inventory(r: random.Random) -> str:
    items, _ = r.choice((("cans of soup", ""), ("loaves of bread", ""), ("bags of rice", ""), ("boxes of tea", "")))
    stock, sold, delivered = r.randint(50, 200), r.randint(10, 40), r.randint(20, 80)
    days = r.randint(2, 5)
    return (
        f"A shop had {stock} {items} on Monday morning. It sells {sold} each day and gets a delivery of {delivered} "
        f"every second day, starting on Tuesday. How many {items} are left at the end of day {days + 1}?"
    )


def _math_work_rate(r: random.Random) -> str:
    a, b = r.sample(_NAMES, 2)
    ta, tb = r.choice(((2, 3), (3, 6), (4, 12), (6, 12), (5, 20), (10, 15)))
    return (
        f"{a} can paint a fence in {ta} hours and {b} can paint the same fence in {tb} hours. How long does it take "
        "them to paint it together?"
    )


_MATH_EXTRA_KINDS: tuple[Callable[[random.Random], str], ...] = (
    _math_unit_conversion, _math_average, _math_area, _math_ratio, _math_interest, _math_time, _math_inventory,
    _math_work_rate,
)  # fmt: skip


def more_math_word_problems(limit: int = 400, seed: int = 0) -> list[Prompt]:
    """Math word problems of eight kinds the ``math`` source lacks (conversion, averages, area, ratios, interest, time,
    inventory, work rate), each filled with random names and numbers; the user turn is the problem alone.

    Args:
        limit (`int`, default 400): Number of prompts (positive).
        seed (`int`, default 0): Seed of the draws; the same seed gives the same prompts.

    Returns:
        `list[Prompt]`: ids ``"math-extra/<index>"``, one user turn each, no duplicates.

    Raises:
        ValueError: ``limit`` is not a positive integer, or that many distinct problems could not be drawn.
    """
    return _round_robin(list(_MATH_EXTRA_KINDS), limit, seed, "math-extra")


def more_chat_instructions(limit: int = 400, seed: int = 0) -> list[Prompt]:
    """Chat requests of kinds the ``chat`` source lacks: eighteen templates (letters, speeches, dialogues, product
    texts, tone rewrites, how-things-work, plans, decisions, news, invitations, tours) over their own topic lists, and
    five tasks over a text given in the request (classifying reviews, notes to JSON or a table, summarising meeting
    notes, a reasoning puzzle).

    Args:
        limit (`int`, default 400): Number of prompts (positive).
        seed (`int`, default 0): Seed of the draws; the same seed gives the same prompts.

    Returns:
        `list[Prompt]`: ids ``"chat-extra/<index>"``, one user turn each, no duplicates.

    Raises:
        ValueError: ``limit`` is not a positive integer, or that many distinct requests could not be drawn.
    """
    makers = [_chat_template(t) for t in _CHAT_EXTRA_TEMPLATES]
    makers += [_classify_reviews, _notes_to_json, _summarise_notes, _ordering_puzzle]
    return _round_robin(makers, limit, seed, "chat-extra")


SYNTHETIC_SOURCES: dict[str, Callable[..., list[Prompt]]] = {
    "math": math_word_problems,
    "chat": chat_instructions,
    "math-extra": more_math_word_problems,
    "chat-extra": more_chat_instructions,
}
"""The templated prompt sources by the name :func:`~d3d_hf.prompts.load_prompt_sources` knows them."""

__all__ = ["SYNTHETIC_SOURCES", "more_chat_instructions", "more_math_word_problems"]
