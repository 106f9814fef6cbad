"""The Python code blocks of the README and the docs run as written.

The ```python blocks of one page run in order in one namespace, as a reader
would paste them. Fragments that need the reader's own model or data are
tagged ```py instead and are not run.
"""

import pathlib
import re

import jax
import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(page: str) -> list[str]:
    return _BLOCK.findall((ROOT / page).read_text())


@pytest.mark.standard_promotion
@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)])
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # pages may write files (checkpoints, plots)
    namespace: dict = {"__name__": f"docs:{page}"}
    # Readers run these with JAX's defaults, not the suite's strict settings.
    with jax.numpy_rank_promotion("allow"):
        for i, block in enumerate(_blocks(page)):
            try:
                exec(compile(block, f"{page}[block {i}]", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{page}, code block {i} failed: {e!r}") from e
