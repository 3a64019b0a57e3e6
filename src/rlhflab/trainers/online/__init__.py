"""The one online cycle (loop.py) and its parts, shared by every online algorithm (trainers/ppo.py, grpo.py,
rloo.py, reinforce.py, online_dpo.py)."""
