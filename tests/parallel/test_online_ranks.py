"""The online methods in 2 processes (torchrun, gloo on CPU) against 1 process at the same global batch.

One torchrun launch trains GRPO and PPO under DDP and FSDP2, RLOO, REINFORCE and GRPO with BNPO under DDP, GRPO with --async_generation
(2 trainer processes, rank 0's generator process: 3 processes) and GRPO with --dynamic_sampling
(tests/parallel/online_ranks_driver.py); the same configs run here in one process. Checked: the weights after 3 updates
(max abs difference <= 1e-5, float32), metrics.jsonl (timing fields aside), that rank 0 alone wrote the
one run folder, checkpoints recording their layout (FSDP2: shards); then a PPO FSDP2 job killed with SIGKILL
and a PPO DDP job sent SIGTERM as a scheduler sends it (every process at once) after a checkpoint, both resumed
in one launch, equal the uninterrupted runs (the SIGTERM one bit for bit), its checkpoint is refused by 1 process with
the reason, a DDP checkpoint continues in 1 process, and an exception on rank 1 ends rank 0 within seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from runcheck import SUITE, WALL_CLOCK, metrics
from safetensors.torch import load_file
from tinyhf import save_eos_prone_model, save_suite_model

from rlhflab import parallel
from rlhflab.checkpoint import MARKER
from rlhflab.checkpoint.folder import complete_checkpoints, load_checkpoint
from rlhflab.config import STAGES, parse_config
from rlhflab.errors import UserInputError
from rlhflab.eval import RunMonitor
from rlhflab.trainers.online.ranks import check_world, micro_batches

DRIVER = Path(__file__).with_name("online_ranks_driver.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
REWARD = """def digits(prompts, completions, **columns):
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]
"""
# how far a threshold count may move when FSDP2's forward (the model's own) rounds differently from the lean one
THRESHOLD_COUNTS = ("clipfrac", "clip_ratio")
RUNS = {  # name -> (stage, strategy, the stage's own arguments)
    "grpo-ddp": ("grpo", "ddp", ["--num_generations", "4", "--learning_rate", "1e-2"]),
    "grpo-fsdp2": ("grpo", "fsdp2", ["--num_generations", "4", "--learning_rate", "1e-2"]),
    "ppo-ddp": ("ppo", "ddp", ["--learning_rate", "1e-3", "--adaptive_kl", "true", "--kl_target", "0.5"]),
    "ppo-fsdp2": ("ppo", "fsdp2", ["--learning_rate", "1e-3", "--adaptive_kl", "true", "--kl_target", "0.5"]),
    "rloo-ddp": ("rloo", "ddp", ["--num_generations", "4", "--learning_rate", "1e-2"]),
    # the two that divide by the step's tokens, every rank's rows counted (DAPO, the GRPO default, divides by the
    # rollout's tokens over the steps): GRPO with BNPO and REINFORCE, which also whitens its advantages over the
    # whole rollout and carries a moving-average baseline across updates
    "grpo-ddp-bnpo": ("grpo", "ddp", ["--num_generations", "4", "--learning_rate", "1e-2", "--loss_type", "bnpo"]),
    "reinforce-ddp": ("reinforce", "ddp", ["--learning_rate", "1e-2", "--baseline", "moving_average",
                                           "--normalize_advantages", "true"]),
    # rank 0's generator process samples every rollout with weights one update old (rollout/async_generator.py)
    "grpo-ddp-async": ("grpo", "ddp", ["--num_generations", "4", "--learning_rate", "1e-2", "--async_generation",
                                       "true", "--max_staleness", "1"]),
    # all-equal groups dropped and refilled: every rank holds the whole scored batch, so all take the same decisions
    "grpo-ddp-dynamic": ("grpo", "ddp", ["--num_generations", "4", "--learning_rate", "1e-2", "--dynamic_sampling",
                                         "true", "--max_refill_rounds", "2"]),
}
# the runs whose answers must have several lengths (the plain tiny model's are all cut at 6 tokens, where BNPO's
# step tokens equal DAPO's rollout tokens over steps): they start from tinyhf.save_eos_prone_model's policy
EOS_PRONE = {"grpo-ddp-bnpo", "reinforce-ddp"}
ASYNC_CLOCKS = ("async/wait_s", "async/generator_s")  # the generator's and the wait's seconds
# one update of one minibatch (2 micro-batches a rank) under bf16 autocast, in the same launch: the first step's
# ratio is exactly 1 and KL exactly 0 whatever the world size (DESIGN.md); name -> (RUNS entry, extra flags)
FIRST_STEP_BF16 = {f"{name}-bf16": (name, ["--bf16", "--num_mini_batches", "1", "--total_episodes", "8",
                                           *(["--num_ppo_epochs", "1"] if name.startswith("ppo") else [])])
                   for name in ("grpo-ddp", "grpo-fsdp2", "ppo-ddp", "ppo-fsdp2")}


def run_args(name: str, policy_dir: str, reward: str, out: Path, strategy: str | None = None) -> list[str]:
    stage, default, extra = RUNS[name]
    if name in EOS_PRONE:
        policy_dir = str(Path(policy_dir).with_name("eos_prone"))
    return [stage, "--model", policy_dir, "--output_dir", str(out), "--reward_fn", reward, "--batch_size", "8",
            "--num_mini_batches", "2", "--gradient_accumulation_steps", "2", "--response_length", "6",
            "--max_new_tokens", "6", "--total_episodes", "24", "--eval_every", "0", "--eval_prompts", "2",
            "--sample_prompts", "1", "--missing_eos_penalty", "0", "--stop_on_alarms", "", "--headroom_samples", "0",
            "--save_every", "1", "--keep_last_n", "0", "--parallel_strategy", strategy or default, *extra, *SUITE]


def environment(**extra: str) -> dict:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", **extra}


def launch(cwd: Path, *command: str, **env: str) -> subprocess.Popen:
    """2 processes under torchrun."""
    return subprocess.Popen([*TORCHRUN, *command], cwd=cwd, env=environment(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own), from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def finished(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{err[-4000:]}"
    return out


def train_here(args: list[str]):
    cfg = parse_config(STAGES[args[0]], args[1:], prog=f"rlhflab {args[0]}")
    import importlib

    return importlib.import_module(f"rlhflab.trainers.{args[0]}").train(cfg, monitor=RunMonitor.from_config(cfg))


def max_weight_difference(a: Path, b: Path) -> float:
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors") if "checkpoints" not in p.parts)
    assert files, f"no weights under {a}"
    worst = 0.0
    for rel in files:
        left, right = load_file(str(a / rel)), load_file(str(b / rel))
        assert left.keys() == right.keys(), rel
        worst = max([worst, *((left[k].float() - right[k].float()).abs().max().item() for k in left)])
    return worst


def assert_same_metrics(one: Path, two: Path, loose: tuple[str, ...] = ()) -> None:
    """Every row and key alike; floats to 1e-5 (relative above 1), keys containing a `loose` part may differ."""
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two) and len(rows_one) >= 5
    for a, b in zip(rows_one, rows_two):
        assert a.keys() == b.keys()
        for key in a:
            if any(part in key for part in loose):
                continue
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5, nan_ok=True), (a.get("step"), key)
            else:
                assert a[key] == b[key], (a.get("step"), key)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    policy_dir = save_suite_model(root / "policy")
    save_eos_prone_model(policy_dir, root / "eos_prone")  # run_args: EOS_PRONE's runs
    (root / "digits.py").write_text(REWARD)
    return root, policy_dir, f"{root / 'digits.py'}:digits"


@pytest.fixture(scope="module")
def two_processes(setup):
    """Every RUNS entry trained by one 2-process launch; its wall time and the launch folder's listing."""
    root, policy_dir, reward = setup
    work = root / "two"
    work.mkdir()
    specs = [json.dumps(run_args(name, policy_dir, reward, work / name)) for name in RUNS]
    specs += [json.dumps([*run_args(like, policy_dir, reward, root / "bf16" / name), *flags])
              for name, (like, flags) in FIRST_STEP_BF16.items()]  # outside `work`, whose listing a test checks
    started = time.time()
    finished(launch(work, str(DRIVER), *specs))
    return work, time.time() - started


