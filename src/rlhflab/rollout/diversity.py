"""How varied a rollout's responses are: capped share, distinct bigrams, duplicates.

These feed the mode-collapse and length alarms (`rlhflab.eval.alarms`). They are
computed on token ids, not text: two responses with the same ids (up to and
including EOS) decode to the same text, and ids need no tokenizer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

from torch import Tensor


def response_tokens(response_ids: Tensor, response_mask: Tensor) -> list[tuple[int, ...]]:
    """(B, T) ids and mask -> each response's real tokens (EOS included) as a tuple."""
    return [tuple(t for t, real in zip(ids, mask) if real)
            for ids, mask in zip(response_ids.tolist(), response_mask.tolist())]


def capped_share(ended_with_eos: Tensor) -> float:
    """Share of (B,) responses that ran to the length cap without producing EOS."""
    n = ended_with_eos.numel()
    return float((~ended_with_eos.bool()).sum().item()) / n if n else 0.0


def distinct_n(responses: Sequence[tuple[int, ...]], n: int = 2) -> float:
    """Distinct n-grams / total n-grams over all responses (n-grams never span two responses).

    1.0 = no n-gram repeats anywhere in the batch; it falls as responses repeat
    themselves or each other. 0.0 when no response has n tokens.
    """
    grams = [r[i : i + n] for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def duplicate_share(responses: Sequence[tuple[int, ...]], groups: Sequence[Hashable] | None = None) -> float | None:
    """Share of responses identical to another response of the same group.

    groups=None: the whole batch is one group (identical answers to *different*
    prompts count; short, templated correct answers such as "yes" do too).
    With groups (e.g. prompt ids): only responses whose group has >= 2 members
    are counted, and None is returned when no group repeats.
    """
    keys = list(groups) if groups is not None else [0] * len(responses)
    members: dict[Hashable, list[tuple[int, ...]]] = defaultdict(list)
    for key, response in zip(keys, responses):
        members[key].append(response)
    counted = duplicated = 0
    for rows in members.values():
        if len(rows) < 2:
            continue
        counted += len(rows)
        seen: dict[tuple[int, ...], int] = defaultdict(int)
        for r in rows:
            seen[r] += 1
        duplicated += sum(c for c in seen.values() if c > 1)
    if counted == 0:
        return None if groups is not None else 0.0
    return duplicated / counted


def diversity_metrics(response_ids: Tensor, response_mask: Tensor, ended_with_eos: Tensor,
                      prompt_keys: Sequence[Hashable], group_size: int = 1) -> dict[str, float]:
    """The `response/*` diversity metrics of one rollout (docs/reading-a-run.md "Metrics").

    `prompt_keys[b]` identifies row b's prompt; `response/duplicate_share` (same
    prompt) is left out when no prompt occurs twice in the batch.
    With `group_size` k > 1 (GRPO, RLOO ...: k samples of each prompt, contiguous) the batch share
    reads the first sample of each prompt, so it means what it means for PPO, and the share of a
    prompt's samples that repeat each other is `response/duplicate_share_group`: on a task with one
    right answer a confident policy drives it to 1, which is success there, so no alarm reads it.
    """
    responses = response_tokens(response_ids, response_mask)
    firsts = responses[::group_size]
    metrics = {
        "response/capped_share": capped_share(ended_with_eos),
        "response/distinct_2": distinct_n(responses, 2),
        "response/duplicate_share_batch": duplicate_share(firsts),
    }
    same_prompt = duplicate_share(responses if group_size == 1 else firsts, list(prompt_keys)[::group_size])
    if same_prompt is not None:
        metrics["response/duplicate_share"] = same_prompt
    if group_size > 1:
        metrics["response/duplicate_share_group"] = duplicate_share(responses, [b // group_size for b in
                                                                                range(len(responses))])
    return metrics
