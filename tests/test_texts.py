"""Tests for kvpress_cpp.texts: the R unserializer on hand-built bytes, and the real corpora (these fetch once)."""

from __future__ import annotations

import bz2
import gzip
import lzma
import math
import re
import struct
import zlib
from pathlib import Path

import pytest

from kvpress_cpp import texts

# ---------------------------------------------------------------------------------------------------------------------
# Hand-built R serializations (XDR), following R's src/main/serialize.c, so the parser is tested on its own.
# ---------------------------------------------------------------------------------------------------------------------

NILVALUE = 254
REFSXP = 255
SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 1, 2, 9, 10, 13, 14, 16, 19
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
ASCII_LEVEL, UTF8_LEVEL, LATIN1_LEVEL = 1 << 6, 1 << 3, 1 << 2  # CHARSXP encoding marks, stored at bit 12 up
NA_INTEGER = -(2**31)


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header(version: int) -> bytes:
    # "X\n", format version, writer's R version (4.2.1), minimal reader version (3.5.0 for v3, 2.3.0 for v2).
    if version == 3:
        return b"X\n" + i32(3, 0x040201, 0x030500) + i32(5) + b"UTF-8"
    return b"X\n" + i32(2, 0x040201, 0x020300)


def charsxp(value: str | None, level: int = ASCII_LEVEL) -> bytes:
    if value is None:
        return i32(CHARSXP, -1)  # NA_STRING: length -1, no bytes
    encoded = value.encode("latin-1" if level == LATIN1_LEVEL else "utf-8")
    return i32(CHARSXP | level << 12, len(encoded)) + encoded


def strsxp(values: list[str | None], attributes: bytes = b"") -> bytes:
    flags = STRSXP | (HAS_ATTR if attributes else 0)
    return i32(flags, len(values)) + b"".join(charsxp(v) for v in values) + attributes


def symbol(name: str) -> bytes:
    return i32(SYMSXP) + charsxp(name)


def names_attribute(names: list[str], names_symbol: bytes) -> bytes:
    # Attributes are a tagged pairlist: one cell (tag `names`, value a STRSXP), then NILVALUE ending the chain.
    return i32(LISTSXP | HAS_TAG) + names_symbol + strsxp(names) + i32(NILVALUE)


@pytest.mark.parametrize("version", [2, 3])
def test_unserialize_character_vector_with_na(version: int) -> None:
    value = texts.unserialize_r(header(version) + strsxp(["It is a truth", None]))
    assert isinstance(value, texts.RVector)
    assert list(value) == ["It is a truth", None]
    assert value.attributes == {}


def test_unserialize_string_encodings() -> None:
    data = header(3) + i32(STRSXP, 3) + charsxp("£5", UTF8_LEVEL) + charsxp("café", LATIN1_LEVEL) + charsxp("")
    assert list(texts.unserialize_r(data)) == ["£5", "café", ""]
    # Unmarked strings are in the writer's native encoding, which a version 3 header names.
    latin1_header = b"X\n" + i32(3, 0x040201, 0x030500) + i32(10) + b"ISO-8859-1"
    unmarked = "café".encode("latin-1")
    assert list(texts.unserialize_r(latin1_header + i32(STRSXP, 1, CHARSXP, len(unmarked)) + unmarked)) == ["café"]


def test_unserialize_long_vector_length_form() -> None:
    # Lengths over 2^31-1 are written as -1 then two 32-bit halves; the reader must accept that form for any length.
    data = header(2) + i32(STRSXP, -1, 0, 2) + charsxp("first") + charsxp("second")
    assert list(texts.unserialize_r(data)) == ["first", "second"]
    # The halves are (upper, lower): 2^32 and 2^32 + 3 integers ask for 4 bytes each (and are not there).
    with pytest.raises(ValueError, match=f"need {4 * 2**32} bytes"):
        texts.unserialize_r(header(2) + i32(INTSXP, -1, 1, 0))
    with pytest.raises(ValueError, match=f"need {4 * (2**32 + 3)} bytes"):
        texts.unserialize_r(header(2) + i32(INTSXP, -1, 1, 3))


