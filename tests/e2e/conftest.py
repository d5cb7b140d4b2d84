import pytest

from tests.helpers.entry_point import make_tiny_base


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A tiny base checkpoint shared by the end-to-end tests of this session."""
    return make_tiny_base(tmp_path_factory.mktemp("tiny-base"))