@pytest.fixture(scope="module")
def one_process(setup):
    """The same configs in this process (the single-process path); strategy is ignored in one process."""
    root, policy_dir, reward = setup
    out = root / "one"
    for name in ("grpo-ddp", "ppo-ddp", "rloo-ddp", "grpo-ddp-bnpo", "reinforce-ddp", "grpo-ddp-async",
                 "grpo-ddp-dynamic"):
        train_here(run_args(name, policy_dir, reward, out / one_of(name)))
    return out


def one_of(name: str) -> str:
    """The one-process run a 2-process RUNS entry is compared with: the same without the strategy."""
    return name.replace("-ddp", "").replace("-fsdp2", "")


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_train_what_one_process_trains(two_processes, one_process, name):
    work, wall = two_processes
    stage, strategy, _ = RUNS[name]
    difference = max_weight_difference(one_process / one_of(name), work / name)
    print(f"\n{name}: max |w1 - w2| = {difference:.2e} over 3 updates (2-process launch of all runs: {wall:.0f} s)")
    assert difference <= 1e-5
    assert_same_metrics(one_process / one_of(name), work / name,
                        (THRESHOLD_COUNTS if strategy == "fsdp2" else ()) + ASYNC_CLOCKS)
    summary = json.loads((work / name / "summary.json").read_text())
    assert summary["parallel"]["world_size"] == 2 and summary["parallel"]["strategy"] == strategy
    assert summary["updates"] == 3 and summary["episodes"] == 24  # global batches: 3 x 8 answers, not 3 x 16


