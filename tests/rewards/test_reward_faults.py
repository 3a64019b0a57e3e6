"""A user reward or verifier function that hangs, raises on a row, or returns something other than one float per
row (issue 34 item 4): the time limit per call (`--reward_timeout`) names the function, the row it hangs on and its
prompt; `--reward_errors invalid` leaves failing rows out and counts them per function; a wrong return is refused
naming the function and the row."""

import json
import signal
import textwrap
import threading
import time

import pytest
import torch
from critic_free import tiny, update_rows
from tinyhf import save_suite_model

from rlhflab import rewards
from rlhflab.config import GRPOConfig
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.rewards import CallLimits, FunctionReward, FunctionVerifier, call_with_deadline
from rlhflab.rewards.deadline import CallTimedOut
from rlhflab.trainers import grpo

ROWS = [PromptRow(p, {"answer": str(i)}, where=f"prompts.jsonl:{i + 1}") for i, p in enumerate(["a", "b", "c"])]
PROMPTS = [r.prompt for r in ROWS]


def hangs_on_b(prompts, completions, **kwargs):
    out = []
    for p in prompts:
        if p == "b":
            threading.Event().wait()  # forever
        out.append(float(len(p)))
    return out


def raises_on_b(prompts, completions, **kwargs):
    return [1.0 / (p != "b") for p in prompts]


def passes_unless_b(prompts, completions, **kwargs):
    if "b" in prompts:
        raise KeyError("no answer for b")
    return [True] * len(prompts)


def test_a_hang_ends_the_call_naming_the_function_the_row_its_prompt_and_the_line():
    started = time.time()
    with pytest.raises(UserInputError) as err:
        FunctionReward(hangs_on_b, limits=CallLimits(timeout=0.5))(PROMPTS, ["x", "y", "z"], ROWS)
    message = str(err.value)
    assert time.time() - started < 3  # the batch's 0.5 s, then row b's alone
    assert "reward function hangs_on_b did not return within 0.5 s on row 1 (prompts.jsonl:2)" in message
    assert "prompt 'b', completion 'y'" in message and "test_reward_faults.py" in message
    assert "--reward_timeout" in message and "--reward_errors invalid" in message
    assert signal.getsignal(signal.SIGURG) == signal.SIG_DFL  # the watchdog's handler is gone


def test_invalid_leaves_out_only_the_rows_that_hang_or_raise_and_counts_them_per_function():
    invalid = CallLimits(timeout=0.5, errors="invalid")
    hanging, raising = FunctionReward(hangs_on_b, limits=invalid), FunctionReward(raises_on_b, limits=invalid)
    out = hanging(PROMPTS, ["x", "y", "z"], ROWS)
    assert out.valid.tolist() == [True, False, True] and out.scores.tolist() == [1.0, 0.0, 1.0]
    out = rewards.CombinedReward([(hanging, 1.0), (raising, 1.0)])(PROMPTS, ["x", "y", "z"], ROWS)
    assert out.valid.tolist() == [True, False, True] and out.scores.tolist() == [2.0, 0.0, 2.0]
    verifier = FunctionVerifier(passes_unless_b, limits=invalid)
    checks = verifier(PROMPTS, ["x", "y", "z"], ROWS)
    assert [c.kind for c in checks] == ["pass", "error", "pass"] and "KeyError" in checks[1].reason
    summary = rewards.error_summary(rewards.CombinedReward([(hanging, 1.0), (raising, 1.0)]), verifier)
    assert summary == {"mode": "invalid", "timeout_s": 0.5, "lost_rows": {
        "reward function hangs_on_b": {"raised": 0, "timed_out": 2},
        "reward function raises_on_b": {"raised": 1, "timed_out": 0},
        "verifier passes_unless_b": {"raised": 1, "timed_out": 0}}}
    assert rewards.error_summary(rewards.CheckerReward(), None) == {}


