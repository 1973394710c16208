"""What crosses the process boundary survives the trip: requests as plain data (their
drafter's parameters rebuilt by the engine's registry), events with their figures."""

from nodraft.drafters.registry import Registry
from nodraft.engine import messages
from nodraft.engine.core import Event, GenerationRequest
from nodraft.engine.sequence import StepResult
from nodraft.engine.stats import SpecStats
from nodraft.engine.verify import SamplingParams


def test_a_request_is_data_and_its_parameters_come_back_the_same():
    registry = Registry()
    for spec in ({"method": "early_exit", "exit_layer": 3, "num_speculative_tokens": 2},
                 {"method": "suffix", "min_token_prob": 0.25}, {"method": "none"}):
        method, params = registry.parse(spec)
        request = GenerationRequest("micro-layerskip", [5, 6, 7], 9,
                                    SamplingParams(0.8, 0.9, 40, 2**63 + 5), method, params,
                                    (11, 12))
        raw = messages.encode(messages.Add(3, messages.Request.of(request)))
        got = messages.decode_input(raw)
        assert isinstance(got, messages.Add) and got.rid == 3
        r = got.request
        assert (r.model, r.prompt, r.max_tokens, r.sampling, r.stop_token_ids) == (
            "micro-layerskip", [5, 6, 7], 9, request.sampling, [11, 12])
        assert registry.parse({"method": r.method, **r.params}) == (method, params)
    assert messages.decode_input(messages.encode(messages.Abort([1, 2]))) == messages.Abort([1, 2])
    assert isinstance(messages.decode_input(messages.encode(messages.Shutdown())),
                      messages.Shutdown)


def test_events_and_their_figures_come_back_equal():
    stats = SpecStats("auto", drafted=9, accepted=4, target_passes=5, draft_cost=0.75,
                      accepted_by_position=[3, 1], drafter_errors=1)
    events = [
        (1, Event("admit")),
        (1, Event("step", step=StepResult([4, 5, 6], 2, [4, 5, 9], [9], "suffix", 0.0, None,
                                          2, 1), at=12345.678)),
        (2, Event("finish", finish_reason="length", stats=stats,
                  stats_by_method={"suffix": SpecStats("suffix", 9, 4, 3),
                                   "none": SpecStats("none", target_passes=2)})),
        (3, Event("error", error="RuntimeError: boom", stats=SpecStats("none"),
                  stats_by_method={})),
    ]
    out = messages.Outputs(events, running=2, waiting=1, compiled="warming")
    assert messages.decode_outputs(messages.encode(out)) == out


class _Outbox:
    def __init__(self):
        self.sent: list[messages.Outputs] = []

    def send(self, raw: bytes) -> None:
        self.sent.append(messages.decode_outputs(raw))


class _Engine:
    """What ``EngineCore._send`` reads of an engine."""
    busy = True
    load = (1, 0)


def _core(interval: float, iteration_s: float = 0.0):
    from nodraft.engine.launch import EngineConfig
    from nodraft.engine.process import EngineCore

    core = EngineCore(_Engine(), EngineConfig("unused", compile=False, stream_interval=interval),
                      None, _Outbox(), 0)
    core.iteration_s = iteration_s
    return core


def _step(token: int) -> Event:
    return Event("step", step=StepResult([token], 0, [], [], "none", 0.0, None, 0, 0),
                 at=float(token))


def test_steps_of_a_running_stream_wait_for_the_stream_interval_and_nothing_else_does():
    core = _core(interval=3600.0)  # every step after the first would wait (an hour)
    sent = core.outbox.sent
    core._send()  # the first outputs: the queue and the compile status
    assert len(sent) == 1 and sent[0].events == []
    core.events.append((1, Event("admit")))
    core._send()
    assert [e.kind for _, e in sent[-1].events] == ["admit"]  # never held
    core.events.append((1, _step(7)))
    core._send()
    assert [e.step.tokens for _, e in sent[-1].events] == [[7]]  # a first token: at once
    core.events.append((1, _step(8)))
    core._send()
    core.events.append((1, _step(9)))
    core._send()
    assert len(sent) == 3  # held: request 1 already has a token out
    core.events.append((2, _step(3)))  # another request's first token takes them along
    core._send()
    assert [(rid, e.step.tokens, e.at) for rid, e in sent[-1].events] == [
        (1, [8], 8.0), (1, [9], 9.0), (2, [3], 3.0)]  # in order, each with its own time
    core.events.append((2, _step(4)))
    core._send()
    assert len(sent) == 4
    core.engine.load = (2, 1)  # a new queue length goes at once
    core._send()
    assert len(sent) == 5 and sent[-1].waiting == 1 and sent[-1].events[0][0] == 2
    core.events.append((1, _step(10)))
    core.events.append((1, Event("finish", finish_reason="length")))  # an end: at once
    core._send()
    assert [e.kind for _, e in sent[-1].events] == ["step", "finish"]
    core.events.append((2, _step(5)))
    core.engine.busy = False  # nothing runs: nothing waits
    core._send()
    assert len(sent) == 7 and sent[-1].events[0][1].step.tokens == [5]


def test_a_step_waits_only_while_the_next_iteration_ends_within_the_interval():
    for interval, iteration_s, held in ((0.0, 0.0, False), (3600.0, 0.0, True),
                                        (3600.0, 7200.0, False)):
        core = _core(interval, iteration_s)
        core.events.append((1, _step(1)))
        core._send()
        core.events.append((1, _step(2)))
        core._send()
        assert len(core.outbox.sent) == (1 if held else 2), (interval, iteration_s)
