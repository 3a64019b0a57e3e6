"""The headroom probe: before RL starts, is there anything in each family for an on-policy reward to reinforce?

On-policy RL (PPO, GRPO, RLOO, REINFORCE) can only make more likely the answers the policy
already samples. A family in which no sampled answer passes gives every reward the same
failing answers to compare: nothing to reinforce, whatever the algorithm. So per family the
probe measures, on held-out prompts (validation: the test split is read once, for reported
numbers):

- greedy pass@1: the share of prompts whose greedy answer passes (what evaluation reports);
- sampled pass@1: the mean over prompts of c / n, n answers sampled at the rollout temperature
  from the full softmax (rollouts use no top-k / top-p) of which c pass;
- pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1), 1 - C(n - c, k) / C(n, k), averaged over prompts. Here k = n,
  so it is the share of prompts with at least one passing sample.

A family has no headroom when its pass@k is below MIN_PASS_AT_K or fewer than
MIN_PROMPTS_WITH_PASS of its prompts (all of them, when fewer were probed) have any passing
sample (one lucky prompt is not a signal a reward can spread); the probe says so in words.

It lives with the trainers (not in eval/) because the online loop records it for its starting
policy (`record_start_headroom`); `rlhflab eval --samples_per_prompt k` and the demo call it too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.intervals import BETTER, WORSE, difference_from_dict, points, verdict
from rlhflab.rewards import Verifier
from rlhflab.rollout import GenerationSettings, generate_answers
from rlhflab.tracking import RunDir
from rlhflab.trainers.validation import verify_rows

log = logging.getLogger("rlhflab")

MIN_PASS_AT_K = 0.02  # below this pass@k a family has no headroom ("~0")
MIN_PROMPTS_WITH_PASS = 2  # ... nor with fewer prompts than this having any passing sample
CEILING = 0.9  # greedy pass@1 at or above this: the family already passes, little left to gain
FILE = "headroom.json"  # where a run folder keeps the probe of its starting model (report/headroom.py reads it)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass (Chen et al. 2021, eq. 1): 1 - C(n-c, k) / C(n, k).

    The chance that k of the n samples, drawn without replacement, include a passing one.
    With k = n it is 1 when any sample passes, else 0."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k samples holds a passing one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class FamilyHeadroom:
    family: str
    prompts: int  # prompts probed
    samples_per_prompt: int  # n = k answers sampled per prompt
    greedy_pass_at_1: float  # share of prompts whose greedy answer passes
    sampled_pass_at_1: float  # mean over prompts of c / n
    pass_at_k: float  # mean over prompts of pass_at_k(n, c, k=n)
    prompts_with_pass: int  # prompts with at least one passing sample
    passing_samples: int  # c summed over the prompts

    @property
    def no_headroom(self) -> bool:
        # a family probed on a single prompt cannot have two: then that one must pass
        return self.pass_at_k < MIN_PASS_AT_K or self.prompts_with_pass < min(MIN_PROMPTS_WITH_PASS, self.prompts)

    @property
    def status(self) -> str:
        """"none": nothing to reinforce; "ceiling": greedy answers already pass; "room": RL can help."""
        if self.no_headroom:
            return "none"
        return "ceiling" if self.greedy_pass_at_1 >= CEILING else "room"


def family_headroom(family: str, greedy: Sequence[bool], sampled: Sequence[Sequence[bool]]) -> FamilyHeadroom:
    """One family's rates from `greedy[i]` (prompt i's greedy answer passed) and `sampled[i]` (its n samples)."""
    if not greedy or len(greedy) != len(sampled):
        raise ValueError(f"{family}: {len(greedy)} greedy verdicts for {len(sampled)} prompts of samples")
    n = len(sampled[0])
    counts = [sum(map(bool, s)) for s in sampled]
    return FamilyHeadroom(
        family=family, prompts=len(greedy), samples_per_prompt=n,
        greedy_pass_at_1=sum(map(bool, greedy)) / len(greedy),
        sampled_pass_at_1=sum(pass_at_k(n, c, 1) for c in counts) / len(counts),
        pass_at_k=sum(pass_at_k(n, c, n) for c in counts) / len(counts),
        prompts_with_pass=sum(c > 0 for c in counts), passing_samples=sum(counts),
    )


def headroom_words(h: FamilyHeadroom) -> str:
    """What the family's numbers mean for RL, in one sentence."""
    k = h.samples_per_prompt
    if h.no_headroom and h.prompts_with_pass == 0:
        return (f"{h.family}: 0 of {k} samples pass on any of its {_prompts(h.prompts)} — RL from this model cannot "
                "be expected to help here; improve SFT or the data")
    if h.no_headroom:
        return (f"{h.family}: only {h.prompts_with_pass} of {_prompts(h.prompts)} had a passing sample among {k} "
                f"(pass@{k} {h.pass_at_k:.0%}) — RL from this model cannot be expected to help here; improve SFT "
                "or the data")
    if h.status == "ceiling":
        return f"{h.family}: greedy answers already pass {h.greedy_pass_at_1:.0%} — little left for RL to gain"
    return (f"{h.family}: pass@{k} {h.pass_at_k:.0%} against greedy {h.greedy_pass_at_1:.0%} — sampled answers pass "
            "where greedy ones fail: headroom for RL")


