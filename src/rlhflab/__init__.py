"""rlhflab: PPO-based RLHF with honest evaluation."""

__version__ = "0.1.0"
