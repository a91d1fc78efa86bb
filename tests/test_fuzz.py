"""Property test: random architectures and budgets train like eager within the budget
(issue 18, item 5). ``tests/fuzz_models.py`` draws the model and holds the check; this runs a
few seeded examples in CI, ``benchmarks/fuzz.py`` many more."""
import pytest

hypothesis = pytest.importorskip("hypothesis")
from fuzz_models import NORMS, FuzzSpec, check_spec  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SPECS = st.builds(
    FuzzSpec,
    depth=st.integers(1, 4),
    width=st.sampled_from([16, 24, 32]),
    norm=st.sampled_from(NORMS),
    residual=st.booleans(),
    reuse_layer=st.booleans(),
    tied=st.booleans(),
    buffer=st.booleans(),
    frozen=st.booleans(),
    aux_output=st.booleans(),
    dropout=st.booleans(),
    budget_fraction=st.floats(0.02, 1.5),
    batch=st.integers(1, 3),
    seq=st.sampled_from([4, 8, 16]),
)


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(SPECS)
def test_random_training_steps_match_eager_within_budget(spec):
    check_spec(spec)
