"""Real English text, available offline: Jane Austen's six novels and the Python documentation sources.

Sources, both Debian packages (fetched with ``apt-get download``, unpacked with ``dpkg-deb -x``, never installed):

* ``r-cran-janeaustenr``: the R package janeaustenr, whose data sets are the six novels as character vectors (one
  element per line of the Project Gutenberg text). R stores them in its lazy-load database (``data/Rdata.rdx`` +
  ``data/Rdata.rdb``). R is not needed: :func:`unserialize_r` reads the subset of R's serialization format those
  files use.
* ``python3.11-doc``: the reStructuredText sources of the Python 3.11 documentation
  (``usr/share/doc/python3.11/html/_sources/**/*.rst.txt``).

Cache (under :func:`kvpress_cpp._cache.cache_dir`, i.e. ``$KVPRESS_CPP_CACHE/texts``):

* ``austen/<name>.txt``: each novel as UTF-8 text, lines joined with ``"\\n"``. Written once after the parse is
  verified (six novels, each over 100k characters, no NA lines), so later calls neither fetch nor parse.
* ``python-docs/``: the ``_sources`` tree copied out of the package.

The ``.deb`` files and the rest of the unpacked packages are deleted after use. A fetch needs ``apt-get`` and
``dpkg-deb`` and access to Debian's archive; if ``apt-get download`` fails, ``apt-get update`` is run once and the
download retried.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import lzma
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

from ._cache import AssetError, cache_dir, run_fetch

__all__ = [
    "AUSTEN_NOVELS",
    "austen_novel",
    "austen_text",
    "python_docs_text",
    "unserialize_r",
    "read_lazyload_db",
    "RVector",
    "RSymbol",
]

#: The janeaustenr object names, in publication order (the order of ``janeaustenr::austen_books()``).
AUSTEN_NOVELS: tuple[str, ...] = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)

AUSTEN_PACKAGE = "r-cran-janeaustenr"
PYTHON_DOCS_PACKAGE = "python3.11-doc"

# The shortest novel (Northanger Abbey) is about 430k characters; anything under this means a broken parse.
_MIN_NOVEL_CHARS = 100_000

_FETCH_HINT = (
    "Run `apt-get update` (as root) and check that Debian's package archive is reachable; "
    "the text comes from the Debian package {package}."
)


# ---------------------------------------------------------------------------------------------------------------------
# R unserialize (XDR format, versions 2 and 3), the subset the janeaustenr lazy-load database uses.
# Reference: R's src/main/serialize.c (ReadItem, InFormat, ReadLENGTH).
# ---------------------------------------------------------------------------------------------------------------------

# SEXP type codes.
_SYMSXP = 1
_LISTSXP = 2
_CHARSXP = 9
_LGLSXP = 10
_INTSXP = 13
_REALSXP = 14
_STRSXP = 16
_VECSXP = 19
# Pseudo-types that exist only in the serialized stream.
_REFSXP = 255
_NILVALUE_SXP = 254

# Flags word: bits 0-7 type, bit 8 is-object (redundant with a "class" attribute, so unused here), bit 9
# has-attributes, bit 10 has-tag, bits 12-27 "levels" (for CHARSXP, the encoding marks below).
_HAS_ATTR_BIT = 1 << 9
_HAS_TAG_BIT = 1 << 10
_LATIN1_MASK = 1 << 2  # CHARSXP levels bit: string is marked latin1
_BYTES_MASK = 1 << 1  # CHARSXP levels bit: raw bytes, no declared encoding
_UTF8_MASK = 1 << 3  # CHARSXP levels bit: string is marked UTF-8
_ASCII_MASK = 1 << 6  # CHARSXP levels bit: string is pure ASCII

_NA_INTEGER = -(2**31)  # R's NA for integers and logicals


class RSymbol(str):
    """An R symbol (a name such as ``names``), kept distinct from a character string."""


class RVector(list):
    """An R vector (or pairlist) as a Python list, plus its SEXP type code and R attributes (``names``, ...).

    Elements are ``str | None`` for character vectors (``None`` is ``NA``), ``int | None`` for integers,
    ``bool | None`` for logicals, ``float`` for doubles (NA is a NaN) and any unserialized value for lists.
    """

    def __init__(self, items: list[Any], sexp_type: int, attributes: dict[str, Any] | None = None) -> None:
        super().__init__(items)
        self.sexp_type = sexp_type
        self.attributes: dict[str, Any] = attributes if attributes is not None else {}

    @property
    def names(self) -> list[str | None] | None:
        names = self.attributes.get("names")
        return list(names) if names is not None else None

    def as_dict(self) -> dict[str, Any]:
        """Elements keyed by their names (R's ``x[["name"]]``); raises ValueError when the vector has no names."""
        names = self.names
        if names is None:
            raise ValueError("R vector has no names attribute")
        return dict(zip(names, self))


class _XdrReader:
    """Reads one serialized R object; holds the cursor and the reference table (symbols, referenced by index)."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.references: list[Any] = []
        self.native_encoding = "utf-8"  # for strings without an encoding mark; version 3 streams name it

    def _take(self, size: int) -> memoryview:
        if self.pos + size > len(self.data):
            available = len(self.data) - self.pos
            raise ValueError(f"truncated R serialization: need {size} bytes at offset {self.pos}, have {available}")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def int32(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        # Vectors longer than 2^31-1 store -1 and then the length as two 32-bit halves.
        length = self.int32()
        if length == -1:
            upper, lower = struct.unpack(">II", self._take(8))
            return (upper << 32) | lower
        if length < 0:
            raise ValueError(f"invalid R vector length {length} at offset {self.pos - 4}")
        return length

    def header(self) -> None:
        magic = bytes(self._take(2))
        if magic != b"X\n":
            raise ValueError(f"not an XDR R serialization (starts with {magic!r}; only format 'X' is supported)")
        version = self.int32()
        self.int32()  # R version that wrote the data
        self.int32()  # minimal R version needed to read it
        if version == 3:
            # Version 3 records the writer's native encoding, which unmarked strings are in.
            encoding = bytes(self._take(self.int32())).decode("ascii", errors="replace")
            try:
                self.native_encoding = codecs.lookup(encoding).name
            except LookupError:
                pass  # an encoding Python does not know: assume UTF-8, as for version 2

        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version} (2 and 3 are supported)")

    def item(self) -> Any:
        flags = self.int32()
        sexp_type = flags & 0xFF
        has_attr = bool(flags & _HAS_ATTR_BIT)
        has_tag = bool(flags & _HAS_TAG_BIT)

        if sexp_type == _NILVALUE_SXP:
            return None
        if sexp_type == _REFSXP:
            # The 1-based index sits in the upper 24 bits, or in the next int when it does not fit there.
            index = flags >> 8 or self.int32()
            return self.references[index - 1]
        if sexp_type == _SYMSXP:
            symbol = RSymbol(self.item())  # the print name, a CHARSXP
            self.references.append(symbol)
            return symbol
        if sexp_type == _LISTSXP:
            return self._pairlist(flags)
        if sexp_type == _CHARSXP:
            return self._charsxp(flags)

        if sexp_type == _STRSXP:
            items: list[Any] = [self.item() for _ in range(self.length())]
        elif sexp_type == _VECSXP:
            items = [self.item() for _ in range(self.length())]
        elif sexp_type == _INTSXP:
            items = [None if v == _NA_INTEGER else v for v in self._ints(self.length())]
        elif sexp_type == _LGLSXP:
            items = [None if v == _NA_INTEGER else bool(v) for v in self._ints(self.length())]
        elif sexp_type == _REALSXP:
            count = self.length()
            items = list(struct.unpack(f">{count}d", self._take(8 * count)))
        else:
            raise ValueError(f"unsupported R SEXP type {sexp_type} (flags {flags:#x}) at offset {self.pos - 4}")

        vector = RVector(items, sexp_type)
        if has_attr:
            vector.attributes = self._attributes(self.item())
        return vector

    def _ints(self, count: int) -> tuple[int, ...]:
        return struct.unpack(f">{count}i", self._take(4 * count))

    def _charsxp(self, flags: int) -> str | None:
        size = self.int32()
        if size == -1:
            return None  # NA_STRING
        raw = bytes(self._take(size))
        levels = flags >> 12
        if levels & _LATIN1_MASK:
            return raw.decode("latin-1")
        if levels & _BYTES_MASK:
            return raw.decode("utf-8", errors="replace")  # no declared encoding at all: keep what can be kept
        if levels & (_UTF8_MASK | _ASCII_MASK):
            return raw.decode("utf-8")
        return raw.decode(self.native_encoding)

    def _pairlist(self, flags: int) -> RVector:
        # A pairlist is a chain of cells (attributes?, tag?, CAR, CDR); walk the CDR chain in a loop rather than
        # recursing, so long pairlists cannot exhaust Python's stack. Tags become the names.
        values: list[Any] = []
        tags: list[str | None] = []
        attributes: dict[str, Any] = {}
        while True:
            if flags & _HAS_ATTR_BIT:
                cell_attributes = self._attributes(self.item())
                if not values:
                    attributes = cell_attributes  # only the head cell's attributes are the pairlist's
            tags.append(self.item() if flags & _HAS_TAG_BIT else None)
            values.append(self.item())
            flags = self.int32()
            if flags & 0xFF != _LISTSXP:
                self.pos -= 4  # the CDR is not another cell: read it as an ordinary item
                tail = self.item()
                if tail is not None:
                    raise ValueError("dotted pairlist (CDR neither a cell nor NULL) is not supported")
                break
        result = RVector(values, _LISTSXP, attributes)
        if any(tag is not None for tag in tags):
            result.attributes.setdefault("names", RVector(["" if t is None else str(t) for t in tags], _STRSXP))
        return result

    @staticmethod
    def _attributes(pairlist: Any) -> dict[str, Any]:
        if not isinstance(pairlist, RVector) or pairlist.sexp_type != _LISTSXP or pairlist.names is None:
            raise ValueError("R attributes are not a tagged pairlist")
        return dict(zip(pairlist.names, pairlist))


def unserialize_r(data: bytes) -> Any:
    """Decode one object written by R's ``serialize()`` in XDR format (versions 2 and 3), uncompressed.

    Supported: NULL, symbols and back-references to them, pairlists (returned as an :class:`RVector` whose tags
    are its names), and character, integer, logical, double and list vectors with their attributes. Vectors come
    back as :class:`RVector`. Raises ValueError for anything else, or for trailing bytes.
    """
    reader = _XdrReader(data)
    reader.header()
    value = reader.item()
    if reader.pos != len(reader.data):
        raise ValueError(f"{len(reader.data) - reader.pos} trailing bytes after the R object")
    return value


def _decompress_lazyload_entry(entry: bytes, compression: int) -> bytes:
    """Undo the compression of one ``.rdb`` entry, as the index's ``compressed`` field says it was done.

    0: stored as is. Otherwise a 4-byte big-endian uncompressed length comes first; then for 1 (R's default,
    compress=TRUE) a bare zlib stream, and for 2 (bzip2) or 3 (xz) a method byte followed by the stream, as R's
    R_decompress2 / R_decompress3 read it: '2' bzip2, '1' zlib, '0' stored, and for 3 also 'Z', a raw LZMA2 stream
    (no .xz container; R's filter is LZMA2 at preset 6, read here with a 64 MiB dictionary, which covers every
    preset).
    """
    if compression == 0:
        return entry
    expected = struct.unpack(">I", entry[:4])[0]
    if compression == 1:
        data = zlib.decompress(entry[4:])
    elif compression in (2, 3):
        method, payload = entry[4:5], entry[5:]
        decompressors = {b"2": bz2.decompress, b"1": zlib.decompress, b"0": bytes}
        if compression == 3:
            decompressors[b"Z"] = _raw_lzma2_decompress
        if method not in decompressors:
            raise ValueError(f"unknown lazy-load compression method byte {method!r} for compression setting "
                             f"{compression}")
        data = decompressors[method](payload)
    else:
        raise ValueError(f"unknown lazy-load compression setting {compression}")
    if len(data) != expected:
        raise ValueError(f"lazy-load entry decompressed to {len(data)} bytes, its header says {expected}")
    return data


def _raw_lzma2_decompress(payload: bytes) -> bytes:
    return lzma.decompress(payload, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 26}])


def read_lazyload_db(rdx_path: Path) -> dict[str, Any]:
    """Every variable in an R lazy-load database (``<name>.rdx`` index + ``<name>.rdb`` data), unserialized.

    The ``.rdx`` is a gzip file holding a serialized list: ``variables`` maps each name to an (offset, length)
    pair into the ``.rdb``, ``compressed`` says how the entries were compressed.
    """
    index = unserialize_r(gzip.decompress(rdx_path.read_bytes())).as_dict()
    compressed = index["compressed"][0]
    compression = int(compressed) if compressed is not None else 1
    rdb = rdx_path.with_suffix(".rdb").read_bytes()
    variables = {}
    for name, (offset, length) in index["variables"].as_dict().items():
        variables[name] = unserialize_r(_decompress_lazyload_entry(rdb[offset : offset + length], compression))
    return variables


# ---------------------------------------------------------------------------------------------------------------------
# Fetching and caching.
# ---------------------------------------------------------------------------------------------------------------------


def _download_and_unpack(package: str, workdir: Path) -> Path:
    """``apt-get download`` the package into ``workdir`` and unpack it there; returns the unpacked root."""
    hint = _FETCH_HINT.format(package=package)
    download = ["apt-get", "download", package]
    try:
        run_fetch(download, f"Debian package {package}", hint, cwd=workdir)
    except AssetError:
        # Usually a fresh system whose package lists were never downloaded ("Unable to locate package"):
        # refresh them once and retry. If the retry fails too, its error is the one worth reporting.
        run_fetch(["apt-get", "update"], "Debian package lists", hint)
        run_fetch(download, f"Debian package {package}", hint, cwd=workdir)
    debs = sorted(workdir.glob(f"{package}_*.deb"))
    if len(debs) != 1:
        raise AssetError(f"expected one {package}_*.deb after `apt-get download`, found {len(debs)}. {hint}")
    root = workdir / "unpacked"
    run_fetch(["dpkg-deb", "-x", str(debs[0]), str(root)], f"Debian package {package} (unpacking)", hint)
    return root


def _find_one(root: Path, pattern: str, package: str) -> Path:
    # Resolve before counting: packages ship compatibility symlinks (python3.11-doc has
    # usr/share/doc/python3.11-doc/html -> ../python3.11/html), which would otherwise match twice.
    matches = sorted({path.resolve() for path in root.glob(pattern)})
    if len(matches) != 1:
        raise AssetError(f"expected one {pattern} in Debian package {package}, found {len(matches)}; "
                         "the package layout changed, so kvpress_cpp.texts needs updating.")
    return matches[0]


def _novel_path(name: str) -> Path:
    return cache_dir("texts", "austen") / f"{name}.txt"


def _parse_novels(rdx_path: Path) -> dict[str, str]:
    """The six novels from the janeaustenr lazy-load database, verified by structure."""
    try:
        variables = read_lazyload_db(rdx_path)
    # What a damaged download raises on the way: a truncated gzip index (EOFError), a short database read as a
    # header (struct.error), a damaged compressed object, an index of another shape (KeyError, TypeError).
    except (ValueError, zlib.error, lzma.LZMAError, OSError, EOFError, struct.error, KeyError, TypeError,
            IndexError) as exc:
        raise AssetError(f"could not parse the janeaustenr data in {AUSTEN_PACKAGE}: "
                         f"{type(exc).__name__}: {exc}") from exc
    novels = {}
    for name in AUSTEN_NOVELS:
        lines = variables.get(name)
        if not isinstance(lines, RVector) or lines.sexp_type != _STRSXP:
            raise AssetError(f"janeaustenr object {name!r} is missing or not a character vector")
        if any(line is None for line in lines):
            raise AssetError(f"janeaustenr object {name!r} contains NA lines")
        text = "\n".join(lines)
        if len(text) < _MIN_NOVEL_CHARS:
            raise AssetError(f"janeaustenr object {name!r} has only {len(text)} characters; the parse is broken")
        novels[name] = text
    return novels


def _ensure_austen_cached() -> None:
    if all(_novel_path(name).is_file() for name in AUSTEN_NOVELS):
        return
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=cache_dir("texts")) as tmp:
        root = _download_and_unpack(AUSTEN_PACKAGE, Path(tmp))
        novels = _parse_novels(_find_one(root, "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx", AUSTEN_PACKAGE))
    for name, text in novels.items():
        # Write-then-rename (to a per-process name, in case two processes fetch at once), so a reader never sees
        # half a file and an interrupted run just fetches again.
        partial = _novel_path(name).with_suffix(f".txt.{os.getpid()}.partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(_novel_path(name))


def austen_novel(name: str) -> str:
    """One Jane Austen novel as a single string, its lines joined with ``"\\n"``. ``name`` is one of AUSTEN_NOVELS."""
    if name not in AUSTEN_NOVELS:
        raise ValueError(f"unknown novel {name!r}; valid names are: {', '.join(AUSTEN_NOVELS)}")
    _ensure_austen_cached()
    return _novel_path(name).read_text(encoding="utf-8")


def austen_text() -> str:
    """All six novels in AUSTEN_NOVELS order, separated by a blank line."""
    return "\n\n".join(austen_novel(name) for name in AUSTEN_NOVELS)


def _python_docs_dir() -> Path:
    target = cache_dir("texts") / "python-docs"
    if target.is_dir():
        return target
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=cache_dir("texts")) as tmp:
        root = _download_and_unpack(PYTHON_DOCS_PACKAGE, Path(tmp))
        sources = _find_one(root, "usr/share/doc/python3.*/html/_sources", PYTHON_DOCS_PACKAGE)
        if not any(sources.rglob("*.rst.txt")):
            raise AssetError(f"no *.rst.txt files under {sources} in {PYTHON_DOCS_PACKAGE}")
        # Move the finished tree into place in one rename, so a half-copied tree is never taken for the cache.
        try:
            sources.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent fetch that got there first
                raise
    return target


def python_docs_text(max_files: int | None = None) -> str:
    """The Python 3.11 documentation's reST sources, concatenated in sorted path order (blank line between files).

    ``max_files`` keeps only the first that many files of that order (None: all of them, about 11 MB of text).
    """
    if max_files is not None and max_files < 0:
        raise ValueError(f"max_files must be >= 0 or None, got {max_files}")
    root = _python_docs_dir()
    paths = sorted(root.rglob("*.rst.txt"), key=lambda p: p.relative_to(root).as_posix())
    if max_files is not None:
        paths = paths[:max_files]
    return "\n\n".join(path.read_text(encoding="utf-8") for path in paths)