def test_the_bnpo_leg_sees_answers_of_several_lengths_where_dapo_trains_otherwise(setup, two_processes, tmp_path):
    """Not vacuous: BNPO's per-step token count differs from DAPO's rollout tokens over steps only when answers
    differ in length; with them, DAPO on the same policy ends with other weights."""
    root, policy_dir, reward = setup
    lengths = [row["response/length_mean"] for row in metrics(two_processes[0] / "grpo-ddp-bnpo")
               if "response/length_mean" in row]
    assert lengths and min(lengths) < 6.0  # some answers ended with EOS before the cap of 6
    args = run_args("grpo-ddp-bnpo", policy_dir, reward, tmp_path / "dapo")
    train_here([*args[:args.index("--loss_type")], *args[args.index("--loss_type") + 2:]])
    assert max_weight_difference(tmp_path / "dapo", two_processes[0] / "grpo-ddp-bnpo") > 1e-4


def test_two_trainer_processes_train_on_rollouts_of_one_generator_at_most_one_update_stale(two_processes):
    work, _ = two_processes
    rows = [r for r in metrics(work / "grpo-ddp-async") if "async/staleness" in r]
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]  # update 1: the starting weights are its own
    assert "sampler/is_weight_mean" not in rows[0]  # sampled with the trainer's own weights: nothing to correct
    assert all(0 < r["sampler/is_weight_mean"] <= 3 for r in rows[1:])  # token_truncate weights (cap 3) applied


def test_two_processes_refill_dynamic_sampling_batches_alike(two_processes):
    work, _ = two_processes
    rows = [r for r in metrics(work / "grpo-ddp-dynamic") if "dynamic/generated" in r]
    assert len(rows) == 3 and any(r["dynamic/refill_rounds"] > 0 for r in rows)  # refilled, in step, no hang