def test_unserialize_named_list_with_symbol_reference() -> None:
    # list(lines = c("a", NA), counts = c(7L, NA), flags = c(TRUE, NA, FALSE), real = c(0.5, NA),
    #      inner = list(x = NULL)). A vector's attributes follow its elements, so the `names` symbol is first
    # written in full for `inner`; the outer list's `names` tag is then a back-reference to it (reference index 1,
    # packed into the flags word), exactly as R writes repeated symbols.
    na_real = struct.pack(">Q", 0x7FF00000000007A2)  # R's NA_real_: a NaN with payload 1954
    inner = i32(VECSXP | HAS_ATTR, 1) + i32(NILVALUE) + names_attribute(["x"], symbol("names"))
    elements = (
        strsxp(["a", None])
        + i32(INTSXP, 2, 7, NA_INTEGER)
        + i32(LGLSXP, 3, 1, NA_INTEGER, 0)
        + i32(REALSXP, 2) + struct.pack(">d", 0.5) + na_real
        + inner
    )
    data = header(3) + i32(VECSXP | HAS_ATTR, 5) + elements + names_attribute(
        ["lines", "counts", "flags", "real", "inner"], i32(REFSXP | 1 << 8)
    )

    value = texts.unserialize_r(data).as_dict()

    assert list(value) == ["lines", "counts", "flags", "real", "inner"]
    assert value["lines"] == ["a", None]
    assert value["counts"] == [7, None]
    assert value["flags"] == [True, None, False]
    assert value["real"][0] == 0.5 and math.isnan(value["real"][1])
    assert value["inner"].as_dict() == {"x": None}
    assert isinstance(value["inner"].attributes, dict) and list(value["inner"].attributes) == ["names"]


def test_unserialize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="XDR"):
        texts.unserialize_r(b"A\n" + i32(2, 0, 0))
    with pytest.raises(ValueError, match="truncated"):
        texts.unserialize_r(header(2) + strsxp(["abc"])[:-1])
    with pytest.raises(ValueError, match="unsupported R SEXP type"):
        texts.unserialize_r(header(2) + i32(3))  # a CLOSXP (function): not needed, not supported
    with pytest.raises(ValueError, match="trailing"):
        texts.unserialize_r(header(2) + i32(NILVALUE) + b"\0")


def _write_lazyload_db(directory: Path, objects: dict[str, bytes], compressed_flag: bytes) -> Path:
    """Rdata.rdx + Rdata.rdb holding the already compressed `objects` (name → entry bytes), as R's makeLazyLoadDB:
    the index is list(variables = list(<name> = c(offset, length), ...), references = list(), compressed)."""
    rdb = b"".join(objects.values())
    offsets = [sum(len(b) for b in list(objects.values())[:k]) for k in range(len(objects))]
    variables = i32(VECSXP | HAS_ATTR, len(objects))
    variables += b"".join(i32(INTSXP, 2, offset, len(blob)) for offset, blob in zip(offsets, objects.values()))
    variables += names_attribute(list(objects), symbol("names"))
    index_names = names_attribute(["variables", "references", "compressed"], i32(REFSXP | 1 << 8))
    index = header(3) + i32(VECSXP | HAS_ATTR, 3) + variables + i32(VECSXP, 0) + compressed_flag + index_names
    (directory / "Rdata.rdx").write_bytes(gzip.compress(index))
    (directory / "Rdata.rdb").write_bytes(rdb)
    return directory / "Rdata.rdx"


def _entry(method: bytes, payload: bytes, raw: bytes) -> bytes:
    """One .rdb entry as R's R_compress1/2/3 write it: the uncompressed length (4 bytes, big-endian), the method byte
    (none for setting 1), then the stream."""
    return struct.pack(">I", len(raw)) + method + payload


# R's LZMA2 filter for lazy-load data (connections.c, init_filters: preset 6), with no .xz container around it.
R_LZMA2_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]


