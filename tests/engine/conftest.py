"""Engine-store tests. The contract suite lives in the SDK package (not a test
module), so ask pytest to rewrite its asserts for readable failures."""

import pytest

pytest.register_assert_rewrite("fencepost.store_contract")
