from specd.engine.detokenizer import Detokenizer


def _decode(ids):
    return "".join(chr(i) for i in ids)


def feed(detok, text):
    return "".join(detok.add(ord(c)) for c in text)


def test_plain_text_streams_in_full():
    d = Detokenizer(_decode)
    assert feed(d, "hello") == "hello"
    assert d.finish() == ""


def test_stop_string_never_reaches_the_client():
    d = Detokenizer(_decode, ["STOP"])
    out = feed(d, "abcST")
    assert "S" not in out            # held back: could be the start of STOP
    out += feed(d, "OPxyz")
    assert d.stopped
    assert out == "abc"


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    d = Detokenizer(_decode, ["STOP"])
    out = feed(d, "ST") + feed(d, "x")
    assert out == "" or not out.endswith("STOP")
    out += d.finish()
    assert out == "STx"


def test_incomplete_utf8_waits():
    d = Detokenizer(lambda ids: "ab\ufffd" if len(ids) == 1 else "abé")
    assert d.add(1) == "ab"
    assert d.add(2) == "é"


# -- the window against the whole decode, on real tokenizers ------------------------------------------

import os  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from specd.loader.gguf import gguf_tokenizer  # noqa: E402
from specd.loader.gguf_file import GGUFFile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT / "models" / "stories260K.gguf"
QWEN = Path(os.environ.get("SPECD_QWEN_GGUF", "") or "/nonexistent")   # as tests/models/test_tokenizer.py


def streams(tok, rng: random.Random, count: int) -> list[list[int]]:
    """Answers the engine could emit: encoded text (multi-byte characters, spaces, newlines) and
    random ids (byte tokens, half characters, anything)."""
    texts = ["naïve 日本 ok", "Once upon a time, there was a dog.\n\nThe end.", "  x\r\n\ty é€😀",
             "def add(a, b):\n    return a + b\n"]
    out = [tok.encode(t, add_bos=False) for t in texts]
    for _ in range(count):
        out.append([rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 120))])
    return out


@pytest.mark.parametrize("path", [STORIES, QWEN], ids=["stories260K", "qwen2.5"])
def test_the_window_gives_the_whole_decodes_deltas(path):
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine")
    tok = gguf_tokenizer(GGUFFile(path))
    rng = random.Random(0)
    for ids in streams(tok, rng, 60):
        for stops in ((), ("\n\n",), ("the", "日")):
            fast, ref = Detokenizer(tok.decode, stops), Detokenizer(tok.decode, stops, incremental=False)
            for i in ids:
                assert fast.add(i) == ref.add(i), (ids, stops)
                if ref.stopped:
                    break
            assert fast.stopped == ref.stopped and fast.finish() == ref.finish()
            assert fast.text == ref.text
