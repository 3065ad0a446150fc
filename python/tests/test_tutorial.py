"""docs/tutorial-attention-maps.md runs as written: its ```python blocks, in order, in one
namespace (as a reader pastes them), in a temporary directory; the blocks check their own results
(SPEC 4.3, 4.4 and tokenmix.attention_weights against the written-out softmax), and the picture
they draw must exist."""

import pathlib
import re

import matplotlib.image
import torch

TUTORIAL = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tutorial-attention-maps.md"


def test_tutorial_code_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 5, "the tutorial's steps"
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    namespace = {"__name__": "tutorial"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{TUTORIAL.name}:block{i + 1}", "exec"), namespace)  # noqa: S102
    png = tmp_path / "attention-maps.png"
    assert png.exists() and matplotlib.image.imread(png).ndim == 3
    assert len(namespace["fig"].axes) == 2 * 4 + 1  # layers × heads, one colour bar
