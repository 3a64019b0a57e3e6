"""`rlhflab compare`: which method helps on *this* task, judged fairly.

    rlhflab compare --model runs/demo-.../sft/model --methods ppo,grpo,rloo,reinforce,dpo,online-dpo \\
        --budget episodes=3840 --output_dir runs/compare

Every method starts from the same model, with the same prompts, seed, reward, generation
settings and budget, and is judged by the same evaluation:

  budget      episodes=N: N sampled responses (`total_episodes`) for an online method, N
              preference pairs trained on (`max_pairs`) for DPO; or seconds=S of training
              wall time (`max_seconds`) for every method
  test        the test split (the suite's, or --prompts_file with --verifier, as `rlhflab
              eval`), the same decoding (greedy by default), read once at the end; the
              starting model is evaluated once too, so gain = end - start
  KL          of every trained model to the starting model, measured the same way for all
              (DPO too): responses sampled at the rollout temperature for each test prompt,
              mean of sum_t log pi(a_t) - log pi_ref(a_t) (the k1 Monte-Carlo estimate)

Each method's own settings are its config's defaults (its recipe for the suite), changed only
by its section of the --config YAML (`grpo: {learning_rate: 2.0e-5}`); a section may not set
a shared field or the budget. Every config is built and checked before the first run.

    DIR/config.yaml, versions.json   the comparison's own config and software
    DIR/<method>/                    each method's run folder (config, metrics, summary, report.html, model/)
    DIR/samples.jsonl                every model's test answers with their verdicts (paired by prompt_index)
    DIR/summary.json                 test_pass_rate / test_tables per model, methods.<name>.{test_pass_rate,
                                     gain, kl_to_reference, wall_s, episodes, episodes_per_s, stopped, alarms}
    DIR/report.html                  the methods side by side, curves on shared axes, the verdict in words

A method that fails is recorded with its error and the others still run. The package runs trainers and
writes reports, so it sits beside sweep.py (layer 6, below cli):

    plan.py       the methods, the budget and the per-method sections -> every method's config, checked first
    judge.py      the same test evaluation and KL to the starting model for every model
    run.py        train, test and measure each method in turn; summary.json after each
    table.py      the console table of a comparison's summary
    demo_step.py  `rlhflab demo --compare`: the comparison from the demo's SFT model
"""

from rlhflab.compare.demo_step import demo_compare_config, run_demo_with_comparison
from rlhflab.compare.plan import (METHODS, Budget, ComparePlan, Method, available_methods, config_class, parse_budget,
                                  parse_compare, parse_methods, plan_compare, shared_values)
from rlhflab.compare.run import run_compare
from rlhflab.compare.table import format_compare_table
from rlhflab.eval import kl_to_reference

__all__ = ["METHODS", "Budget", "ComparePlan", "Method", "available_methods", "config_class", "demo_compare_config",
           "format_compare_table", "kl_to_reference", "parse_budget", "parse_compare", "parse_methods", "plan_compare",
           "run_compare", "run_demo_with_comparison", "shared_values"]