@pytest.mark.parametrize("returned, named", [
    ("1.0", "returned a str for 3 completions"),
    ([[1.0], [2.0], [3.0]], "returned [1.0] (a list) for row 0 (prompts.jsonl:1), prompt 'a'"),
    (torch.ones(3, 2), "returned [1.0, 1.0] (a list) for row 0"),
    (torch.ones(4), "returned 4 values for 3 completions"),
    (["1", 2.0, 3.0], "returned '1' (a str) for row 0"),
])
@pytest.mark.parametrize("errors", ["stop", "invalid"])
def test_a_return_that_is_not_one_float_per_row_is_refused_naming_the_function(returned, named, errors):
    def wrong(prompts, completions, **kwargs):
        return returned

    with pytest.raises(UserInputError, match="wrong") as err:
        FunctionReward(wrong, limits=CallLimits(errors=errors))(PROMPTS, ["x", "y", "z"], ROWS)
    assert named in str(err.value)


def test_the_call_stays_on_the_main_thread_and_an_interrupt_it_swallows_still_times_it_out():
    def alarm_inside():  # math_verify's parse / verify time themselves with SIGALRM, main thread only
        previous = signal.signal(signal.SIGALRM, lambda *_: None)
        signal.signal(signal.SIGALRM, previous)
        return threading.current_thread() is threading.main_thread()

    def swallows():
        try:
            time.sleep(60)
        except BaseException:  # noqa: BLE001 - a bare except in a user's function
            return 1.0

    assert call_with_deadline(alarm_inside, 5.0) is True
    with pytest.raises(CallTimedOut, match="no answer after 0.3 s"):
        call_with_deadline(swallows, 0.3)
    assert call_with_deadline(lambda: 7, 0) == 7  # 0 = no limit


def test_off_the_main_thread_a_daemon_worker_runs_the_call():
    caught = []

    def caller():
        try:
            call_with_deadline(lambda: threading.Event().wait(), 0.3)
        except CallTimedOut as err:
            caught.append(err)

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(5)
    assert caught and "test_reward_faults.py" in caught[0].where


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


USER_FILE = '''
import threading

def sleeps_forever(prompts, completions, **kwargs):
    threading.Event().wait()

def fails_on_some(prompts, completions, **kwargs):
    return [1.0 / (len(c) % 3) for c in completions]
'''


