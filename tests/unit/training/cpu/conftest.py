from collections.abc import Iterator

import pytest

from training.cpu import embedding_update


@pytest.fixture(autouse=True)
def fbgemms_own_embedding_update_after_each_test() -> Iterator[None]:
    """`accelerate` registers a CPU kernel for fbgemm's op process-wide: no test leaves one
    registered for the next."""
    yield
    embedding_update.use("fbgemm")
