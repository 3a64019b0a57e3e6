"""Batched generation with a KV cache, left padding and early stop at EOS.

Prompts are left-padded and given explicit position ids, so a sequence's
tokens and log-probs do not depend on how much padding its batch needed
(DESIGN.md, correctness rules). The loop ends as soon as every sequence has
produced EOS instead of always running to the length cap (TRL issue #2387).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.data import left_pad, position_ids_from_mask
from rlhflab.models.lean import plan_lean_decode
from rlhflab.models.lean_decoder import LeanDecoder
from rlhflab.models.shared_prompt import distinct_prompts


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 32
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class BatchPlace:
    """Where one process's rows sit in a global batch that several processes decode (docs/scaling-out.md
    "Several processes"): rows `first` .. `first + B - 1` of `total`, prompts left-padded to `prompt_width` (the global
    batch's longest). Every decoding step draws the sampling noise of all `total` rows and keeps its own, so
    a row's tokens depend on its place in the global batch and the generator, not on the process decoding it."""

    first: int
    total: int
    prompt_width: int = 0


@dataclass(frozen=True)
class Generated:
    query_ids: Tensor  # (B, P) left-padded prompt tokens
    query_mask: Tensor  # (B, P) bool, True on real prompt tokens
    response_ids: Tensor  # (B, T) response tokens; pad_id after the first EOS
    response_mask: Tensor  # (B, T) bool, True up to and including the first EOS
    ended_with_eos: Tensor  # (B,) bool, False when the response hit the length cap
    # (B, T) float32: the sampler's own log-probability of each response token, under the distribution it drew
    # from (temperature, top-k / top-p applied); 0 where masked; None where the sampler does not report it
    sampler_logprobs: Tensor | None = None

    def apply(self, change) -> Generated:
        """A copy with `change(tensor)` applied to each tensor field (None stays None)."""
        return Generated(*(None if t is None else change(t) for t in (
            self.query_ids, self.query_mask, self.response_ids, self.response_mask, self.ended_with_eos,
            self.sampler_logprobs)))

    def rows(self, first: int, count: int) -> Generated:
        """Rows first .. first + count - 1 (one rank's share of a global batch), at the batch's widths."""
        return self.apply(lambda t: t[first : first + count])


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. (B, V) -> (B, V)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: Tensor, settings: GenerationSettings, generator: torch.Generator | None,
                rows: Tensor | None = None, batch: int = 0) -> Tensor:
    """Pick one token per row from last-position logits (B, V) -> (B,).

    `rows`: which rows of a `batch`-row decoding the logits belong to (finished rows were dropped, or the
    decoding is one process's part of a global batch): the sampling noise is still drawn for all `batch`
    rows, so a row's tokens do not depend on which others run."""
    return sample_tokens(logits, settings, generator, rows, batch)[0]


def sample_tokens(logits: Tensor, settings: GenerationSettings, generator: torch.Generator | None,
                  rows: Tensor | None = None, batch: int = 0) -> tuple[Tensor, Tensor]:
    """`next_tokens`, and each picked token's log-probability under the distribution it was drawn from
    (B,) float32 (temperature and top-k / top-p applied; greedy decoding: 0, the one token it can pick)."""
    if not settings.do_sample:
        token = logits.argmax(dim=-1)
        return token, torch.zeros(token.shape, dtype=torch.float32, device=token.device)
    logits = logits.float() if settings.temperature == 1.0 else logits.float() / settings.temperature
    logits = filter_logits(logits, settings.top_k, settings.top_p)
    probs = torch.softmax(logits, dim=-1)
    token = draw(probs, generator, rows, batch)
    return token, probs.gather(1, token.unsqueeze(1)).squeeze(1).log()


def draw(probs: Tensor, generator: torch.Generator | None, rows: Tensor | None, batch: int) -> Tensor:
    """One token per row of (B, V) probabilities (`next_tokens` says what `rows` and `batch` are)."""
    if generator is not None and generator.device.type != probs.device.type:
        # a CPU generator with a GPU model: sample on the CPU (slower, but reproducible)
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    # torch.multinomial(probs, 1)'s exponential race, argmax(probs / E) with E ~ Exp(1), without its input
    # checks (a max, a min and a sync per step), and E drawn as -log U: a uniform draw and a log cost a third
    # of exponential_ on the CPU (~15 vs 51 ns an element), which pays for drawing a whole global batch's
    # noise on every process (BatchPlace). U == 0 gives E = inf: that token loses the race, never a NaN.
    uniform = torch.empty_like(probs) if rows is None else probs.new_empty((batch, probs.shape[1]))
    uniform.uniform_(generator=generator)
    race = (uniform if rows is None else uniform.index_select(0, rows)).log_().neg_()
    return torch.div(probs, race, out=race).argmax(dim=-1)


