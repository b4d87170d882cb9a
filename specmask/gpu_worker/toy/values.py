"""Realistic string values for the synthetic corpus, keyed by property name.

A key "<schema>.<property>" wins over a bare "<property>" so that, e.g., a
product's `name` is a product and a user's `name` is a person. Every string
property without an `enum` in schemas.py must have a generator here (a test
checks this via corpus generation).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

StringGen = Callable[[random.Random], str]

FIRST = [
    "Alice",
    "Bob",
    "Carla",
    "David",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kira",
    "Luis",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Yusuf",
    "Zoe",
]
LAST = [
    "Smith",
    "Garcia",
    "Chen",
    "Müller",
    "Rossi",
    "Kowalski",
    "Okafor",
    "Tanaka",
    "Dubois",
    "Silva",
    "Johnson",
    "Novak",
    "Haddad",
    "Larsen",
    "Patel",
    "Kim",
    "Nguyen",
    "Brown",
    "Ivanova",
    "Lopez",
]
DOMAINS = ["example.com", "mail.org", "acme.io", "shop.net", "corp.dev"]
CITIES = [
    ("Berlin", "DE"),
    ("Paris", "FR"),
    ("Austin", "US"),
    ("Toronto", "CA"),
    ("Lisbon", "PT"),
    ("Osaka", "JP"),
    ("Leeds", "GB"),
    ("Madrid", "ES"),
    ("Denver", "US"),
    ("Milan", "IT"),
    ("Krakow", "PL"),
    ("Lyon", "FR"),
]
STREETS = ["Main St", "Oak Avenue", "Elm Road", "Market Street", "Station Road", "Hill Lane", "Park Way", "River Drive"]
PRODUCTS = [
    "Wireless Mouse",
    "USB-C Cable",
    "Desk Lamp",
    "Coffee Mug",
    "Running Shoes",
    "Backpack",
    "Notebook",
    "Water Bottle",
    "Headphones",
    "Keyboard",
    "Phone Case",
    "Sunglasses",
    "Yoga Mat",
    "Toaster",
]
TAGS = [
    "sale",
    "new",
    "popular",
    "eco",
    "gift",
    "limited",
    "tech",
    "home",
    "outdoor",
    "kids",
    "travel",
    "python",
    "design",
    "news",
    "tutorial",
]
WORDS = [
    "quick",
    "update",
    "report",
    "great",
    "simple",
    "weekly",
    "review",
    "fix",
    "guide",
    "notes",
    "launch",
    "plan",
    "idea",
    "summary",
    "release",
    "meeting",
    "budget",
    "draft",
    "final",
    "team",
]
PAGES = ["/home", "/cart", "/checkout", "/products", "/about", "/login", "/search", "/blog", "/account"]
SKILLS = ["python", "sql", "excel", "negotiation", "design", "go", "rust", "writing", "support", "accounting"]
COMMENTS = [
    "Works as expected.",
    "Great value for the price.",
    "Arrived late but fine.",
    "Would buy again.",
    "Not what I expected.",
    "Excellent quality!",
    "Battery could be better.",
    "Five stars.",
]

# Held-out vocabulary: never used by a training schema.
AIRPORTS = ["FRA", "JFK", "LHR", "NRT", "CDG", "SFO", "DXB", "SIN", "GRU", "SYD"]
AIRLINES = ["LH", "BA", "AF", "UA", "NH", "EK", "QF"]
DISHES = ["Risotto alla Milanese", "Chicken Tikka", "Miso Ramen", "Tacos al Pastor", "Ratatouille", "Pad Thai"]
INGREDIENTS = ["rice", "onion", "garlic", "butter", "tomato", "chicken", "tofu", "basil", "noodles", "cheese"]
HANDLES = ["octocat", "torvalds", "gvanrossum", "devnull", "kernelhacker", "rustacean", "pydev"]
COMMIT_VERBS = ["Fix", "Add", "Refactor", "Remove", "Bump", "Document", "Speed up"]
COMMIT_OBJECTS = ["parser edge case", "retry logic", "CI cache", "typo in README", "flaky test", "memory leak"]
STATIONS = ["Reykjavik-Harbor", "Zugspitze", "Mauna Loa", "Cape Town Airport", "Svalbard-North"]
ALERTS = ["storm warning", "heat advisory", "frost expected", "flood watch"]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _email(rng: random.Random) -> str:
    return f"{rng.choice(FIRST).lower()}.{rng.choice(LAST).lower()}@{rng.choice(DOMAINS)}"


def _sentence(rng: random.Random, lo: int = 2, hi: int = 5) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize()


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _upper(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(n))


def _timestamp(rng: random.Random) -> str:
    return (
        f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        f"T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
    )


STRING_GENERATORS: dict[str, StringGen] = {
    "name": _person,
    "email": _email,
    "phone": lambda r: f"+1-{_digits(r, 3)}-{_digits(r, 3)}-{_digits(r, 4)}",
    "street": lambda r: f"{r.randint(1, 999)} {r.choice(STREETS)}",
    "city": lambda r: r.choice(CITIES)[0],
    "country": lambda r: r.choice(CITIES)[1],
    "zip": lambda r: _digits(r, 5),
    "product.name": lambda r: r.choice(PRODUCTS),
    "tags": lambda r: r.choice(TAGS),
    "timestamp": _timestamp,
    "page": lambda r: r.choice(PAGES),
    "title": _sentence,
    "description": lambda r: r.choice(PRODUCTS),
    "invoice_id": lambda r: f"INV-2024-{_digits(r, 4)}",
    "comment": lambda r: r.choice(COMMENTS),
    "skills": lambda r: r.choice(SKILLS),
    "tracking_number": lambda r: f"1Z{_upper(r, 3)}{_digits(r, 9)}",
    "assignee": _person,
    # held-out
    "pnr": lambda r: _upper(r, 6),
    "given_names": lambda r: r.choice(FIRST),
    "surname": lambda r: r.choice(LAST),
    "flight_no": lambda r: f"{r.choice(AIRLINES)}{r.randint(1, 9999)}",
    "origin_iata": lambda r: r.choice(AIRPORTS),
    "dest_iata": lambda r: r.choice(AIRPORTS),
    "sensor_uuid": lambda r: f"{_hex(r, 8)}-{_hex(r, 4)}-{_hex(r, 4)}",
    "dish": lambda r: r.choice(DISHES),
    "ingredient": lambda r: r.choice(INGREDIENTS),
    "sha": lambda r: _hex(r, 12),
    "handle": lambda r: r.choice(HANDLES),
    "message": lambda r: f"{r.choice(COMMIT_VERBS)} {r.choice(COMMIT_OBJECTS)}",
    "station": lambda r: r.choice(STATIONS),
    "alert": lambda r: r.choice(ALERTS),
    "isbn13": lambda r: "978" + _digits(r, 10),
}


def string_generator(schema_name: str, prop: str) -> StringGen:
    gen = STRING_GENERATORS.get(f"{schema_name}.{prop}") or STRING_GENERATORS.get(prop)
    if gen is None:
        raise KeyError(f"no string generator for {schema_name}.{prop}")
    return gen
