"""A saved tiny policy for the checkpoint tests."""

import pytest

from rlhflab import models, tasks


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("policy")
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, seed=0)
    models.save_model_folder(folder, model, tokenizer)
    return str(folder)

