"""Near-miss answers: the reference with one letter of a copied word changed.

A small policy copies unseen made-up words with slips ("fizu" -> "sizu", "lefe" ->
"leme"). Such an answer differs from the reference by one letter, so a reward model
that never saw one scores it like the correct answer; the suite's own `wrong_content`
answers (another item, a dropped last letter) do not teach it the difference. These
answers are extra rejected answers for reward-model training.
"""

from __future__ import annotations

import random
import re
import string

from rlhflab.tasks.base import TaskItem

VOWELS = "aeiou"
CONSONANTS = "".join(c for c in string.ascii_lowercase if c not in VOWELS)


def _copied_words(item: TaskItem) -> list[str]:
    """Content words that the reference spells out (in any letter case)."""
    words = [w for w in dict.fromkeys(item.content) if w.isalpha()]
    return [w for w in words if re.search(rf"(?<![A-Za-z]){w}(?![A-Za-z])", item.reference, re.IGNORECASE)]


def near_miss(item: TaskItem, rng: random.Random) -> str | None:
    """The reference with one letter of one copied word swapped for another of its kind
    (vowel for vowel, consonant for consonant, case kept), everywhere that word appears;
    None when the reference copies no word (numbers, yes/no)."""
    words = _copied_words(item)
    if not words:
        return None
    word = rng.choice(words)
    at = rng.randrange(len(word))
    pool = VOWELS if word[at].lower() in VOWELS else CONSONANTS
    letter = rng.choice([c for c in pool if c != word[at].lower()])

    def swap(match: re.Match) -> str:
        found = match.group(0)
        return found[:at] + (letter.upper() if found[at].isupper() else letter) + found[at + 1 :]

    return re.sub(rf"(?<![A-Za-z]){word}(?![A-Za-z])", swap, item.reference, flags=re.IGNORECASE)


def near_misses(item: TaskItem, count: int, rng: random.Random) -> list[str]:
    """Up to `count` distinct near misses of one item (fewer when the word is short)."""
    out: list[str] = []
    for _ in range(4 * count):
        if len(out) == count:
            break
        answer = near_miss(item, rng)
        if answer is None:
            break
        if answer not in out:
            out.append(answer)
    return out
