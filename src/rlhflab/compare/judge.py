"""The same judge for every model of a comparison: test prompts, verifier, decoding, and KL to the starting model."""

from __future__ import annotations

from pathlib import Path

from rlhflab import models
from rlhflab.config import CompareConfig, EvalConfig, field_names
from rlhflab.eval import answer_and_check, eval_prompts, eval_verifier, kl_to_reference
from rlhflab.trainers.setup import resolve_device


class Judge:
    """The same judge for every model: the test prompts, verifier, decoding and the starting model (KL's
    reference), loaded once."""

    def __init__(self, cfg: CompareConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
        self.eval_cfg = EvalConfig(**{n: getattr(cfg, n) for n in field_names(EvalConfig) if hasattr(cfg, n)},
                                   split="test")
        self.rows = eval_prompts(self.eval_cfg, self.tokenizer)
        self.verifier = eval_verifier(self.eval_cfg, self.rows)
        self.reference = self.load(cfg.model)  # the starting model: evaluated once, and KL's reference

    def load(self, folder: str | Path):
        return models.load_causal_lm(str(folder), dtype=self.cfg.dtype, trust_remote_code=self.cfg.trust_remote_code,
                                     device=self.device).eval()

    def answers(self, model) -> list[dict]:
        """Checked answers to every test prompt, with the comparison's evaluation decoding and seed."""
        rows = answer_and_check(model, self.tokenizer, self.rows, self.verifier, self.cfg, progress=False)
        return [{"prompt_index": i, **row} for i, row in enumerate(rows)]

    def kl(self, model) -> float:
        return kl_to_reference(model, self.reference, self.tokenizer, [r.prompt for r in self.rows],
                               samples=self.cfg.kl_samples, response_length=self.cfg.response_length,
                               temperature=self.cfg.temperature, batch_size=self.cfg.eval_batch_size, seed=self.cfg.seed)
