import pytest

from tests.jobs_support import claim_database, release_database, reset_database


@pytest.fixture(scope="session")
def redis_database():
    """A database of the local Redis that only this test session uses: (url, connection)."""
    url, connection = claim_database()
    yield url, connection
    release_database(connection)


@pytest.fixture
def redis_url(redis_database):
    """The session's database, emptied after each test (it holds nothing but this session's keys)."""
    url, connection = redis_database
    yield url
    reset_database(connection)
