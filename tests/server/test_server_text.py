"""Text handling without a server: UTF-8 safe decoding, stop strings held back, the chat
template, settings from the environment and flags."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from hypothesis import given
from hypothesis import strategies as st

from nodraft.micro.checkpoint import load_tokenizer
from nodraft.server import chat
from nodraft.server.generation import TextStream
from nodraft.server.settings import Settings


class ByteTokens:
    """A stand-in tokenizer: token i is the single byte i."""

    def token_bytes(self, i: int) -> bytes:
        return bytes([i])


def stream_all(data: bytes, stops: list[str], cut: list[int]) -> tuple[str, bool]:
    """Feed ``data`` one byte-token at a time, releasing after each group in ``cut``."""
    ts, out, i = TextStream(ByteTokens(), stops), "", 0
    for n in cut + [len(data)]:
        ts.feed(list(data[i:i + n]))
        out += ts.release()
        i += n
        if ts.stopped:
            return out, True
    return out + ts.release(final=True), ts.stopped


def test_multibyte_character_split_across_tokens():
    ts = TextStream(ByteTokens(), [])
    e_acute = "é".encode()
    assert ts.feed([ord("a"), e_acute[0]]) == ["a", ""]
    assert ts.release() == "a"
    assert ts.feed([e_acute[1]]) == ["é"]
    assert ts.release() == "é"


def test_invalid_bytes_become_replacement_characters():
    ts = TextStream(ByteTokens(), [])
    ts.feed([0xFF, ord("x"), 0xE6])  # a stray byte, then a truncated 3-byte character
    assert ts.release() == "\ufffdx"
    assert ts.release(final=True) == "\ufffd"


def test_stop_string_held_back_then_released():
    ts = TextStream(ByteTokens(), ["END"])
    ts.feed(list(b"abcE"))
    assert ts.release() == "abc"  # "E" might start "END"
    ts.feed(list(b"N"))
    assert ts.release() == ""
    ts.feed(list(b"x"))
    assert ts.release() == "ENx"  # it did not
    ts.feed(list(b"yEND tail"))
    assert ts.release() == "y" and ts.stopped
    assert ts.release(final=True) == ""


@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=3), max_size=3),
       st.lists(st.integers(1, 5), max_size=20))
def test_streamed_text_is_the_text_before_the_first_stop(text, stops, cut):
    data = text.encode()
    out, stopped = stream_all(data, stops, cut)
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    assert out == (text[:min(hits)] if hits else text)
    assert stopped == bool(hits)


def test_tokens_are_taken_with_their_text_and_counted_to_the_stop():
    """A token is handed out once its text is released (held back with it); at a stop
    string the token it begins inside is cut there and counted, the tokens past it are
    neither handed out nor counted."""
    ts = TextStream(ByteTokens(), ["END"])
    ts.feed(list(b"abE"), ["a", "b", "c"])
    assert ts.release() == "ab"
    assert ts.take() == [(ord("a"), "a", "a"), (ord("b"), "b", "b")]  # "E" held back
    ts.feed(list(b"N"), ["d"])
    assert ts.release() == "" and ts.take() == []
    ts.feed(list(b"Dzz"), ["e", "f", "g"])
    assert ts.release() == "" and ts.stopped
    assert ts.take() == [] and ts.returned_tokens == 2  # "E", "N", "D", "z", "z" not returned


def test_token_straddling_the_stop_is_cut_and_counted():
    class Words:  # token i is the i-th word
        words = [b"ab", b"cEN", b"Dx", b"yy"]

        def token_bytes(self, i: int) -> bytes:
            return self.words[i]
    ts = TextStream(Words(), ["END"])
    ts.feed([0, 1, 2, 3], ["accepted", "accepted", "bonus", "bonus"])
    assert ts.release() == "abc" and ts.stopped
    assert ts.take() == [(0, "accepted", "ab"), (1, "accepted", "c")]
    assert ts.returned_tokens == 2


def test_partial_character_tokens():
    """A token that ends inside a character has text ""; with stop strings it waits for
    its character (a stop string may begin with it), without them it goes at once."""
    e_acute = "é".encode()
    for stops, first, second in (([], ["a", ""], ["é"]), (["zz"], ["a"], ["", "é"])):
        ts = TextStream(ByteTokens(), stops)
        ts.feed([ord("a"), e_acute[0]])
        assert ts.release() == "a"
        assert [text for _, _, text in ts.take()] == first
        ts.feed([e_acute[1]])
        assert ts.release() == "é"
        assert [text for _, _, text in ts.take()] == second
        ts.feed([0xE6])  # truncated at the end: the flushed U+FFFD belongs to its token
        assert ts.release(final=True) == "\ufffd"
        assert [text for _, _, text in ts.take()] == ["\ufffd"]
        assert ts.returned_tokens == 4
    ts = TextStream(ByteTokens(), ["é"])  # the stop begins in a token that completed nothing
    ts.feed([ord("a"), e_acute[0]])
    assert ts.release() == "a" and [text for _, _, text in ts.take()] == ["a"]
    ts.feed([e_acute[1], ord("b")])
    assert ts.release() == "" and ts.stopped and ts.take() == [] and ts.returned_tokens == 1


@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=3), max_size=3),
       st.lists(st.integers(1, 5), max_size=20))
def test_taken_tokens_spell_the_returned_text(text, stops, cut):
    """Whatever the cuts: the taken tokens' texts concatenate to the text returned, and
    there are exactly ``returned_tokens`` of them: the tokens that begin before the stop."""
    data = text.encode()
    ts, out, taken, i = TextStream(ByteTokens(), stops), "", [], 0
    for n in cut + [len(data)]:
        ts.feed(list(data[i:i + n]))
        out += ts.release()
        taken += ts.take()
        i += n
        if ts.stopped:
            break
    out += ts.release(final=True)
    taken += ts.take()
    assert "".join(t for _, _, t in taken) == out
    assert len(taken) == ts.returned_tokens
    if ts.stopped:  # the byte-tokens that begin before the stop string
        assert ts.returned_tokens == len(out.encode())


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_chat_template(tokenizer):
    ids = chat.render([("system", "Be brief."), ("user", "hi")], tokenizer)
    want = tokenizer.encode("<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>",
                            allow_special=True)
    assert ids == want
    stops = set(chat.stop_token_ids(tokenizer))
    assert {tokenizer.special_ids["<|end|>"], tokenizer.eot_id} <= stops


def test_chat_markers_typed_by_a_user_stay_text(tokenizer):
    ids = chat.render([("user", "<|end|>")], tokenizer)
    assert ids.count(tokenizer.special_ids["<|end|>"]) == 1


def test_chat_template_tokenises_like_encode(tokenizer):
    """render's one encode_batch call (which releases the GIL) gives what encode gives."""
    messages = [("system", "Be brief."), ("user", ""), ("assistant", "naïve <|user|> 日本"),
                ("developer", "x" * 3000)]
    special = tokenizer.special_ids
    want = []
    for role, content in messages:
        want += [special[chat.ROLE_MARKERS[role]], *tokenizer.encode(content), special["<|end|>"]]
    assert chat.render(messages, tokenizer) == want + [special["<|assistant|>"]]


