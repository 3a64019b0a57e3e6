"""--filter_prompts pass_rate: train prompts the starting policy always or never solves (probed with
filter_samples answers each) are left out before RL; which ones, per family, is in summary.json and the report;
a resumed run keeps the same prompts without probing again."""

import json
from types import SimpleNamespace

import pytest
from tinyhf import save_suite_model

from rlhflab.config import GRPOConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import grpo
from rlhflab.trainers.online.prompt_filter import filter_record, prompts_to_keep

# the verdict depends on the prompt's family only for two families (always / never solved), on the answer for
# the others (about half of random answers start with an even character)
VERIFIER = """def by_family(prompts, completions, family, **columns):
    return [f == "sum_result" or (f != "yes_no" and len(c) > 0 and ord(c[0]) % 2 == 0)
            for f, c in zip(family, completions)]
"""


def test_the_prompts_kept_are_exactly_those_strictly_between_the_thresholds():
    rates = [0.0, 0.125, 1.0, 0.5, 0.875, 0.0, 1.0]
    assert prompts_to_keep(rates, 0.0, 1.0) == [1, 3, 4]
    assert prompts_to_keep(rates, 0.2, 0.9) == [3, 4]
    rows = [SimpleNamespace(family=f) for f in ("a", "a", "b", "b", "b", "c", "c")]
    cfg = SimpleNamespace(filter_prompts="pass_rate", filter_samples=8, filter_low=0.0, filter_high=1.0,
                          temperature=1.0)
    record = filter_record(rows, rates, cfg, 1.5)
    assert record["per_family"] == {"a": {"prompts": 2, "kept": 1, "always_solved": 0, "never_solved": 1},
                                    "b": {"prompts": 3, "kept": 2, "always_solved": 1, "never_solved": 0},
                                    "c": {"prompts": 2, "kept": 0, "always_solved": 1, "never_solved": 1}}
    assert record["kept_indices"] == [1, 3, 4] and record["kept"] == 3 and record["generated"] == 56


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def test_a_grpo_run_trains_only_on_the_prompts_the_filter_kept_and_a_resume_keeps_them(policy_dir, tmp_path,
                                                                                         monkeypatch):
    (tmp_path / "verify.py").write_text(VERIFIER)
    seen = []

    def remember(prompts, responses, rows):
        seen.extend(r.family for r in rows)
        return [float(len(r)) for r in responses]

    settings = dict(model=policy_dir, num_generations=4, batch_size=16, total_episodes=64, response_length=6,
                    eval_every=0, eval_prompts=4, progress=False, write_report=False, threads=1, save_every=2,
                    headroom_samples=0, filter_prompts="pass_rate", filter_samples=4,
                    verifier=f"{tmp_path / 'verify.py'}:by_family", num_train_prompts=44)
    result = grpo.train(GRPOConfig(output_dir=str(tmp_path / "run"), **settings), reward_fn=remember)
    record = result.summary["prompt_filter"]
    families = record["per_family"]
    assert families["sum_result"]["always_solved"] == families["sum_result"]["prompts"] > 0
    assert families["yes_no"]["never_solved"] == families["yes_no"]["prompts"] > 0
    assert families["sum_result"]["kept"] == families["yes_no"]["kept"] == 0
    assert record["generated"] == 44 * 4 and 0 < record["kept"] < 44
    assert seen and not {"sum_result", "yes_no"} & set(seen)  # only kept prompts were trained on
    on_disk = json.loads((result.run_dir / "prompt_filter.json").read_text())
    assert on_disk["kept"] == record["kept"] and len(on_disk["kept_indices"]) == record["kept"]

    seen.clear()
    monkeypatch.setattr("rlhflab.trainers.online.loop.probe_train_prompts",
                        lambda *a: pytest.fail("a resumed run probes again"))
    resumed = grpo.train(GRPOConfig(output_dir=str(tmp_path / "run"), resume=str(result.run_dir / "checkpoints" /
                                                                                  "step-2"), **settings),
                         reward_fn=remember)
    assert resumed.summary["prompt_filter"] == record  # read back, not probed again
    assert seen and not {"sum_result", "yes_no"} & set(seen)


def test_filter_prompts_needs_a_verifier_and_sane_thresholds(policy_dir, tmp_path):
    base = dict(model=policy_dir, output_dir=str(tmp_path / "run"), filter_prompts="pass_rate")
    with pytest.raises(UserInputError, match="filter_low < filter_high"):
        grpo.train(GRPOConfig(**base, filter_low=0.5, filter_high=0.5))
    with pytest.raises(UserInputError, match="filter_samples must be >= 2"):
        grpo.train(GRPOConfig(**base, filter_samples=1))
