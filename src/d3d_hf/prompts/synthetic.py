"""Templated training prompts for the text a code-only drafter never saw: math word problems and chat instructions.

A drafter is trained on its target's own answers (self-distillation, docs/DESIGN.md section 3), so what matters is
that the *kinds* of answers the target gives at evaluation time are in the data: step-by-step arithmetic for math
word problems, and prose (letters, explanations, stories, lists of advice, role play) for chat. No corpus of such
prompts ships with a package this project can install offline, and the evaluation sets must never be trained on,
so these prompts are written from templates in this module (the project's own text, no third-party data):

* :func:`math_word_problems` (``math[:N]``): grade-school problems of one to four arithmetic steps (sums,
  differences, products, rates, fractions, percentages, change, ages, ...), each with random names, items and
  numbers chosen so that every intermediate result is a whole number;
* :func:`chat_instructions` (``chat[:N]``): writing, role-play, reasoning, extraction, STEM, humanities and advice
  requests, each a template filled with a topic from the lists below.

Both are deterministic given ``seed`` and interleave their kinds round-robin, so any prefix is a balanced mix.
None of them is an evaluation prompt: :func:`~d3d_hf.prompts.load_prompt_sources` checks every prompt against
the evaluation sets word for word.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .prompt import Prompt

_NAMES = (
    "Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Imani", "Jonas", "Keiko", "Liam", "Maya",
    "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Xenia", "Yusuf", "Zoe",
)  # fmt: skip
_ITEMS = (
    ("apples", "apple"), ("marbles", "marble"), ("stickers", "sticker"), ("books", "book"), ("cookies", "cookie"),
    ("pencils", "pencil"), ("cupcakes", "cupcake"), ("seashells", "seashell"), ("tomatoes", "tomato"),
    ("postcards", "postcard"), ("eggs", "egg"), ("jars of jam", "jar"), ("notebooks", "notebook"),
)  # fmt: skip
_PLACES = ("the market", "a bakery", "the school fair", "a bookshop", "the farm stand", "a toy store")


def _math_sum_then_share(r: random.Random) -> str:
    a, b = r.sample(_NAMES, 2)
    items, _ = r.choice(_ITEMS)
    k = r.randint(2, 6)
    x, y = r.randint(3, 30), r.randint(3, 30)
    total = (x + y) * k
    friends = r.choice([n for n in (2, 3, 4, 5, 6) if total % n == 0])
    return (
        f"{a} has {x} boxes and {b} has {y} boxes. Each box holds {k} {items}. They put all the {items} together "
        f"and share them equally among {friends} friends. How many {items} does each friend get?"
    )


def _math_earn_and_spend(r: random.Random) -> str:
    a = r.choice(_NAMES)
    rate, hours, days = r.randint(8, 25), r.randint(2, 6), r.randint(3, 7)
    spend = r.randint(10, rate * hours * days // 2)
    return (
        f"{a} earns ${rate} an hour babysitting. This week {a} worked {hours} hours a day for {days} days and then "
        f"spent ${spend} on a new jacket. How much money does {a} have left from this week's pay?"
    )


def _math_discount(r: random.Random) -> str:
    a = r.choice(_NAMES)
    price = r.choice([20, 40, 60, 80, 120, 160, 200])
    pct = r.choice([10, 20, 25, 50])  # price * pct / 100 is whole for every pair
    n = r.randint(2, 5)
    return (
        f"A jacket at {r.choice(_PLACES)} costs ${price}. During a sale it is {pct}% off. {a} buys {n} of them. How "
        f"much does {a} pay in total?"
    )


def _math_rate_distance(r: random.Random) -> str:
    a = r.choice(_NAMES)
    speed, hours = r.randint(3, 12) * 5, r.randint(2, 6)
    back = r.choice([s for s in range(5, 80, 5) if speed * hours % s == 0 and s != speed])
    return (
        f"{a} drives to a lake at {speed} miles per hour and the trip takes {hours} hours. On the way back {a} "
        f"drives at {back} miles per hour. How many hours does the whole round trip take?"
    )


def _math_fraction(r: random.Random) -> str:
    a = r.choice(_NAMES)
    items, _ = r.choice(_ITEMS)
    d = r.choice([2, 3, 4, 5])
    total = d * r.randint(4, 20)
    gift = r.randint(1, total // d)
    return (
        f"{a} had {total} {items}. {a} gave 1/{d} of them to a neighbour and then ate or used {gift} more. How many "
        f"{items} does {a} have now?"
    )


def _math_ages(r: random.Random) -> str:
    a, b = r.sample(_NAMES, 2)
    age_b = r.randint(4, 15)
    k = r.randint(2, 4)
    years = r.randint(2, 10)
    return (
        f"{a} is {k} times as old as {b}. {b} is {age_b} years old. How old will {a} be in {years} years, and what "
        "will the sum of their ages be then?"
    )


def _math_change(r: random.Random) -> str:
    a = r.choice(_NAMES)
    items, item = r.choice(_ITEMS)
    n, price = r.randint(2, 9), r.randint(2, 12)
    note = r.choice([v for v in (20, 50, 100, 200) if v >= n * price])
    return (
        f"{a} buys {n} {items} at ${price} per {item} and pays with a ${note} bill. How much change does {a} get "
        "back?"
    )


def _math_weekly_total(r: random.Random) -> str:
    a = r.choice(_NAMES)
    weekday, weekend = r.randint(5, 40), r.randint(10, 60)
    weeks = r.randint(2, 5)
    return (
        f"{a} reads {weekday} pages every weekday and {weekend} pages on each day of the weekend. How many pages "
        f"does {a} read in {weeks} weeks?"
    )


def _math_percent_growth(r: random.Random) -> str:
    a = r.choice(_NAMES)
    start = r.choice([100, 200, 300, 400, 500, 800, 1000])
    pct = r.choice([10, 20, 25, 50])
    return (
        f"{a}'s lemonade stand sold {start} cups last summer. This summer sales grew by {pct}%, and {a} charges "
        f"${r.randint(1, 3)} per cup. How many cups were sold this summer, and how much money did they bring in?"
    )


def _math_groups(r: random.Random) -> str:
    students = r.randint(3, 9) * 6
    per_bus = r.choice([12, 18, 24, 30])
    teachers = r.randint(2, 6)
    return (
        f"A class trip has {students} students and {teachers} teachers. Each minibus seats {per_bus} people. How "
        "many minibuses are needed so that everyone has a seat, and how many seats will be empty?"
    )


_MATH_KINDS: tuple[Callable[[random.Random], str], ...] = (
    _math_sum_then_share, _math_earn_and_spend, _math_discount, _math_rate_distance, _math_fraction, _math_ages,
    _math_change, _math_weekly_total, _math_percent_growth, _math_groups,
)  # fmt: skip

_TOPICS = (
    "recycling", "remote work", "learning a second language", "urban gardening", "the history of the bicycle",
    "volcanoes", "public libraries", "electric cars", "healthy sleep", "the water cycle", "chess", "jazz music",
    "photosynthesis", "saving money", "the Roman Empire", "ocean tides", "time management", "coffee",
    "the printing press", "honeybees", "marathon training", "cloud computing", "the moon landing", "rainforests",
    "board games", "public speaking", "vaccines", "the Silk Road", "solar panels", "meditation", "museums",
    "composting", "weather forecasts", "the Olympic Games", "black holes", "baking bread", "social media",
    "renewable energy", "ancient Egypt", "friendship", "climate change", "birdwatching", "the human heart",
    "a first job interview", "camping", "video games", "the French Revolution", "earthquakes", "street food",
)  # fmt: skip
_ROLES = (
    "a ship captain", "a museum guide", "a medieval blacksmith", "a detective", "a chef", "an astronaut",
    "a travel agent", "a personal trainer", "a librarian", "a wildlife photographer", "a village baker",
)  # fmt: skip
_CHAT_TEMPLATES: tuple[str, ...] = (
    "Write a short blog post about {topic} for readers who know nothing about it.",
    "Write a friendly email to a colleague inviting them to a talk about {topic}.",
    "Write a short story of about 150 words in which {topic} plays an important part.",
    "Pretend you are {role}. Introduce yourself and tell me about your day, mentioning {topic}.",
    "Explain {topic} to a ten-year-old in a few short paragraphs.",
    "What are the main advantages and disadvantages of {topic}? Answer with two short lists.",
    "Give me five practical tips related to {topic}, each with one sentence of explanation.",
    "Compare {topic} and {other}: how are they similar and how are they different?",
    "Summarise the most important facts about {topic} in three bullet points.",
    "I want to give a five-minute presentation about {topic}. Suggest an outline with a title and main points.",
    "Write a persuasive paragraph arguing that schools should teach more about {topic}.",
    "What are three common misconceptions about {topic}, and what is actually true?",
    "Write a short poem about {topic}.",
    "A friend says {topic} is boring. Write a reply that makes it sound interesting.",
    "Describe a typical day in the life of someone whose job is closely related to {topic}.",
    "List the key terms someone should know about {topic} and define each in one sentence.",
)
_EXTRACTION_TEMPLATE = (
    "Read the following notes and list every person mentioned together with the city they live in, one per line "
    "as 'name: city'.\n\n{notes}"
)
_CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Hanoi", "Denver", "Perth")


def _extraction(r: random.Random) -> str:
    people = r.sample(_NAMES, r.randint(3, 5))
    sentences = []
    for name in people:
        city = r.choice(_CITIES)
        topic = r.choice(_TOPICS)
        sentences.append(
            r.choice(
                (
                    f"{name} moved to {city} last year and now volunteers at a club about {topic}.",
                    f"Yesterday I called {name}, who lives in {city} and is writing a report on {topic}.",
                    f"{name} from {city} gave a talk on {topic} at the conference.",
                )
            )
        )
    return _EXTRACTION_TEMPLATE.format(notes=" ".join(sentences))


def _round_robin(makers: list[Callable[[random.Random], str]], limit: int, seed: int, prefix: str) -> list[Prompt]:
    """`limit` prompts, the makers taken in turn, each prompt from its own seeded `random.Random`. A draw whose text
    was drawn before is redrawn; a maker that gives 200 repeats in a row has run out and leaves the rotation."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}.")
    prompts, seen = [], set()
    rng = random.Random(seed)
    active = list(makers)
    turn = 0
    while len(prompts) < limit:
        if not active:
            raise ValueError(
                f"Only {len(prompts)} distinct {prefix} prompts can be drawn, {limit} were asked for: ask for fewer."
            )
        maker = active[turn % len(active)]
        for _ in range(200):
            text = maker(random.Random(rng.getrandbits(64)))
            if text not in seen:
                break
        else:
            active.remove(maker)
            continue
        seen.add(text)
        prompts.append(Prompt(id=f"{prefix}/{len(prompts)}", messages=[{"role": "user", "content": text}]))
        turn += 1
    return prompts