@pytest.mark.parametrize("name", list(FIRST_STEP_BF16))
def test_the_first_step_under_bf16_in_two_processes_has_ratio_exactly_one_and_kl_exactly_zero(setup, two_processes,
                                                                                               name):
    run = setup[0] / "bf16" / name
    first = next(r for r in metrics(run) if "objective/kl" in r)
    assert first["objective/kl"] == 0.0
    if name == "grpo-ddp-bf16":
        # Under DDP a rank's training micro-batches hold other rows than its rollout forward held (whole groups
        # shuffled across the ranks, then cut into micro-batches of half a group), so the packed shared-prompt
        # rows are laid out otherwise and bf16 rounds the same math differently: equal within rounding, bit for
        # bit only when the rows drawn happen to pack alike (they did with the prompts drawn before b2c7251 gave
        # the prompt order a stream of its own)
        assert abs(first["policy/ratio_min"] - 1) < 1e-4 and abs(first["policy/ratio_max"] - 1) < 1e-4
    else:
        assert first["policy/ratio_min"] == first["policy/ratio_max"] == 1.0
    assert json.loads((run / "summary.json").read_text())["precision"]["mixed_precision"] == "bf16"


def test_rank_0_alone_writes_one_run_folder_and_checkpoints_record_their_layout(two_processes, one_process):
    work, _ = two_processes
    assert sorted(p.name for p in work.iterdir()) == sorted(RUNS)  # nothing else, no default runs/ folder
    for name, (stage, strategy, _) in RUNS.items():
        run = work / name
        listing = sorted(p.name for p in run.iterdir())
        assert listing == sorted(p.name for p in (one_process / one_of(name)).iterdir()), name
        assert len((run / "samples.jsonl").read_text().splitlines()) == \
            len((one_process / one_of(name) / "samples.jsonl").read_text().splitlines())
        steps = complete_checkpoints(run / "checkpoints")
        assert [int(p.name.split("-")[1]) for p in steps] == [1, 2, 3]
        _, weights, state = load_checkpoint(steps[-1])
        assert state["parallel"] == {"strategy": strategy, "world_size": 2, "sharded_state": strategy == "fsdp2"}
        sharded = steps[-1] / "sharded"
        assert sharded.is_dir() == (strategy == "fsdp2")
        assert (weights == {}) == (strategy == "fsdp2")  # FSDP2: weights and moments are in the shards


def started(cwd: Path, args: list[str], marker: Path) -> subprocess.Popen:
    """`rlhflab ARGS` under torchrun, once `marker` exists."""
    proc = launch(cwd, "-m", "rlhflab", *args)
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.01)
    return proc


@pytest.fixture(scope="module")
def stopped_then_resumed(setup, tmp_path_factory):
    """PPO under FSDP2 killed (SIGKILL to torchrun and both ranks) after its update-1 checkpoint; PPO under DDP
    sent SIGTERM as a scheduler sends it (Slurm: every process of the job at once, so each rank gets it twice,
    directly and through torchrun) after the same checkpoint; then one launch resumes both (--resume latest)."""
    root, policy_dir, reward = setup
    tmp = tmp_path_factory.mktemp("stopped")
    out = {"killed": tmp / "ppo-fsdp2", "terminated": tmp / "ppo-ddp", "cwd": tmp}
    args = {"killed": run_args("ppo-fsdp2", policy_dir, reward, out["killed"]),
            "terminated": run_args("ppo-ddp", policy_dir, reward, out["terminated"])}
    for name, signum in (("killed", signal.SIGKILL), ("terminated", signal.SIGTERM)):
        proc = started(tmp, args[name], out[name] / "checkpoints" / "step-1" / MARKER)
        for pid in [proc.pid, *descendants(proc.pid)]:  # the whole job: torchrun and both ranks (own sessions)
            os.kill(pid, signum)
        out[f"{name}_err"] = proc.communicate(timeout=60)[1]
        out[f"{name}_ended"] = not (out[name] / "summary.json").exists()  # it stopped mid-run
    finished(launch(tmp, str(DRIVER), *(json.dumps([*a, "--resume", "latest"]) for a in args.values())))
    return out


