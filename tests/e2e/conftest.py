import pytest

from tests.jobs_support import claim_database, release_database


@pytest.fixture(scope="session")
def e2e_redis():
    """A database of the local Redis that only this test session uses: (url, connection)."""
    url, connection = claim_database()
    yield url, connection
    release_database(connection)
