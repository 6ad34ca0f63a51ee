"""The native library's variants this machine executes (config.kernel_variants_here: an AVX-512 VNNI
machine runs avx512-vnni, avx512, avx2 and portable), for the kernel tests to run against each, so
that no variant's code paths ship untested. A test takes the `variant` fixture, parametrized
indirectly:

    @pytest.mark.parametrize("variant", ALL, indirect=True)     # the fast kernel tests: every variant
    @pytest.mark.parametrize("variant", TWO, indirect=True)     # model-level ones: the default and portable
    @pytest.mark.parametrize("variant", I8, indirect=True)      # the int8-activation kernel's (all but portable)

Within the test, kernels/native.py's calls go to that variant's library (native.use_variant; each is
built once per machine, on first use, into the kernels cache)."""

from __future__ import annotations

import pytest

from outrider.config import kernel_variants_here
from outrider.kernels import native

HERE = kernel_variants_here()  # best first
DEFAULT = HERE[0]
# the one beside the default for model-level tests: plain C shares the least code with the others
OTHER = "portable" if DEFAULT != "portable" else None


def _params(names) -> list:
    return [pytest.param(name, id=name) for name in names]


ALL = _params(HERE)
TWO = _params([DEFAULT] + ([OTHER] if OTHER else []))
# the int8-activation kernel's: every variant but portable (qmatmul_i8.c on AVX-512 VNNI, qmatmul_i8_avx2.c on AVX2)
I8 = _params([v for v in HERE if v != "portable"]) or [
    pytest.param("none", id="no-i8-variant", marks=pytest.mark.skip(reason="no AVX2 here"))]


EXERCISED: set[str] = set()  # the variants whose kernels ran a test in this process (conftest reports them)


@pytest.fixture
def variant(request):
    """The variant named by the test's parameter in use for the test (skipped where it does not build)."""
    with native.use_variant(request.param):
        if not native.available():
            pytest.skip(f"the {request.param} kernels: {native.reason()}")
        EXERCISED.add(request.param)
        yield request.param