def test_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(setup, two_processes,
                                                                            stopped_then_resumed, tmp_path):
    root, policy_dir, reward = setup
    work, _ = two_processes
    out = stopped_then_resumed["killed"]
    assert stopped_then_resumed["killed_ended"]
    assert max_weight_difference(work / "ppo-fsdp2", out) <= 1e-6
    assert_same_metrics(work / "ppo-fsdp2", out)
    resumes = json.loads((out / "summary.json").read_text())["resumes"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 1

    # the sharded checkpoint in one process: refused, with the launch that reads it
    copy = tmp_path / "copy"
    shutil.copytree(work / "ppo-fsdp2", copy)
    with pytest.raises(UserInputError, match="nproc_per_node 2"):
        train_here([*run_args("ppo-fsdp2", policy_dir, reward, copy), "--resume", str(copy / "checkpoints/step-2")])


def test_sigterm_to_every_process_of_the_job_stops_both_ppo_ranks_at_one_step_and_resume_is_exact(
        two_processes, stopped_then_resumed):
    work, _ = two_processes
    err, out = stopped_then_resumed["terminated_err"], stopped_then_resumed["terminated"]
    lines = [line for line in err.splitlines() if line.startswith("rlhflab[rank ") and "interrupted: SIGTERM" in line]
    assert len(lines) == 2, err[-3000:]  # each rank finished the step, wrote its part and exited 143
    steps = {line.split("SIGTERM after step ")[1].split(":")[0] for line in lines}
    assert len(steps) == 1, lines  # the same step on both ranks
    print(f"\nPPO, 2 processes: SIGTERM to torchrun and both ranks after update 1; both stopped after update "
          f"{steps.pop()}")
    # each rank got it twice, directly and from torchrun (unless the two came together): never 'quit at once'
    assert "second SIGTERM" not in err and "exitcode" not in err  # no rank ended otherwise than by its own 143
    assert stopped_then_resumed["terminated_ended"]
    assert max_weight_difference(work / "ppo-ddp", out) == 0.0  # policy and value, bit for bit
    assert_same_metrics(work / "ppo-ddp", out)
    assert len(json.loads((out / "summary.json").read_text())["resumes"]) == 1


def test_a_ddp_checkpoint_continues_in_one_process(setup, two_processes, tmp_path):
    root, policy_dir, reward = setup
    work, _ = two_processes
    copy = tmp_path / "grpo-ddp"
    shutil.copytree(work / "grpo-ddp", copy)
    train_here([*run_args("grpo-ddp", policy_dir, reward, copy), "--resume", str(copy / "checkpoints/step-1")])
    assert [r["step"] for r in json.loads((copy / "summary.json").read_text())["resumes"]] == [1]
    assert max_weight_difference(work / "grpo-ddp", copy) <= 1e-5


def test_an_exception_on_rank_1_ends_rank_0_within_seconds_with_its_message(setup, tmp_path):
    root, policy_dir, reward = setup
    out = tmp_path / "failing"
    args = [*run_args("grpo-ddp", policy_dir, reward, out), "--total_episodes", "800"]
    proc = launch(tmp_path, "-m", "rlhflab", *args, RLHFLAB_FAIL_AT="1:1")
    log = out / "metrics.jsonl"
    while not (log.exists() and '"step": 1' in log.read_text()):  # rank 0 logged update 1: rank 1 raises next
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    failed_at = time.time()
    _, err = proc.communicate(timeout=120)
    print(f"\nrank 1 failed after update 1; the job ended {time.time() - failed_at:.1f} s later")
    assert proc.returncode != 0
    assert time.time() - failed_at < 20
    assert "deliberate failure on rank 1 after step 1" in err
    assert not (out / "summary.json").exists()


def test_micro_batches_are_one_process_cut_shared_out_in_blocks_with_zero_weight_padding():
    def cut(rows: int, accumulation: int, world_size: int) -> list[list[tuple[int, list[int], bool]]]:
        return [[(i, idx.tolist(), real) for i, idx, real in
                 micro_batches(torch.arange(rows), accumulation, parallel.World(rank, world_size))]
                for rank in range(world_size)]

    assert cut(8, 1, 1) == [[(0, list(range(8)), True)]]  # one process: its own cut, unchanged
    assert cut(8, 1, 2) == [[(0, [0, 1, 2, 3], True)], [(1, [4, 5, 6, 7], True)]]  # = 1 process with 2 steps
    assert cut(8, 3, 2) == [[(0, [0, 1], True), (1, [2, 3], True)], [(2, [4, 5], True), (3, [6, 7], True)]]
    assert cut(5, 2, 2) == [[(0, [0, 1, 2], True)], [(1, [3, 4], True)]]
    assert cut(1, 1, 2) == [[(0, [0], True)], [(1, [0], False)]]  # rank 1 repeats row 0 with zero weight


def test_a_global_batch_that_does_not_share_out_is_refused_with_sizes_that_do():
    config = SimpleNamespace(batch_size=12, num_mini_batches=1, gradient_accumulation_steps=1)
    with pytest.raises(UserInputError, match="3 prompts do not share out over 2 processes.*e.g. 8 or 16"):
        check_world(config, 4, False, parallel.World(0, 2))
    with pytest.raises(UserInputError, match="does not divide over 4 processes"):
        check_world(SimpleNamespace(batch_size=6, num_mini_batches=1, gradient_accumulation_steps=1), 1, False,
                    parallel.World(0, 4))
    with pytest.raises(UserInputError, match="micro-batches of 2, which do not hold whole groups of 4"):
        check_world(SimpleNamespace(batch_size=8, num_mini_batches=2, gradient_accumulation_steps=1), 4, True,
                    parallel.World(0, 2))
    check_world(SimpleNamespace(batch_size=16, num_mini_batches=1, gradient_accumulation_steps=1), 4, True,
                parallel.World(1, 2))  # 4 prompts, micro-batches of 8 answers: fine


def test_a_row_samples_the_same_tokens_whichever_process_decodes_it(setup):
    """Rows 4-7 of a global batch of 8, decoded alone with their BatchPlace, give the tokens the whole batch
    gives them in one decoding (rows finish at different steps and are dropped as they do)."""
    from rlhflab import data, models, tasks
    from rlhflab.rollout.generate import BatchPlace, GenerationSettings, generate
    from rlhflab.trainers.online.ranks import rollout_generator

    _, policy_dir, _ = setup
    model = models.load_causal_lm(policy_dir, dtype="float32", device=torch.device("cpu")).eval()
    tokenizer = models.load_tokenizer(policy_dir)
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in tasks.sample_items("train", 8, seed=0, split_seed=0)])
    settings = GenerationSettings(12, True, 1.0)

    def decode(rows: list[list[int]], place: BatchPlace | None, eos: int):
        return generate(model, rows, pad_id=tokenizer.pad_token_id, eos_id=eos, settings=settings,
                        generator=rollout_generator(3, 7, "cpu"), place=place)

    # the random tiny model never says EOS: stand in its most sampled token, so rows finish at different steps
    eos = int(decode(prompts, None, -1).response_ids.flatten().mode().values)
    whole = decode(prompts, None, eos)
    part = decode(prompts[4:], BatchPlace(4, 8, max(len(p) for p in prompts)), eos)
    width = part.response_ids.shape[1]
    assert torch.equal(part.response_ids, whole.response_ids[4:, :width])
    assert not whole.response_mask[4:, width:].any()  # nothing real beyond the part's own width
    assert torch.equal(part.query_ids, whole.query_ids[4:])  # the global batch's prompt padding
    lengths = whole.response_mask.sum(dim=1)
    assert len(set(lengths[4:].tolist())) > 1 and lengths.max() == 12  # rows of the part ended at different steps
