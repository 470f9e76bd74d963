"""The README's Python example runs as written against the installed wheel."""

from __future__ import annotations

import contextlib
import io

from conftest import REPO


def test_the_readme_example_routes_one_step() -> None:
    text = (REPO / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert blocks, "no Python example in README.md"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 12, "the README example grew past ten lines"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {})
    shape, how = out.getvalue().split(")")
    assert shape.strip() == "(16, 512"
    assert how.strip() in ("Route", "Fetch", "Cached", "Gather")
