"""The Python examples of README.md ("Use it in transformers", "torch.compile") run as written:
each block between <!-- python-example:NAME:begin --> and <!-- python-example:NAME:end --> is
extracted and executed; the examples check their own results (like the C++ example, which
tests/readme/tests.cmake builds and runs), so the documentation cannot rot."""

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _example(name: str) -> str:
    text = README.read_text(encoding="utf-8")
    block = re.search(rf"<!-- python-example:{name}:begin -->\s*```python\n(.*?)```\s*"
                      rf"<!-- python-example:{name}:end -->", text, re.S)
    assert block, f"README.md: no ```python block between the python-example:{name} markers"
    return block.group(1)


@pytest.mark.parametrize("name", ["transformers", "compile"])
def test_readme_python_example_runs(name):
    torch.manual_seed(0)
    torch._dynamo.reset()
    exec(compile(_example(name), f"README.md:{name}", "exec"), {"__name__": "readme_example"})
