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
