"""Reward functions written as TRL's documentation writes them run unchanged: on conversational prompts they get
message lists and `[{"role": "assistant", "content": ...}]` completions, on standard prompts strings; during
training also `completion_ids` and `trainer_state`."""

import json
import re
import textwrap

import pytest
from tinyhf import save_suite_model

from rlhflab import models, rewards
from rlhflab.config import GRPOConfig
from rlhflab.sources.prompts import file_prompts
from rlhflab.trainers import grpo

# in the spirit of TRL's GRPO docs ("Using a custom reward function"); nothing here knows about rlhflab
TRL_STYLE = '''
import json, os, re

def format_reward(completions, **kwargs):
    """1 where the answer is <think>...</think><answer>...</answer>."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]

def accuracy_reward(completions, solution, **kwargs):
    return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, solution)]

def length_penalty(completions, **kwargs):
    """TRL's reward_len, on standard (string) data."""
    return [-abs(20 - len(c)) for c in completions]

def recorder(prompts, completions, completion_ids, trainer_state, **kwargs):
    """Writes what it was handed beside this file, one JSON line a call."""
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as out:
        out.write(json.dumps({"prompt": prompts[0], "completion": completions[0], "ids": completion_ids,
                              "step": trainer_state.global_step, "solution": kwargs["solution"][0]}) + "\\n")
    return [0.0] * len(completions)
'''


def load(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(textwrap.dedent(TRL_STYLE))
    return {name: rewards.load_function(f"{path}:{name}") for name in
            ("format_reward", "accuracy_reward", "length_penalty", "recorder")}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return models.load_tokenizer(save_suite_model(tmp_path_factory.mktemp("policy")))


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_conversational_prompts_give_message_lists_and_assistant_completions(tmp_path, tokenizer):
    fns = load(tmp_path)
    ask = lambda q: [{"role": "system", "content": "Think first."}, {"role": "user", "content": q}]  # noqa: E731
    rows = file_prompts(write(tmp_path / "p.jsonl", [{"prompt": ask("1+1?"), "solution": "2"},
                                                     {"prompt": ask("2+2?"), "solution": "4"}]), tokenizer)
    texts = ["<think>easy</think><answer>2</answer>", " 5"]
    prompts = [r.prompt for r in rows]
    assert rewards.FunctionReward(fns["format_reward"])(prompts, texts, rows).scores.tolist() == [1.0, 0.0]
    assert rewards.FunctionReward(fns["accuracy_reward"])(prompts, ["2", " 4 "], rows).scores.tolist() == [1.0, 1.0]
    seen = []
    fn = lambda prompts, completions, **kw: seen.append((prompts, completions)) or [1.0] * len(prompts)  # noqa: E731
    rewards.FunctionVerifier(fn)(prompts, texts, rows)  # verifiers get the same
    assert seen == [([ask("1+1?"), ask("2+2?")], [[{"role": "assistant", "content": t}] for t in texts])]


def test_standard_prompts_give_strings(tmp_path, tokenizer):
    fns = load(tmp_path)
    rows = file_prompts(write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "solution": "2"}]), tokenizer)
    out = rewards.FunctionReward(fns["length_penalty"])([rows[0].prompt], ["x" * 15], rows)
    assert out.scores.tolist() == [-5.0]
    seen = []
    rewards.FunctionReward(lambda prompts, completions, **kw: seen.append((prompts, completions)) or [0.0])(
        ["1+1="], ["2"], rows)
    assert seen == [(["1+1="], ["2"])]


def test_completion_ids_and_trainer_state_reach_the_functions_that_take_them(tmp_path, tokenizer):
    rows = file_prompts(write(tmp_path / "p.jsonl", [{"prompt": "a", "completion_ids": "column"},
                                                     {"prompt": "b", "completion_ids": "column"}]), tokenizer)
    context = rewards.ScoreContext(completion_ids=[[5, 6, 1], [7]], global_step=3)
    named = lambda prompts, completions, completion_ids: [float(len(i)) for i in completion_ids]  # noqa: E731
    assert rewards.FunctionReward(named)(["a", "b"], ["x", "y"], rows, context).scores.tolist() == [3.0, 1.0]
    seen = {}
    def everything(prompts, completions, **kwargs):
        seen.update(kwargs)
        return [0.0, 0.0]
    rewards.FunctionReward(everything)(["a", "b"], ["x", "y"], rows, context)
    assert seen["completion_ids"] == [[5, 6, 1], [7]] and seen["trainer_state"].global_step == 3  # not the column
    rewards.FunctionReward(everything)(["a", "b"], ["x", "y"], rows)  # no trainer (evaluation): neither is passed
    seen.clear()
    rewards.FunctionReward(everything)(["a", "b"], ["x", "y"], rows)
    assert "completion_ids" not in seen and "trainer_state" not in seen
    # a plain reward source (three arguments) given to a trainer still works: the context is not forced on it
    plain = lambda prompts, responses, rows: [1.0] * len(prompts)  # noqa: E731
    assert rewards.score(plain, ["a"], ["x"], rows[:1], context) == [1.0]


def test_grpo_runs_trl_style_functions_unchanged_on_conversational_data(tmp_path):
    fns_file = tmp_path / "trl_rewards.py"
    fns_file.write_text(textwrap.dedent(TRL_STYLE))
    policy = save_suite_model(tmp_path / "policy")
    prompts = [{"prompt": [{"role": "user", "content": f"Add {a} and {a}."}], "solution": str(2 * a)}
               for a in range(12)]
    write(tmp_path / "prompts.jsonl", prompts)
    cfg = GRPOConfig(model=policy, train_file=str(tmp_path / "prompts.jsonl"), output_dir=str(tmp_path / "run"),
                     reward_fn=f"{fns_file}:format_reward,{fns_file}:accuracy_reward,{fns_file}:recorder",
                     num_generations=2, batch_size=4, total_episodes=8, response_length=6, max_new_tokens=6,
                     eval_every=0, eval_prompts=4, progress=False, write_report=False, threads=2, save_every=-1)
    result = grpo.train(cfg)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # the evaluations before the first update and after the last (no verifier: the reward's own), and the two
    # rollouts between: the updates done when each was scored
    assert [c["step"] for c in calls] == [0, 0, 1, 2]  # GRPO: one pass of one minibatch an update
    tokenizer = models.load_tokenizer(policy)
    for call in calls:
        assert isinstance(call["prompt"], list) and call["prompt"][0]["role"] == "user"
        assert re.fullmatch(r"Add \d+ and \d+\.", call["prompt"][0]["content"])
        assert call["completion"][0]["role"] == "assistant" and len(call["ids"]) == 4  # eval_prompts / batch
        text = tokenizer.decode([t for t in call["ids"][0] if t != tokenizer.eos_token_id], skip_special_tokens=True)
        assert text == call["completion"][0]["content"] and 1 <= len(call["ids"][0]) <= 6
        assert call["solution"] == str(2 * int(call["prompt"][0]["content"].split()[1]))
    assert result.summary["reward_functions"] == [f"{fns_file}:{n}" for n in
                                                  ("format_reward", "accuracy_reward", "recorder")]