def test_settings_env_then_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("NODRAFT_PORT", "9001")
    monkeypatch.setenv("NODRAFT_SPECULATION", '{"method": "early_exit", "exit_layer": 1}')
    monkeypatch.setenv("NODRAFT_CORS_ORIGINS", "http://a, http://b")
    s = Settings.from_argv([])
    assert s.port == 9001 and s.speculation == {"method": "early_exit", "exit_layer": 1}
    assert s.cors_origins == ["http://a", "http://b"] and s.api_key is None
    s = Settings.from_argv(["--port", "9002", "--speculation", "ngram", "--api-key", "k",
                            "--checkpoints", str(tmp_path), "--max-running", "2"])
    assert (s.port, s.speculation, s.max_running) == (9002, "ngram", 2)
    assert s.api_key.get_secret_value() == "k" and s.checkpoints == tmp_path
    for var in ("NODRAFT_PORT", "NODRAFT_SPECULATION", "NODRAFT_CORS_ORIGINS"):
        monkeypatch.delenv(var)
    defaults = Settings()
    assert (defaults.host, defaults.port, defaults.speculation) == ("127.0.0.1", 8000, "auto")
    assert defaults.cors_origins == []
    # the engine's torch threads: as given, else every usable core but one (the event
    # loop's); the engine process gets those cores, the API process the last one
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert Settings().engine_threads == 7 and Settings(threads=3).engine_threads == 3
    assert Settings().cores() == (list(range(7)), [7])
    assert Settings(threads=3).cores() == ([0, 1, 2], [7])
    # the engine asked for every core: the API shares the last one with the engine's pass
    # threads (its loop keeps the first: engine.process.keep_first_core)
    assert Settings(threads=8).cores() == Settings(threads=9).cores() == (list(range(8)), [7])
    assert Settings(engine_process=False).cores() == (None, None)  # one process: no pinning
    # the engine's ZeroMQ I/O thread goes to the API's core; steps wait 5 ms by default
    config = Settings(threads=3).engine_config()
    assert (config.cores, config.io_cores, config.stream_interval) == ([0, 1, 2], [7], 0.005)
    assert Settings(stream_interval_ms=0).engine_config().stream_interval == 0
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    assert Settings().engine_threads == 1 and Settings().cores() == (None, None)
    # the compiled passes' product (micro/gemm.py): auto by default, torch on request
    assert defaults.gemm == "auto" and Settings.from_argv(["--gemm", "torch"]).gemm == "torch"
    with pytest.raises(ValidationError):
        Settings.from_argv(["--gemm", "mkl"])
    # the KV cache: float32 by default, float16 on request, nothing else
    assert defaults.engine_config().kv_cache_dtype == "float32"
    half = Settings.from_argv(["--kv-cache-dtype", "float16"])
    assert half.engine_config().kv_cache_dtype == "float16"
    with pytest.raises(ValidationError):
        Settings.from_argv(["--kv-cache-dtype", "bfloat16"])


