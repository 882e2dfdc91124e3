"""The Triton cases of a kernel's test module, run on CPU by Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported (triton.language's own @jit helpers,
tl.zeros among them, are decorated then), which this process cannot promise once anything here
(vLLM) has imported triton. So each test module that has Triton cases defines
`run_triton_cases() -> dict` (JSON-able results) and asks for `triton_results`: the module runs in a
TRITON_INTERPRET=1 child, once per module, and its tests assert on the returned dict.
"""

from __future__ import annotations

import pytest

from moonserve.kernels.checks import run_interpreted

# The child program: the test module, loaded by path (not as __main__), then its Triton cases.
CHILD = "import json, runpy\nprint(json.dumps(runpy.run_path({path!r})['run_triton_cases']()))\n"


@pytest.fixture(scope="module")
def triton_results(request, tmp_path_factory) -> dict:
    """`run_triton_cases()` of the requesting test module, as computed under TRITON_INTERPRET=1."""
    pytest.importorskip("triton",
                        reason="triton is not installed; the Triton fast path cannot be tested")
    child = tmp_path_factory.mktemp("triton_interpreter") / f"run_{request.path.stem}.py"
    child.write_text(CHILD.format(path=str(request.path)))
    return run_interpreted(str(child))