def _prompts(n: int) -> str:
    return f"{n} prompt" if n == 1 else f"{n} prompts"


def probe_from_verdicts(rows: Sequence[PromptRow], greedy: Sequence[bool], sampled: Sequence[Sequence[bool]]) -> dict:
    """Per-family and overall rates, their status and words, as JSON (what headroom.json holds)."""
    families: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        families.setdefault(row.family, []).append(i)
    per_family = {}
    for family, idx in sorted(families.items()):
        h = family_headroom(family, [greedy[i] for i in idx], [sampled[i] for i in idx])
        per_family[family] = {**asdict(h), "status": h.status, "words": headroom_words(h)}
    overall = family_headroom("overall", greedy, sampled)
    return {"per_family": per_family, "overall": asdict(overall),
            "no_headroom": [f for f, h in per_family.items() if h["status"] == "none"]}


def sample_verdicts(model, tokenizer, rows: Sequence[PromptRow], verifier: Verifier, settings: GenerationSettings,
                    repeats: int, batch_size: int, seed: int) -> list[list[bool]]:
    """`repeats` answers per row under `settings`, verified: [[passed] * repeats] per row."""
    asked = [row for row in rows for _ in range(repeats)]  # each prompt's answers contiguous
    generator = torch.Generator().manual_seed(seed)  # its own stream: the caller's RNG is untouched
    answers = generate_answers(model, tokenizer, [r.prompt for r in asked], settings, batch_size=batch_size,
                               generator=generator)
    answered = [{"prompt": r.prompt, "answer": a.text, "ended_with_eos": a.ended_with_eos}
                for r, a in zip(asked, answers)]
    passed = [v["passed"] for v in verify_rows(answered, asked, verifier)]
    return [passed[i : i + repeats] for i in range(0, len(passed), repeats)]


def probe_headroom(model, tokenizer, rows: Sequence[PromptRow], verifier: Verifier, *, samples_per_prompt: int,
                   temperature: float, max_new_tokens: int, batch_size: int = 100, seed: int = 0,
                   split: str = "validation") -> dict:
    """The probe on `rows`: greedy answers and `samples_per_prompt` sampled ones per prompt, verified.

    Sampling uses the full softmax at `temperature` (as rollouts do); `max_new_tokens` should be
    the rollouts' cap: an answer that only passes when longer cannot be reinforced."""
    if samples_per_prompt < 1 or not rows:
        raise ValueError(f"the headroom probe needs >= 1 sample and >= 1 prompt, got {samples_per_prompt}, {len(rows)}")
    started = time.time()
    greedy = sample_verdicts(model, tokenizer, rows, verifier, GenerationSettings(max_new_tokens, False),
                             1, batch_size, seed)
    sampling = GenerationSettings(max_new_tokens, True, temperature, top_k=0, top_p=1.0)
    sampled = sample_verdicts(model, tokenizer, rows, verifier, sampling, samples_per_prompt, batch_size, seed)
    probe = probe_from_verdicts(rows, [g[0] for g in greedy], sampled)
    return {"split": split, "prompts": len(rows), "samples_per_prompt": samples_per_prompt,
            "temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed,
            "thresholds": {"min_pass_at_k": MIN_PASS_AT_K, "min_prompts_with_pass": MIN_PROMPTS_WITH_PASS,
                           "ceiling": CEILING},
            **probe, "seconds": round(time.time() - started, 2)}


def format_headroom(probe: dict) -> str:
    """Console table: one row per family, then the words for every family without headroom."""
    k = probe["samples_per_prompt"]
    families = probe["per_family"]
    width = max([len(f) for f in families] + [len("overall"), 8])
    head = f"{'headroom':<{width}}  {'greedy':>7}  {'sampled':>7}  {f'pass@{k}':>7}"
    lines = [f"headroom probe: {probe['prompts']} {probe['split']} prompts, {k} samples each at temperature "
             f"{probe['temperature']:g} ({probe['seconds']:.1f} s)", head, "-" * len(head)]
    for name, h in [*families.items(), ("overall", probe["overall"])]:
        if name == "overall":
            lines.append("-" * len(head))
        flag = "   no headroom" if h.get("status") == "none" else ""
        lines.append(f"{name:<{width}}  {h['greedy_pass_at_1']:>7.0%}  {h['sampled_pass_at_1']:>7.0%}  "
                     f"{h['pass_at_k']:>7.0%}   (n={h['prompts']}){flag}")
    lines += [families[f]["words"] for f in probe["no_headroom"]]
    return "\n".join(lines)


