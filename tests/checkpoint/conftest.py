"""A saved tiny policy for the checkpoint tests."""

import pytest
from tinyhf import save_suite_model


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> str:
    return save_suite_model(tmp_path_factory.mktemp("policy"))