@pytest.mark.parametrize(
    ("compressed_flag", "compress"),
    [
        (i32(LGLSXP, 1, 1), lambda raw: _entry(b"", zlib.compress(raw), raw)),  # compress = TRUE, R's default
        (i32(LGLSXP, 1, NA_INTEGER), lambda raw: _entry(b"", zlib.compress(raw), raw)),  # NA reads as TRUE
        (i32(LGLSXP, 1, 0), lambda raw: raw),  # compress = FALSE: no header either
        (i32(INTSXP, 1, 2), lambda raw: _entry(b"2", bz2.compress(raw), raw)),  # R_compress2
        (i32(INTSXP, 1, 2), lambda raw: _entry(b"0", raw, raw)),  # R_compress2 where bzip2 did not shrink it
        (i32(INTSXP, 1, 2), lambda raw: _entry(b"1", zlib.compress(raw), raw)),  # read by R_decompress2 too
        (i32(INTSXP, 1, 3), lambda raw: _entry(b"Z", lzma.compress(raw, lzma.FORMAT_RAW, filters=R_LZMA2_FILTERS),
                                               raw)),  # R_compress3: raw LZMA2 ('xz' in LazyDataCompression)
        (i32(INTSXP, 1, 3), lambda raw: _entry(b"0", raw, raw)),  # R_compress3 where LZMA2 did not shrink it
    ],
    ids=["zlib", "na-means-zlib", "uncompressed", "bzip2", "bzip2-setting-stored", "bzip2-setting-zlib", "xz",
         "xz-setting-stored"],
)
def test_read_lazyload_db(tmp_path: Path, compressed_flag: bytes, compress) -> None:
    objects = {"first": compress(header(3) + strsxp(["one", "two"])), "second": compress(header(2) + strsxp([None]))}
    rdx = _write_lazyload_db(tmp_path, objects, compressed_flag)
    assert texts.read_lazyload_db(rdx) == {"first": ["one", "two"], "second": [None]}


@pytest.mark.parametrize("damage", ["index cut in half", "empty database", "database cut to 3 bytes"])
def test_a_damaged_lazyload_db_is_an_asset_error(tmp_path: Path, damage: str) -> None:
    """A damaged download gets the error that says which package to fetch again, not a bare EOFError or
    struct.error from the parser."""
    test_read_lazyload_db(tmp_path, i32(LGLSXP, 1, 1), lambda raw: _entry(b"", zlib.compress(raw), raw))
    rdx, rdb = tmp_path / "Rdata.rdx", tmp_path / "Rdata.rdb"
    if damage == "index cut in half":
        rdx.write_bytes(rdx.read_bytes()[: len(rdx.read_bytes()) // 2])
    else:
        rdb.write_bytes(rdb.read_bytes()[: 0 if damage == "empty database" else 3])
    with pytest.raises(texts.AssetError, match="could not parse the janeaustenr data"):
        texts._parse_novels(rdx)


# ---------------------------------------------------------------------------------------------------------------------
# The real corpora. The first run fetches the Debian packages (needs apt-get and Debian's archive); later runs read
# the cache. Expected passages are the novels' well-known opening lines, not values taken from the parser.
# ---------------------------------------------------------------------------------------------------------------------


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text)


KNOWN_PASSAGES = {
    "sensesensibility": "The family of Dashwood had long been settled in Sussex.",
    "prideprejudice": "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.",
    "mansfieldpark": "About thirty years ago Miss Maria Ward, of Huntingdon, with only seven thousand pounds",
    "emma": "Emma Woodhouse, handsome, clever, and rich",
    "northangerabbey": "No one who had ever seen Catherine Morland in her infancy would have supposed her born to be "
    "an heroine.",
    "persuasion": "Sir Walter Elliot",
}


def test_austen_novels_are_the_six() -> None:
    assert set(texts.AUSTEN_NOVELS) == set(KNOWN_PASSAGES)
    assert len(texts.AUSTEN_NOVELS) == 6


@pytest.mark.parametrize("name", sorted(KNOWN_PASSAGES))
def test_austen_novel(name: str) -> None:
    text = texts.austen_novel(name)
    assert len(text) > 100_000
    assert KNOWN_PASSAGES[name] in normalise(text)
    lines = text.split("\n")
    assert "NA" not in lines and "None" not in lines  # an NA line would have leaked through as one of these
    assert "\ufffd" not in text  # no undecodable bytes


def test_unknown_novel_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="prideprejudice"):
        texts.austen_novel("ulysses")