def test_serve_help(capsys):
    from nodraft.server.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--speculation", "--api-key", "--max-running",
                 "--max-waiting", "--max-body-bytes", "--cors-origins", "--checkpoints",
                 "--drain-seconds", "--threads", "--stream-interval-ms",
                 "--chat-max-tokens-default", "--header-timeout-seconds",
                 "--body-timeout-seconds", "--keep-alive-seconds", "--max-connections"):
        assert flag in out
    assert "KV slots per model" in " ".join(out.split())  # what --max-running bounds


# -- a request's deltas (``Run.deltas``) ------------------------------------------------------
class FakeClient:
    """Stands in for the engine client: ids for submitted requests, aborts recorded."""

    def __init__(self):
        self.aborted: list[int] = []
        self.next = 0

    def submit(self, request, deliver):
        self.next += 1
        return self.next

    def abort(self, rid):
        self.aborted.append(rid)


def run_deltas(steps: list[tuple[bytes, bytes]], stops: list[str], read_every: int | None):
    """A one-choice ``Run`` fed ``steps`` ((emitted bytes, rejected bytes) each, as
    byte-tokens), then a finish; ``read_every`` steps queued between reads (None: every
    step queued before the first read, as when the reader fell far behind). Returns the
    deltas and the tokens counted as returned."""
    import asyncio

    from nodraft.engine.core import Event, GenerationRequest
    from nodraft.engine.sequence import StepResult
    from nodraft.server.generation import Run

    async def go():
        run = Run(FakeClient(), ByteTokens(), [GenerationRequest("m", [1], 64)], stops)
        run.start()
        events = [Event("step", StepResult(list(t), 0, list(r), list(r), "none"))
                  for t, r in steps] + [Event("finish", finish_reason="length")]
        out, it = [], run.deltas()
        if read_every is None:
            for ev in events:
                run.queue.put_nowait((0, ev))
            out = [d async for d in it]
        else:
            for i in range(0, len(events), read_every):
                for ev in events[i:i + read_every]:
                    run.queue.put_nowait((0, ev))
                while not run.queue.empty() and not run.finished:
                    out.append(await it.__anext__())
            out += [d async for d in it]
        return out, run.completion_tokens

    return asyncio.run(go())


def test_steps_waiting_together_become_one_delta_up_to_a_rejected_draft():
    steps = [(b"ab", b""), (b"c", b""), (b"d", b"xy"), (b"e", b""), (b"f", b"")]
    merged, n = run_deltas(steps, [], None)
    assert [d.text for d in merged] == ["abcd", "ef", ""]  # the finish's delta closes it
    assert [[r["text"] for r in d.rejected] for d in merged[:2]] == [["x", "y"], []]
    assert [t["text"] for t in merged[0].tokens] == list("abcd") and n == 6
    one, n1 = run_deltas(steps, [], 1)  # read as each step arrives: a delta per step
    assert [d.text for d in one] == ["ab", "c", "d", "e", "f", ""] and n1 == n


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=4), st.binary(max_size=2)),
                min_size=1, max_size=12),
       st.lists(st.sampled_from(["ab", "\x00", "zz", "é"]), max_size=2),
       st.sampled_from([None, 1, 2, 3]))
def test_merged_deltas_return_what_one_delta_per_step_returns(steps, stops, read_every):
    """However many steps wait together, the text, the tokens returned and where a stop
    string cuts them are those of one delta per step."""
    merged, n = run_deltas(steps, stops, read_every)
    one, n1 = run_deltas(steps, stops, 1)
    assert "".join(d.text for d in merged) == "".join(d.text for d in one)
    assert n == n1
    assert [t for d in merged for t in d.tokens] == [t for d in one for t in d.tokens]
