"""The demo's per-turn line says what speculation did: τ where it drafted, a plain statement where not."""
from bench.demo import speculation_note


def test_a_turn_that_drafted_reports_its_tau():
    # 4 verifications keeping 6 drafted tokens: (4 + 6) / 4 tokens a verification
    assert speculation_note("dspark", {"verifications": 4, "drafted_tokens": 28, "accepted_tokens": 6}) \
        == " | dspark tau 2.50"


def test_a_turn_without_a_drafting_step_says_so_instead_of_nothing():
    note = speculation_note("dspark", {"verifications": 0, "drafted_tokens": 0, "accepted_tokens": 0})
    assert note.startswith(" | dspark: no drafting step this turn") and "tau" not in note
    assert "no drafting step" in speculation_note("ngram", {})


def test_plain_decoding_adds_nothing():
    assert speculation_note("none", {"verifications": 0}) == ""


def test_the_readme_demo_serves_three_turns_and_the_later_ones_from_kvds_cache():
    """The README's first command, as a user runs it: real kvd and specd processes on stories260K with its
    committed drafter, three turns of one session through the client library. Turns 2 and 3 resend the
    conversation, so kvd must serve part of each prompt from its cache."""
    import re
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench", "demo"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    turns = re.findall(r"TTFT [\d.]+ ms \| prompt tokens (\d+) \| from cache (\d+) \| generated (\d+)", done.stdout)
    assert len(turns) == 3, done.stdout
    assert int(turns[0][1]) == 0 and all(int(cached) > 0 for _, cached, _ in turns[1:])
    assert all(0 < int(generated) <= 64 for _, _, generated in turns)
    assert re.search(r"specd: \d+ prompt tokens, [1-9]\d* served from kvd's cache", done.stdout)