def test_python_docs_text() -> None:
    full = texts.python_docs_text()
    assert "The Python Tutorial" in full
    assert "The Python Standard Library" in full
    assert len(full) > 1_000_000
    first_files = texts.python_docs_text(max_files=3)
    assert 0 < len(first_files) < len(full) and full.startswith(first_files)
    assert texts.python_docs_text(max_files=0) == ""


@pytest.mark.parametrize("context_tokens,depth,message", [
    (-5, 0.5, "context_tokens must be an integer >= 1, got -5"), (0, 0.5, "got 0"), (2.5, 0.5, "got 2.5"),
    (300, 2.0, r"depth must be in \[0, 1\] \(0 = start, 1 = end\), got 2.0"), (300, -1, "got -1")])
def test_a_hidden_fact_prompt_of_no_length_or_outside_the_text_is_refused(context_tokens, depth, message) -> None:
    """A negative length sliced from the end of the novel (the demo prefilled 168k tokens) and a depth outside [0, 1]
    put the fact at an end without a word."""
    from kvpress_cpp.tasks import hidden_fact_prompt
    from tests.models import make_tiny_llama

    with pytest.raises(ValueError, match=f"hidden_fact_prompt: .*{message}"):
        hidden_fact_prompt(make_tiny_llama()[1], context_tokens, depth)


@pytest.mark.parametrize("context_tokens,depth", [(300, 0.25), (300, 0.5), (600, 0.5), (1000, 0.75)])
def test_the_hidden_fact_stands_on_its_own_line_at_its_depth(context_tokens: int, depth: float) -> None:
    """The demo's and the quality tests' prompt: the fact once, between two line breaks (glued to the word before it,
    it would read as part of Austen's sentence), at the line break before `depth` of the context."""
    from kvpress_cpp.tasks import HiddenFact, hidden_fact_prompt
    from tests.models import make_tiny_llama

    _, tokenizer = make_tiny_llama()
    fact = HiddenFact()
    prompt = hidden_fact_prompt(tokenizer, context_tokens, depth, fact)
    assert prompt.count(fact.fact) == 1
    at = prompt.index(fact.fact)
    assert prompt[at - 1] == "\n" and prompt[at + len(fact.fact)] == "\n"
    context = prompt[:prompt.index("\n\nAnswer the question using the text above.")]
    start = context.index(texts.austen_novel("prideprejudice")[:20])
    fraction = (at - start) / (len(context) - start - len(fact.fact) - 1)
    assert depth - 0.1 <= fraction <= depth + 0.01, fraction


# ---------------------------------------------------------------------------------------------------------------------
# More of the format, on hand-built bytes (pairlist attributes, the raw-bytes encoding mark, a lazy-load entry's
# length check, the novels' parse), and how the texts are joined.
# ---------------------------------------------------------------------------------------------------------------------

BYTES_LEVEL = 1 << 1  # CHARSXP levels bit: raw bytes, no declared encoding