def math_word_problems(limit: int = 400, seed: int = 0) -> list[Prompt]:
    """Grade-school math word problems from this module's templates (one to four arithmetic steps each).

    Ten problem kinds (shares, pay and spending, discounts, rates, fractions, ages, change, weekly totals,
    percentage growth, seating), taken in turn, each filled with random names, items and whole numbers. The
    user turn is the problem alone, as the GSM8K prompts are given (:data:`~d3d_hf.prompts.GSM8K_INSTRUCTION`),
    so the target answers in the style it answers those.

    Args:
        limit (`int`, default 400): Number of prompts (positive).
        seed (`int`, default 0): Seed of the draws; the same seed gives the same prompts.

    Returns:
        `list[Prompt]`: ids ``"math/<index>"``, one user turn each, no duplicates.

    Raises:
        ValueError: ``limit`` is not a positive integer, or that many distinct problems could not be drawn.
    """
    return _round_robin(list(_MATH_KINDS), limit, seed, "math")


def chat_instructions(limit: int = 400, seed: int = 0) -> list[Prompt]:
    """Chat requests from this module's templates: writing, role play, explanation, advice, comparison, extraction.

    Sixteen templates filled with one of about fifty everyday topics (and for role play one of eleven roles),
    plus an extraction task over generated notes, taken in turn.

    Args:
        limit (`int`, default 400): Number of prompts (positive).
        seed (`int`, default 0): Seed of the draws; the same seed gives the same prompts.

    Returns:
        `list[Prompt]`: ids ``"chat/<index>"``, one user turn each, no duplicates.

    Raises:
        ValueError: ``limit`` is not a positive integer, or that many distinct requests could not be drawn.
    """

    def template(text: str) -> Callable[[random.Random], str]:
        def make(r: random.Random) -> str:
            topic, other = r.sample(_TOPICS, 2)
            return text.format(topic=topic, other=other, role=r.choice(_ROLES))

        return make

    return _round_robin([template(t) for t in _CHAT_TEMPLATES] + [_extraction], limit, seed, "chat")


__all__ = ["chat_instructions", "math_word_problems"]
