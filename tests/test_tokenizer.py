"""The byte-level BPE: exact round trips, lines as token boundaries, special tokens, loading and its errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from seqjax.store.corpus import read_text
from seqjax.store.lines import split_lines
from seqjax.store.tokenizer import Tokenizer, TokenizerError, train_tokenizer

EOT = "<|endoftext|>"
SAMPLE = [
    " = Title = \n",
    " \n",
    " the quick brown fox jumps over the lazy dog . \n",
    "  indented   spaces\tand tabs\n",
    "naïve café, 東京 and emoji 🙂 <unk> again <unk>\n",
] * 20


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_tokenizer(SAMPLE, path, vocab_size=300, special_tokens=[EOT, "<unk>"], min_frequency=1)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_on_random_unicode(small, text):
    assert small.decode(small.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1))
def test_a_generation_cut_inside_a_character_decodes_without_its_part(small, text):
    """Byte-level tokens can end inside a UTF-8 character (where generate stopped); decode_whole gives the text of
    the whole characters before it, never U+FFFD (what the README's sample printed)."""
    assume("\ufffd" not in text)
    ids = small.encode(text)
    for end in range(1, len(ids) + 1):
        whole = small.decode_whole(ids[:end])
        assert "\ufffd" not in whole and text.startswith(whole)
        assert len(whole) >= len(small.decode(ids[:end]).rstrip("\ufffd")) - 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(), max_size=6).map("\n".join))
def test_lines_are_token_boundaries_also_for_a_plain_hf_load(small, text):
    ids = small.encode(text)
    per_line = [i for line in split_lines(text) for i in small.encode(line)]
    assert ids == per_line
    assert HFTokenizer.from_file(str(small.path)).encode(text, add_special_tokens=False).ids == ids


def test_special_tokens_come_first_and_unk_stays_one_token(small):
    assert small.eot_id == 0
    unk = small.token_id("<unk>")
    assert unk == 1
    ids = small.encode("a <unk> b<unk>c\n")
    assert ids.count(unk) == 2
    assert small.decode(ids) == "a <unk> b<unk>c\n"
    # no merge was spent on the pieces of "<unk>": the trainer never saw them
    vocab = HFTokenizer.from_file(str(small.path)).get_vocab()
    assert not any("unk" in token for token in vocab if token != "<unk>")


def test_vocab_must_hold_the_bytes_and_the_special_tokens(tmp_path):
    with pytest.raises(
        TokenizerError, match=r"tokenizer.vocab_size: got 257, expected at least 258 \(256 byte tokens \+ 2 special"
    ):
        train_tokenizer(SAMPLE, tmp_path / "t.json", vocab_size=257, special_tokens=[EOT, "<unk>"])
    assert not (tmp_path / "t.json").exists()


def test_loading_checks_the_file_and_the_end_of_text_token(small, tmp_path):
    again = Tokenizer(small.path, EOT)
    assert (again.hash, again.vocab_size, again.eot_id) == (small.hash, small.vocab_size, small.eot_id)
    with pytest.raises(TokenizerError, match="tokenizer.path: .*missing.json' not found"):
        Tokenizer(tmp_path / "missing.json", EOT)
    with pytest.raises(TokenizerError, match="has no token '<eos>'"):
        Tokenizer(small.path, "<eos>")
    broken = tmp_path / "broken.json"
    broken.write_text("{]")
    with pytest.raises(TokenizerError, match="broken.json' is not a valid tokenizer.json"):
        Tokenizer(broken, EOT)


def test_hash_identifies_the_file(small, tmp_path):
    data = json.loads(small.path.read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    assert Tokenizer(changed, EOT).hash != small.hash


@pytest.mark.slow  # (WikiText-2 end to end: the fast loop leaves the real corpus to the full suite)
def test_round_trip_on_the_raw_wikitext_files(wikitext_prepared, wikitext):
    tokenizer = wikitext_prepared.tokenizer
    files = sorted((wikitext / "wikitext-2-raw").glob("wiki.*.raw"))
    assert files
    for path in files:
        text = read_text(path)
        assert tokenizer.decode(tokenizer.encode(text)) == text, path


@pytest.mark.slow  # (WikiText-2 end to end: the fast loop leaves the real corpus to the full suite)
def test_unk_is_one_token_in_the_word_level_store(wikitext_prepared, wikitext):
    tokenizer, store = wikitext_prepared.tokenizer, wikitext_prepared.stores["valid"]
    unk = tokenizer.token_id("<unk>")
    text = read_text(wikitext / "wikitext-2" / "wiki.valid.tokens")
    assert unk is not None and int((store.tokens == unk).sum()) == text.count("<unk>") > 0