def headroom_verdict(probe: dict, changes: dict[str, dict], stage: str) -> list[str]:
    """Each family's change (e.g. SFT -> a PPO stage on the test prompts) read against its headroom.

    `changes[family]`: `before` / `after` pass rates and the paired interval of the difference
    (`rlhflab.intervals.paired_counts`: difference, low, high). A family "moved" only when that interval
    lies above 0 — the one rule every comparison uses — and got worse only when it lies below 0, whatever its
    headroom: a loss RL should not have caused, said first. A family with nothing to reinforce is expected
    not to move; one with headroom whose change is within noise points at the reward (or at too few
    prompts). The surprises come first, one line each; the expected cases one line per kind."""
    worse: list[str] = []
    surprises: list[str] = []
    grouped: dict[str, list[str]] = {"moved": [], "none": [], "ceiling": []}
    for family, h in probe["per_family"].items():
        found = changes.get(family)
        diff = difference_from_dict(found)
        if diff is None:
            continue
        k, moved = h["samples_per_prompt"], verdict(diff) == BETTER
        change = f"{family} {found['before']:.0%} → {found['after']:.0%} ({points(diff)})"
        if verdict(diff) == WORSE:
            worse.append(f"{stage}: {change} — worse beyond noise: the reward pays for answers of this family "
                             "that the checker fails (read its samples against their rewards), or the KL leash is "
                             "too loose")
        elif h["status"] == "none" and moved:
            surprises.append(f"{stage}: {change} although its pass@{k} was {h['pass_at_k']:.0%} — passes the probe "
                             "did not see (probe more prompts or samples)")
        elif h["status"] == "room" and not moved:
            surprises.append(f"{stage}: {family} had headroom (pass@{k} {h['pass_at_k']:.0%}, greedy "
                             f"{h['greedy_pass_at_1']:.0%}) but did not move beyond noise: {change} — look at the "
                             "reward, or evaluate on more prompts")
        elif moved:
            grouped["moved"].append(f"{change}, pass@{k} {h['pass_at_k']:.0%}")
        elif h["status"] == "none":
            grouped["none"].append(f"{change}, pass@{k} {h['pass_at_k']:.0%}")
        else:
            grouped["ceiling"].append(f"{change}, greedy {h['greedy_pass_at_1']:.0%}")
    heads = {"moved": "moved beyond noise where there was headroom",
             "none": "did not move, as expected: nothing to reinforce",
             "ceiling": "did not move, already passing: little left to gain"}
    return worse + surprises + [f"{stage}: {heads[kind]}: {'; '.join(parts)}" for kind, parts in grouped.items() if parts]


def check_probe_fields(cfg) -> None:
    """The online configs' probe fields, refused before anything loads (a negative count would slice from the end)."""
    for name in ("headroom_samples", "headroom_prompts"):
        if getattr(cfg, name) < 0:
            raise UserInputError(f"{name} must be >= 0, got {getattr(cfg, name)}", f"--{name}",
                                 "headroom_samples 0 turns the probe off; headroom_prompts 0 probes the eval_prompts ones")


def record_start_headroom(policy, tokenizer, validation: Sequence[PromptRow], verifier: Verifier | None, cfg,
                          run: RunDir) -> dict | None:
    """The online loop's probe of its starting policy: the first `cfg.headroom_prompts` validation prompts
    (0: the `eval_prompts` ones), `cfg.headroom_samples` answers each at the rollout temperature and length;
    written to RUN/headroom.json and logged. None when off or without a verifier."""
    if cfg.headroom_samples <= 0 or not validation:
        return None
    if verifier is None:
        log.info("headroom probe skipped: no verifier says which answers pass (pass --verifier)")
        return None
    count = cfg.headroom_prompts or cfg.eval_prompts
    if count <= 0:
        log.info("headroom probe skipped: no validation prompts (eval_prompts 0; set --headroom_prompts N to probe)")
        return None
    rows = validation[:count]
    probe = probe_headroom(policy, tokenizer, rows, verifier, samples_per_prompt=cfg.headroom_samples,
                           temperature=cfg.temperature, max_new_tokens=cfg.response_length,
                           batch_size=cfg.eval_batch_size, seed=cfg.seed)
    run.write_json(FILE, probe)
    log.info("%s", format_headroom(probe))
    return probe