def test_unserialize_pairlist_attributes_are_the_head_cells() -> None:
    # pairlist(a = 1L, b = 2L) whose head cell carries attributes (foo = "head") and whose second cell carries others
    # (bar = "tail"): R's attributes of a pairlist are those of its head cell.
    foo = i32(LISTSXP | HAS_TAG) + symbol("foo") + strsxp(["head"]) + i32(NILVALUE)
    bar = i32(LISTSXP | HAS_TAG) + symbol("bar") + strsxp(["tail"]) + i32(NILVALUE)
    data = (header(2)
            + i32(LISTSXP | HAS_ATTR | HAS_TAG) + foo + symbol("a") + i32(INTSXP, 1, 1)
            + i32(LISTSXP | HAS_ATTR | HAS_TAG) + bar + symbol("b") + i32(INTSXP, 1, 2)
            + i32(NILVALUE))
    value = texts.unserialize_r(data)
    assert value == [[1], [2]] and value.names == ["a", "b"]
    assert value.attributes["foo"] == ["head"] and "bar" not in value.attributes


def test_unserialize_bytes_marked_string_is_read_as_utf8() -> None:
    # A string marked as raw bytes (no declared encoding) keeps its UTF-8 text; bytes that are not UTF-8 are replaced.
    encoded = "£5 café".encode("utf-8")
    data = header(3) + i32(STRSXP, 2, CHARSXP | BYTES_LEVEL << 12, len(encoded)) + encoded
    data += i32(CHARSXP | BYTES_LEVEL << 12, 2) + b"a\xff"
    assert list(texts.unserialize_r(data)) == ["£5 café", "a\ufffd"]


def test_lazyload_entry_whose_length_header_disagrees_is_refused(tmp_path: Path) -> None:
    raw = header(3) + strsxp(["one", "two"])
    objects = {"first": _entry(b"", zlib.compress(raw), raw + b"\0")}  # a header one byte longer than the data
    rdx = _write_lazyload_db(tmp_path, objects, i32(LGLSXP, 1, 1))
    with pytest.raises(ValueError, match=f"decompressed to {len(raw)} bytes, its header says {len(raw) + 1}"):
        texts.read_lazyload_db(rdx)


def _fake_novels() -> dict[str, list[str]]:
    # Six "novels" of over 100k characters each, with empty lines as Gutenberg texts have between paragraphs.
    return {name: [f"Line {i} of {name}, which is long enough." if i % 5 else "" for i in range(3500)]
            for name in texts.AUSTEN_NOVELS}


def test_parse_novels_joins_each_novels_lines(tmp_path: Path) -> None:
    novels = _fake_novels()
    pack = lambda raw: _entry(b"", zlib.compress(raw), raw)  # noqa: E731
    objects = {name: pack(header(3) + strsxp(lines)) for name, lines in novels.items()}
    objects["other"] = pack(header(3) + strsxp(["not a novel"]))
    parsed = texts._parse_novels(_write_lazyload_db(tmp_path, objects, i32(LGLSXP, 1, 1)))
    assert list(parsed) == list(texts.AUSTEN_NOVELS)
    for name, lines in novels.items():
        assert parsed[name] == "\n".join(lines)
    # A novel with an NA line is a broken parse, not text with "None" in it.
    novels["emma"][7] = None
    objects["emma"] = pack(header(3) + strsxp(novels["emma"]))
    with pytest.raises(texts.AssetError, match="'emma' contains NA lines"):
        texts._parse_novels(_write_lazyload_db(tmp_path, objects, i32(LGLSXP, 1, 1)))


def test_austen_text_is_the_novels_in_order_each_after_a_blank_line() -> None:
    text = texts.austen_text()
    novels = [texts.austen_novel(name) for name in texts.AUSTEN_NOVELS]
    assert len(text) == sum(len(n) for n in novels) + 2 * (len(novels) - 1)
    at = 0
    for novel in novels:
        assert text[at : at + len(novel)] == novel
        at += len(novel)
        if at < len(text):
            assert text[at : at + 2] == "\n\n"
            at += 2


def test_python_docs_text_is_the_files_in_path_order_with_a_blank_line_between() -> None:
    root = texts._python_docs_dir()
    files = sorted(str(p.relative_to(root)).replace("\\", "/") for p in root.rglob("*.rst.txt"))[:3]
    expected = "\n\n".join((root / f).read_text(encoding="utf-8") for f in files)
    assert texts.python_docs_text(max_files=3) == expected
