"""The Python code blocks of the README and the docs run as written.

Each ```python block runs alone, in a fresh namespace, as a reader who copies
that one block runs it: it has its own imports and data. A block that goes on
from the code before it says so in its first line, ``# Continues the code
above`` (and may name what it uses: ``# Continues the code above (params,
opt_state).``); it runs with what the blocks above it on the page defined.
Fragments that need the reader's own model or data are tagged ```py instead
and are not run.
"""

import pathlib
import re

import jax
import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CONTINUES = "# Continues the code above"


def blocks(text: str) -> list[str]:
    """The ```python blocks of a page's text."""
    return _BLOCK.findall(text)


def run_blocks(name: str, text: str) -> None:
    """Runs each block of ``text`` in a fresh namespace, a continuation with
    what the blocks above it defined; raises ``AssertionError`` naming the
    block that failed."""
    above: dict = {}  # what the blocks so far defined, as if run in order
    for i, block in enumerate(blocks(text)):
        if not block.startswith(CONTINUES):
            namespace = {"__name__": f"docs:{name}"}
        elif i == 0:
            raise AssertionError(f"{name}, code block 0 continues no code")
        else:
            namespace = above
        try:
            exec(compile(block, f"{name}[block {i}]", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{name}, code block {i} failed: {e!r}") from e
        above.update(namespace)


def _page_blocks(page: str) -> list[str]:
    return blocks((ROOT / page).read_text())


@pytest.mark.standard_promotion
@pytest.mark.parametrize("page", [p for p in PAGES if _page_blocks(p)])
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # pages may write files (checkpoints, plots)
    # Readers run these with JAX's defaults, not the suite's strict settings.
    with jax.numpy_rank_promotion("allow"):
        run_blocks(page, (ROOT / page).read_text())


def _page(*codes: str) -> str:
    return "".join(f"Some text.\n\n```python\n{code}```\n\n" for code in codes)


def test_a_block_that_needs_the_block_before_it_fails():
    page = _page("import math\nx = math.pi\n", "y = x * 2\n")
    with pytest.raises(AssertionError, match=r"code block 1 failed: NameError"):
        run_blocks("page.md", page)
    # An import from an earlier block is not there either.
    page = _page("import math\n", "y = math.pi\n")
    with pytest.raises(AssertionError, match=r"code block 1 failed: NameError"):
        run_blocks("page.md", page)


def test_a_block_marked_as_continuing_sees_the_blocks_above_it():
    run_blocks(
        "page.md",
        _page(
            "import math\nx = math.pi\n",
            "z = 2\n",  # runs alone
            f"{CONTINUES} (x, math).\ny = x * z\n",
            f"{CONTINUES}\nassert y == 2 * math.pi\n",
        ),
    )
    # What a continuation defines is there for the continuations after it only.
    page = _page("x = 1\n", f"{CONTINUES}\nw = x\n", "print(w)\n")
    with pytest.raises(AssertionError, match=r"code block 2 failed: NameError"):
        run_blocks("page.md", page)
    with pytest.raises(AssertionError, match="code block 0 continues no code"):
        run_blocks("page.md", _page(f"{CONTINUES}\nx = 1\n"))


def test_py_fragments_and_other_languages_are_not_run():
    text = "```py\nundefined_name\n```\n\n```bash\nexit 1\n```\n"
    assert blocks(text) == []
    run_blocks("page.md", text + _page("x = 1\n"))
