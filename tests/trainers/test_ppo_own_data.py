"""PPO on a user's own prompts, reward functions and verifier (no built-in suite on the path),
and the summary / metric fixes that came with it."""

import json
import textwrap
from types import SimpleNamespace

import pytest
import torch
from tinyhf import save_suite_model

from rlhflab import core, rewards
from rlhflab.config import PPOConfig
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.report import write_report
from rlhflab.trainers import ppo
from rlhflab.trainers.online.loop import scored_batch
from rlhflab.trainers.online.ranks import rollout_seed

USER_REWARDS = '''
CALLS = []

def digits(prompts, completions, answer, **kwargs):
    """Share of digit characters; None (unscorable) where the row's answer is 'skip'."""
    CALLS.append({"answer": list(answer), "topic": kwargs.get("topic")})
    return [None if a == "skip" else sum(ch.isdigit() for ch in c) / max(len(c), 1)
            for c, a in zip(completions, answer)]

def named_only(prompts, completions, answer):
    return [float(len(a)) for a in answer]

def has_digit(prompts, completions, **kwargs):
    return [any(ch.isdigit() for ch in c) for c in completions]

def fails_on_seven(prompts, completions, answer, **kwargs):
    return [1.0 / (int(a) - 7) if a.isdigit() else 0.0 for a in answer]
'''


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