def cache_argument(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: `cache` (transformers >= 5.2x) or `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps forward(**kwargs)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    pad_id: int,
    eos_id: int,
    settings: GenerationSettings,
    generator: torch.Generator | None = None,
    lean: bool = True,
    place: BatchPlace | None = None,
) -> Generated:
    """Sample (or greedily decode) a response for every prompt, with a KV cache.

    `lean`: run Llama-layout models through `models.lean.LeanDecoder` (same weights and math,
    less per-step overhead); other models always use their own forward.
    `place`: these prompts are part of a larger global batch (see BatchPlace); None = they are the batch.
    """
    device = next(model.parameters()).device
    query_ids, query_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    batch = query_ids.shape[0]
    if place is not None and place.prompt_width > query_ids.shape[1]:  # the global batch's padding, to the column
        extra = place.prompt_width - query_ids.shape[1]
        query_ids = torch.cat([query_ids.new_full((batch, extra), pad_id), query_ids], dim=1)
        query_mask = torch.cat([query_mask.new_zeros((batch, extra)), query_mask], dim=1)
    noise_first, noise_rows = (place.first, place.total) if place is not None else (0, batch)
    attention = query_mask.long()
    positions = position_ids_from_mask(attention)
    logits, step, select_rows = prefill(model, query_ids, query_mask, positions, settings.max_new_tokens, lean)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    live = torch.arange(batch, device=device)  # the rows `logits` and `step` still decode
    tokens: list[Tensor] = []
    sampled: list[Tensor] = []  # each step's log-probabilities of its tokens, under the sampler's distribution
    for _ in range(settings.max_new_tokens):
        rows = live + noise_first if noise_first else live
        token, logprob = sample_tokens(logits, settings, generator, rows, noise_rows)
        token = token.masked_fill(finished[live], pad_id)
        tokens.append(torch.full((batch,), pad_id, dtype=token.dtype, device=device).index_copy_(0, live, token))
        sampled.append(torch.zeros(batch, dtype=logprob.dtype, device=device).index_copy_(0, live, logprob))
        finished[live] |= token == eos_id
        if bool(finished.all()):
            break
        going = ~finished[live]
        if select_rows is not None and int(going.sum()) <= 0.75 * len(live):
            # drop finished rows from the decoder: a step's cost follows the rows it runs (4.3 ms at 32 rows,
            # 2.2 at 8 on the benchmark model), and short answers finish long before the longest
            kept = going.nonzero().squeeze(1)
            select_rows(kept)
            live, token = live[kept], token[kept]
        logits = step(token)
    response_ids = torch.stack(tokens, dim=1)  # (B, T)
    response_mask = response_mask_after_eos(response_ids, eos_id)
    response_ids = response_ids.masked_fill(~response_mask, pad_id)
    sampler_logprobs = torch.stack(sampled, dim=1).masked_fill(~response_mask, 0.0)
    return Generated(query_ids, query_mask.bool(), response_ids, response_mask, finished, sampler_logprobs)


def prefill(model, query_ids: Tensor, query_mask: Tensor, positions: Tensor, max_new_tokens: int, lean: bool):
    """Run the prompts: (B, V) logits for the first new token, a function (B,) token -> next (B, V) logits,
    and one that keeps only some rows in the decoding from then on (None: the model's own cache cannot)."""
    plan = plan_lean_decode(model) if lean else None
    if plan is not None:
        groups = distinct_prompts(query_ids, query_mask)  # k answers per prompt: prefill each prompt once
        if groups is None:
            decoder = LeanDecoder(plan, query_ids, query_mask, positions, max_new_tokens)
        else:
            first, rows = groups
            decoder = LeanDecoder(plan, query_ids[first], query_mask[first], positions[first], max_new_tokens)
            decoder.select_rows(rows)
        return decoder.logits, decoder.step, decoder.select_rows
    attention = query_mask.long()
    out = model(input_ids=query_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache_kw = cache_argument(model)
    state = {"cache": returned_cache(out), "attention": attention, "position": positions[:, -1:]}

    def hf_step(token: Tensor) -> Tensor:
        state["attention"] = torch.cat([state["attention"], torch.ones_like(state["attention"][:, :1])], dim=1)
        state["position"] = state["position"] + 1
        out = model(input_ids=token.unsqueeze(1), attention_mask=state["attention"], position_ids=state["position"],
                    use_cache=True, **{cache_kw: state["cache"]})
        state["cache"] = returned_cache(out)
        return out.logits[:, -1, :]

    return out.logits[:, -1, :], hf_step, None


def response_mask_after_eos(response_ids: Tensor, eos_id: int) -> Tensor:
    """(B, T) True up to and including the first EOS of each row, False after it."""
    is_eos = (response_ids == eos_id).long()
    eos_seen_before = is_eos.cumsum(dim=1) - is_eos
    return eos_seen_before == 0
