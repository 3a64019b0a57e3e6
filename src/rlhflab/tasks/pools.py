"""Content pools and their disjoint train / validation / test partition.

Held-out evaluation only means something if test prompts use words and numbers
the model never saw in training, so the pools are split first and every item is
drawn from one split's pool. Structural values (repeat counts, list lengths,
JSON keys) are not content and are shared by all splits.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

# Simple lowercase 3-6 letter words: no plurals, no words the templates use
# ("word", "item", "key", "name", "yes", "no"), so content never collides with a frame.
REAL_WORDS: tuple[str, ...] = (
    # animals
    "cat", "dog", "fox", "owl", "bee", "ant", "cow", "pig", "hen", "elk", "yak", "bat",
    "eel", "ram", "tiger", "lion", "bear", "wolf", "deer", "frog", "duck", "goat", "crab",
    "seal", "mole", "swan", "hawk", "lamb", "moth", "toad", "mouse", "horse", "sheep",
    "zebra", "camel", "otter", "panda", "koala", "snake", "whale", "shark", "eagle",
    "goose", "llama", "rabbit", "turtle", "donkey", "monkey", "parrot", "spider",
    # colours
    "red", "blue", "green", "pink", "gold", "gray", "black", "white", "brown", "amber",
    "coral", "ivory", "cyan",
    # food
    "egg", "jam", "pie", "tea", "rice", "corn", "milk", "soup", "cake", "bread", "apple",
    "lemon", "grape", "melon", "mango", "peach", "pear", "plum", "bean", "honey", "salt",
    "sugar", "candy", "pasta", "onion",
    # objects
    "cup", "box", "hat", "pen", "bag", "map", "bed", "car", "bus", "van", "cap", "mug",
    "jar", "pot", "lamp", "desk", "door", "ring", "bell", "coin", "book", "boat", "drum",
    "kite", "rope", "sock", "shoe", "fork", "bowl", "sofa", "chair", "table", "clock",
    "brush", "spoon", "glass", "piano", "radio", "wagon", "tent", "flag", "vase", "comb",
    "nail", "broom", "candle", "basket", "pillow", "mirror", "bottle", "button", "hammer",
    "ladder",
    # nature
    "sun", "sky", "sea", "ice", "oak", "fog", "hill", "lake", "rock", "sand", "leaf",
    "rain", "snow", "star", "moon", "wind", "tree", "cloud", "river", "stone", "grass",
    "beach", "storm", "field", "flower", "forest", "island", "garden",
)  # fmt: skip

# Pronounceable made-up words (consonant-vowel syllables). A few hundred real words
# are few enough for a tiny model to memorise whole; thousands of made-up ones make
# it learn to copy and transform letters, which is what transfers to unseen test
# words (FACTS.md: the tokenizer and the data must not invite memorisation).
_FRAME_WORDS = frozenset({"bare", "line", "per", "set", "sum"})  # template words (a test checks)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)
PSEUDO_WORDS: tuple[str, ...] = tuple(
    word
    for word in sorted({a + b for a in _SYLLABLES for b in _SYLLABLES} | {a + c for a in _SYLLABLES for c in "klmnrst"})
    if word not in REAL_WORDS and word not in _FRAME_WORDS
)
WORDS: tuple[str, ...] = REAL_WORDS + PSEUDO_WORDS

NUMBERS: tuple[int, ...] = tuple(range(1, 1000))  # ~600 train numbers: too many to memorise one by one

SPLITS: tuple[str, ...] = ("train", "validation", "test")
SHARES: tuple[float, ...] = (0.6, 0.2, 0.2)


@dataclass(frozen=True)
class ContentPool:
    """The words and numbers one split may show in its prompts."""

    words: tuple[str, ...]
    numbers: tuple[int, ...]


def small_digits(n: int) -> bool:
    """Every digit <= 4: any two such numbers add without a carry."""
    return all(int(d) <= 4 for d in str(n))


def carry_free(a: int, b: int) -> bool:
    """Digit-wise sums all below 10: the tiny model cannot learn carries."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return False
        a, b = a // 10, b // 10
    return True


def _cut(values: list, rng: random.Random) -> list[list]:
    """Shuffle and cut into SPLITS-sized parts by SHARES."""
    values = list(values)
    rng.shuffle(values)
    n_train = round(len(values) * SHARES[0])
    n_val = round(len(values) * SHARES[1])
    return [values[:n_train], values[n_train : n_train + n_val], values[n_train + n_val :]]


def partition_pools(seed: int = 0) -> dict[str, ContentPool]:
    """Split WORDS and NUMBERS into disjoint pools, one per split, by a seeded shuffle.

    Numbers are cut in four strata (two-digit or not, all digits <= 4 or not), so every
    split is guaranteed numbers that add without a carry, whatever the seed, and its
    share of the two-digit numbers sum_result draws from: 4 two-digit numbers with
    digits <= 4 give each held-out split at least 12 carry-free pairs (36 prompts). Cut
    in two strata only, some seeds left a split 2 such pairs (seed 38's test split) or
    none, too few for ~27 distinct sum_result prompts in 300.
    """
    rng = random.Random(f"rlhflab.tasks.pools:{seed}")
    word_parts = _cut(sorted(WORDS), rng)
    strata = [(True, True), (True, False), (False, True), (False, False)]  # (two-digit, digits <= 4)
    cuts = [_cut([n for n in NUMBERS if ((10 <= n <= 99), small_digits(n)) == key], rng) for key in strata]
    return {
        split: ContentPool(tuple(word_parts[i]), tuple(n for cut in cuts for n in cut[i]))
        for i, split in enumerate(SPLITS)
    }


@functools.lru_cache(maxsize=64)
def carry_free_pairs(numbers: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Ordered pairs of distinct pool numbers whose sum needs no carry (cached per pool)."""
    return tuple((a, b) for a in numbers for b in numbers if a != b and carry_free(a, b))