def test_a_grpo_run_with_a_reward_function_that_hangs_ends_after_the_timeout(policy_dir, tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(textwrap.dedent(USER_FILE))
    cfg = tiny(GRPOConfig, policy_dir, num_generations=4, reward_fn=f"{path}:sleeps_forever", reward_timeout=1,
               output_dir=str(tmp_path / "run"), headroom_samples=0)
    started = time.time()
    with pytest.raises(UserInputError) as err:
        grpo.train(cfg)
    assert time.time() - started < 30
    message = str(err.value)
    assert "reward function sleeps_forever did not return within 1 s on row 0" in message
    assert "prompt '" in message and "user_rewards.py:5 (sleeps_forever)" in message


def test_a_grpo_run_leaves_out_the_rows_a_function_raises_on_under_invalid(policy_dir, tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(textwrap.dedent(USER_FILE))
    cfg = tiny(GRPOConfig, policy_dir, num_generations=4, reward_fn=f"{path}:fails_on_some", reward_errors="invalid",
               output_dir=str(tmp_path / "run"), headroom_samples=0, total_episodes=16)
    result = grpo.train(cfg)
    invalid = sum(row["reward/invalid_rows"] for row in update_rows(result.run_dir))
    assert 0 < invalid < 16
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["updates"] == 2
    assert summary["reward_errors"] == {"mode": "invalid", "timeout_s": 600.0, "lost_rows": {
        "reward function fails_on_some": {"raised": invalid, "timed_out": 0}}}


def test_eval_counts_a_verifier_s_lost_rows_in_its_summary(policy_dir, tmp_path):
    from rlhflab.config import EvalConfig
    from rlhflab.eval.pass_rate import evaluate

    (tmp_path / "checks.py").write_text("def raises_on_b(prompts, completions, **kwargs):\n"
                                        "    return [1 / (p != 'Say b.') > 2 for p in prompts]\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in "abc"))
    cfg = EvalConfig(model=policy_dir, prompts_file=str(prompts), verifier=f"{tmp_path / 'checks.py'}:raises_on_b",
                     reward_errors="invalid", max_new_tokens=4, output_dir=str(tmp_path / "eval"), progress=False)
    summary = evaluate(cfg).summary
    assert summary["reward_errors"]["lost_rows"] == {"verifier raises_on_b": {"raised": 1, "timed_out": 0}}
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert kinds == ["fail", "error", "fail"]


def test_lost_rows_are_summed_over_ranks(monkeypatch):
    from rlhflab import parallel

    reward = FunctionReward(raises_on_b, limits=CallLimits(errors="invalid"))
    reward(PROMPTS, ["x", "y", "z"], ROWS)
    monkeypatch.setattr(parallel, "all_sum", lambda t, world: t * world)  # `world` ranks that lost the same rows
    assert rewards.lost_rows(reward, world=3) == {"reward function raises_on_b": {"raised": 3, "timed_out": 0}}


STUCK = '''
import importlib.util, signal, sys, time
spec = importlib.util.spec_from_file_location("deadline", sys.argv[1])  # stdlib only: no torch to import
deadline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(deadline)
deadline.HARD_EXIT_AFTER_S, deadline.RESEND_EVERY_S = 0.4, 0.1

def stuck():  # as C code that never returns to Python: the interrupt is never delivered
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})
    time.sleep(30)

deadline.call_with_deadline(stuck, 0.3, "reward function stuck")
'''


def test_a_call_that_cannot_be_interrupted_ends_the_process_with_the_message():
    import subprocess
    import sys

    from rlhflab.rewards import deadline

    started = time.time()
    done = subprocess.run([sys.executable, "-c", STUCK, deadline.__file__], capture_output=True, text=True, timeout=20)
    assert time.time() - started < 10
    assert done.returncode == 2
    assert "reward function stuck did not return within 0.3 s and did not stop when interrupted" in done.stderr


@pytest.mark.parametrize("timeout", [-1.0, float("nan")])
def test_a_negative_reward_timeout_is_refused_at_config_check_time_naming_the_flag(timeout):
    """Whether or not the run has a function of the user's to time (the check used to wait until one was built,
    after the models loaded; without one, a negative limit passed unnoticed)."""
    from rlhflab.compare.plan import check_compare_config
    from rlhflab.config import CompareConfig, DPOConfig, EvalConfig, OnlineDPOConfig, PPOConfig, RMDiagnoseConfig
    from rlhflab.eval import pass_rate
    from rlhflab.eval.rm_diagnosis import check_diagnose_config
    from rlhflab.trainers import dpo, online_dpo, ppo

    named = r"--reward_timeout: reward_timeout must be >= 0 seconds, got"
    checks = [(grpo.check_config, GRPOConfig), (ppo.check_config, PPOConfig),
              (online_dpo.check_config, OnlineDPOConfig), (dpo.check_dpo_config, DPOConfig),
              (check_diagnose_config, RMDiagnoseConfig), (check_compare_config, CompareConfig)]
    for check, config in checks:
        with pytest.raises(UserInputError, match=named):
            check(config(model="no/such/folder", reward_timeout=timeout) if "model" in config.__dataclass_fields__
                  else config(reward_timeout=timeout))
    with pytest.raises(UserInputError, match=named):  # eval: refused before the (missing) model is read
        pass_rate.evaluate(EvalConfig(model="no/such/folder", reward_timeout=timeout, output_dir="unused"))


def test_the_cli_refuses_a_negative_reward_timeout_before_anything_loads(tmp_path, capsys):
    from rlhflab.cli import main

    out = tmp_path / "run"
    assert main(["grpo", "--model", "no/such/folder", "--output_dir", str(out), "--reward_timeout", "-5"]) == 2
    assert "--reward_timeout: reward_timeout must be >= 0 seconds, got -5.0" in capsys.readouterr().err
    assert not out.exists()