@pytest.fixture()
def user_files(tmp_path, monkeypatch):
    """prompts.jsonl (prompt + answer + topic columns, one conversational row), val.jsonl, my_rewards.py."""
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"Write the number {n} twice.", "answer": str(n), "topic": "numbers"} for n in range(20)]
    for n in range(0, 20, 4):
        rows[n]["answer"] = "skip"  # 5 of 20 rows the reward cannot score
    rows[5] = {"prompt": [{"role": "user", "content": "Count to 3."}], "answer": "123", "topic": "chat"}
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    val = [{"prompt": f"Say {n}.", "answer": str(n)} for n in range(30, 36)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    return tmp_path


def tiny_cfg(policy_dir, **overrides) -> PPOConfig:
    base = dict(model=policy_dir, batch_size=8, num_mini_batches=1, num_ppo_epochs=1, response_length=5,
                total_episodes=16, eval_every=1, eval_prompts=6, sample_prompts=2, max_new_tokens=5,
                progress=False, threads=1, learning_rate=1e-3, temperature=0.9)
    return PPOConfig(**{**base, **overrides})


def metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ppo_trains_on_user_prompts_with_a_user_reward_and_verifier(policy_dir, user_files):
    cfg = tiny_cfg(policy_dir, train_file="prompts.jsonl", validation_file="val.jsonl",
                   reward_fn="my_rewards.py:digits", verifier="my_rewards.py:has_digit", output_dir="run")
    result = ppo.train(cfg)
    summary = result.summary
    assert summary["prompts"] == "prompts.jsonl" and summary["reward"] == "functions"
    assert summary["held_out"]["metric"] == "val/pass_rate" and summary["held_out"]["verifier"] == "has_digit"
    rows = metric_rows(result.run_dir)
    evals = [r for r in rows if "val/pass_rate" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert not any(k.startswith("val/pass_rate/") for r in evals for k in r)  # no family column: no per-family rates
    updates = [r for r in rows if "objective/scores" in r]
    # 16 of the 20 rows are drawn once: at least one of the 5 'skip' rows, left out of the update and counted
    assert 1 <= sum(r["reward/invalid_rows"] for r in updates) <= 5
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples} <= {f"Say {n}." for n in range(30, 36)}  # validation prompts only


def test_the_reward_function_sees_every_column_and_none_rows_are_counted(policy_dir, user_files):
    from rlhflab.rewards.functions import FunctionReward, load_function

    fn = load_function("my_rewards.py:digits")
    prompts = ["a", "b", "c"]
    rows = [PromptRow("a", {"answer": "1", "topic": "x"}), PromptRow("b", {"answer": "skip"}),
            PromptRow("c", {"answer": "2", "topic": "y"})]
    out = FunctionReward(fn)(prompts, ["12", "ab", "a1"], rows)
    assert out.valid.tolist() == [True, False, True]
    assert out.scores.tolist() == [1.0, 0.0, 0.5]
    module = __import__("sys").modules[fn.__module__]
    assert module.CALLS[-1] == {"answer": ["1", "skip", "2"], "topic": ["x", None, "y"]}
    # a function without **kwargs gets only the columns it names
    named = FunctionReward(load_function("my_rewards.py:named_only"))(prompts, ["", "", ""], rows)
    assert named.scores.tolist() == [1.0, 4.0, 1.0]


def test_an_exception_in_a_user_function_names_the_function_row_and_prompt(user_files):
    from rlhflab.rewards.functions import FunctionReward, load_function

    reward = FunctionReward(load_function("my_rewards.py:fails_on_seven"))
    rows = [PromptRow(f"Write {n}.", {"answer": str(n)}, where=f"prompts.jsonl:{n + 1}") for n in (5, 6, 7, 8)]
    with pytest.raises(UserInputError) as err:
        reward([r.prompt for r in rows], ["x"] * 4, rows)
    message = str(err.value)
    assert "fails_on_seven" in message and "ZeroDivisionError" in message
    assert "row 2 (prompts.jsonl:8)" in message and "'Write 7.'" in message


@pytest.mark.parametrize("spec, message", [
    ("nope.py:f", "file not found: nope.py"),
    ("my_rewards.py:missing", "has no function 'missing'"),
    ("my_rewards.py", "does not name a function"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
])
def test_a_bad_function_spec_is_a_clear_error(user_files, spec, message):
    with pytest.raises(UserInputError, match=message):
        rewards.load_function(spec)


def test_reward_weights_must_match_the_functions(policy_dir, user_files):
    cfg = tiny_cfg(policy_dir, train_file="prompts.jsonl", reward_fn="my_rewards.py:digits,my_rewards.py:named_only",
                   reward_weights="1.0", output_dir="run")
    with pytest.raises(UserInputError, match="1 reward weights for 2 reward functions"):
        ppo.train(cfg)


def test_weighted_functions_sum(user_files):
    from rlhflab.trainers.online.setup import build_reward

    cfg = PPOConfig(model="unused", reward_fn="my_rewards.py:digits,my_rewards.py:named_only", reward_weights="2,0.5")
    reward, _ = build_reward(cfg, tokenizer=None)
    rows = [PromptRow("a", {"answer": "12"})]
    assert reward(["a"], ["1a"], rows).scores.tolist() == [2 * 0.5 + 0.5 * 2.0]


def test_without_a_verifier_the_held_out_signal_is_the_reward_and_the_report_says_so(policy_dir, user_files):
    cfg = tiny_cfg(policy_dir, train_file="prompts.jsonl", validation_file="val.jsonl",
                   reward_fn="my_rewards.py:digits", output_dir="run")
    from rlhflab.eval import RunMonitor

    result = ppo.train(cfg, monitor=RunMonitor.from_config(cfg))
    summary = result.summary
    assert summary["held_out"]["verifier"] is None and "own opinion" in summary["held_out"]["note"]
    assert "validation_pass_rate" not in summary and set(summary["validation_reward"]) == {"start", "end"}
    evals = [r for r in metric_rows(result.run_dir) if "val/reward" in r]
    assert len(evals) == 3 and all("val/pass_rate" not in r for r in evals)
    assert summary["best"]["step"] in (0, 1, 2) and "val/reward" in summary["best"]
    html = write_report(result.run_dir).read_text()
    assert "No verifier in this run" in html and "own opinion" in html


def test_a_train_file_without_validation_holds_out_a_seeded_slice(tmp_path):
    from rlhflab.sources.prompts import hold_out

    rows = [PromptRow(str(i)) for i in range(200)]
    train, val = hold_out(rows, wanted=100, seed=0)
    assert len(val) == 20 and len(train) == 180 and not {r.prompt for r in val} & {r.prompt for r in train}
    assert hold_out(rows, wanted=100, seed=0) == (train, val)
    few = rows[:30]
    assert hold_out(few, wanted=100, seed=0) == (few, few)  # too few to hold out: says so in the log


def test_the_checker_verifier_on_rows_without_suite_columns_is_refused(policy_dir, user_files):
    cfg = tiny_cfg(policy_dir, train_file="prompts.jsonl", reward_fn="my_rewards.py:digits", verifier="checker",
                   output_dir="run")
    with pytest.raises(UserInputError, match="needs 'family' and 'reference' columns"):
        ppo.train(cfg)


# --- fixes found in review ---------------------------------------------------------------------


def scripted_verifier(monkeypatch, rates: dict[int, float]):
    from rlhflab.trainers.online.evaluate import Evaluator

    real = Evaluator.evaluate

    def evaluate(self, policy, step, episode):
        metrics = real(self, policy, step, episode)
        metrics["val/pass_rate"] = rates[step]
        self.run.log({"val/pass_rate": rates[step]}, step=step)
        return metrics

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)


def test_after_keep_best_restores_the_summary_describes_the_saved_policy(policy_dir, tmp_path, monkeypatch):
    from rlhflab.eval import RunMonitor

    scripted_verifier(monkeypatch, {0: 0.2, 1: 0.5, 2: 0.3, 3: 0.1})
    cfg = tiny_cfg(policy_dir, total_episodes=24, num_train_prompts=22, num_validation_prompts=11,
                   num_test_prompts=11, eval_prompts=4, learning_rate=1e-2, output_dir=str(tmp_path / "run"))
    result = ppo.train(cfg, monitor=RunMonitor())
    summary = result.summary
    assert summary["best"] == {"step": 1, "val/pass_rate": 0.5, "restored": True}
    assert summary["validation_pass_rate"] == {"start": 0.2, "end": 0.5}  # the saved policy's, not update 3's 0.1
    update_1 = next(r for r in metric_rows(result.run_dir) if r["step"] == 1 and "objective/kl" in r)
    update_3 = next(r for r in metric_rows(result.run_dir) if r["step"] == 3 and "objective/kl" in r)
    assert update_1["objective/kl"] != update_3["objective/kl"]
    for key in ("objective/kl", "objective/scores", "response/length_mean"):
        assert summary["final"][key] == update_1[key]
    assert summary["final_is"] == "restored best update"


def test_explained_variance_reads_only_the_rows_the_reward_scored():
    values = torch.tensor([[0.5, 1.0, 0.0], [9.0, -9.0, 9.0], [1.0, 2.0, 2.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    valid = torch.tensor([True, False, True])
    zeros = torch.zeros(3, 3)
    rollout = SimpleNamespace(response_mask=mask, values=values, logprobs=zeros, ref_logprobs=zeros,
                              entropy=torch.ones(3, 3), ended_with_eos=torch.ones(3, dtype=torch.bool),
                              response_ids=torch.ones(3, 3, dtype=torch.long))
    batch = scored_batch(rollout, torch.tensor([1.0, 0.0, -1.0]), valid, 1)
    adv = ppo.PPO(PPOConfig(whiten_advantages=False)).advantages(batch)
    keep = mask & valid[:, None]
    residual, target = (adv.returns - values)[keep], adv.returns[keep]
    by_hand = 1 - residual.var(unbiased=False) / target.var(unbiased=False)
    assert adv.metrics["val/explained_variance"] == pytest.approx(by_hand.item(), abs=1e-6)
    unmasked = core.explained_variance(values, adv.returns, mask).item()
    assert adv.metrics["val/explained_variance"] != pytest.approx(unmasked)


def test_token_sampling_and_prompt_order_have_different_seeds(policy_dir, tmp_path, monkeypatch):
    seeds = []

    class Recording(torch.Generator):
        def manual_seed(self, seed):
            seeds.append(int(seed))
            return super().manual_seed(seed)

    monkeypatch.setattr(torch, "Generator", Recording)
    cfg = tiny_cfg(policy_dir, total_episodes=8, eval_every=0, num_train_prompts=22, num_validation_prompts=11,
                   num_test_prompts=11, seed=3, output_dir=str(tmp_path / "run"))
    ppo.train(cfg, reward_fn=lambda p, r, rows: [0.0] * len(r))
    assert 3 in seeds and rollout_seed(3, 1) in seeds and rollout_seed(3, 1) != 3
    order = torch.randperm(50, generator=torch.Generator().manual_seed(3))
    tokens = torch.randperm(50, generator=torch.Generator().manual_seed(rollout_seed(3, 1)))
    assert not torch.equal(order, tokens)


def test_user_files_never_reach_the_built_in_suite(policy_dir, user_files, monkeypatch):
    """SFT (tiny default model) and PPO on user files only: any call into the suite's prompt or
    corpus builders fails the test."""
    from rlhflab import tasks
    from rlhflab.config import SFTConfig
    from rlhflab.trainers import sft

    def suite(*args, **kwargs):
        raise AssertionError("the built-in suite was used on a user-data path")

    for name in ("build_splits", "sample_items", "template_corpus", "sft_rows", "pair_rows"):
        monkeypatch.setattr(tasks, name, suite)
    demos = [{"prompt": f"Write the number {n} twice.", "completion": f"{n} {n}"} for n in range(40)]
    (user_files / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demos))
    sft_run = sft.train(SFTConfig(train_file="sft.jsonl", max_steps=3, batch_size=8, eval_every=0, hidden_size=32,
                                  num_layers=1, intermediate_size=64, threads=1, progress=False,
                                  output_dir="sft-run"))
    rows = metric_rows(sft_run.run_dir)
    assert any("val/loss" in r for r in rows) and not any("val/pass_rate" in r for r in rows)
    cfg = tiny_cfg(str(sft_run.model_dir), train_file="prompts.jsonl", validation_file="val.jsonl",
                   reward_fn="my_rewards.py:digits", verifier="my_rewards.py:has_digit", output_dir="ppo-run")
    result = ppo.train(cfg)
    assert result.summary["prompts"] == "prompts.jsonl" and result.summary["updates"] == 2
