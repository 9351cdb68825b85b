"""Requests with a grammar: they wait while it compiles without holding the queue; completion ends them."""

from __future__ import annotations

from dataclasses import dataclass, field

from metalserve.request import RequestStatus
from tests.scheduler.sched_helpers import make_request, make_scheduler, step


@dataclass
class FakeGrammar:
    ready: bool = False
    error: str | None = None
    end_after: int = 1 << 30  # accept returns True (grammar complete) at this many tokens
    seen: list[int] = field(default_factory=list)

    def is_ready(self) -> bool:
        return self.ready

    def accept(self, token_id: int) -> bool:
        self.seen.append(token_id)
        return len(self.seen) >= self.end_after


def test_a_compiling_request_waits_without_holding_the_queue() -> None:
    s = make_scheduler()
    grammar = FakeGrammar()
    a = make_request("a", 8, max_tokens=3, arrival=0)
    a.structured = grammar
    s.add_request(a)
    s.add_request(make_request("b", 8, max_tokens=3, arrival=1))
    s.add_request(make_request("c", 8, max_tokens=3, arrival=2))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["b", "c"]
    assert a.status is RequestStatus.WAITING and s.num_waiting_for_grammar == 1
    assert [r.request_id for r in s.waiting] == ["a"]
    grammar.ready = True
    out, _ = step(s)
    assert "a" in out.num_scheduled_tokens and s.num_waiting_for_grammar == 0
    assert out.scheduled_new_reqs[0].structured is grammar  # the runner's sampler masks with it


def test_skipped_requests_keep_their_order() -> None:
    s = make_scheduler(max_num_seqs=1)
    grammars = [FakeGrammar(), FakeGrammar()]
    for i, g in enumerate(grammars):
        r = make_request(f"g{i}", 8, max_tokens=2, arrival=i)
        r.structured = g
        s.add_request(r)
    s.add_request(make_request("p", 8, max_tokens=2, arrival=5))
    step(s)
    assert [r.request_id for r in s.waiting] == ["g0", "g1"]


def test_a_failed_compile_aborts_the_request() -> None:
    s = make_scheduler()
    r = make_request("a", 8)
    r.structured = FakeGrammar(ready=True, error="invalid regex")
    s.add_request(r)
    step(s)
    _, outputs = step(s)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort")]
    assert not s.has_unfinished_requests()


def test_grammar_completion_stops_and_wins_over_length() -> None:
    s = make_scheduler()
    grammar = FakeGrammar(ready=True, end_after=3)
    r = make_request("a", 8, max_tokens=3)
    r.structured = grammar
    s.add_request(r)
    reasons = []
    while s.has_unfinished_requests():
        _, outputs = step(s, token=9)
        reasons += [o.finish_reason for o in outputs if o.finish_reason]
    assert reasons == ["stop"] and grammar.seen == [9, 9, 9]


def test_every_token_reaches_the_matcher_across_preemption() -> None:
    s = make_scheduler(num_blocks=5, max_model_len=32)
    grammar = FakeGrammar(ready=True)
    a = make_request("a", 16, max_tokens=8, arrival=0)
    b = make_request("b", list(range(2000, 2016)), max_tokens=8, arrival=1)
    b.structured = grammar
    s.add_request(a)
    s.add_request(b)
    while s.has_unfinished_requests():
        step(s, token=lambda rid: 11 if rid == "b" else 7)
    assert b.num_preemptions >= 1
    assert grammar.seen == b.output_token_ids and len(grammar.seen) == 8


@dataclass
class BreakingGrammar(FakeGrammar):
    """A matcher that refuses the output's third token (an engine limit hit mid-way, or EOS too early)."""

    def accept(self, token_id: int) -> bool:
        self.seen.append(token_id)
        if len(self.seen) >= 3:
            self.error = "lexer error: too many expressions constructed"
            return True
        return False


def test_a_grammar_broken_mid_output_finishes_with_error_never_stop() -> None:
    s = make_scheduler()
    r = make_request("a", 8, max_tokens=10)
    r.structured = BreakingGrammar(ready=True)
    s.add_request(r)
    finished = []
    while s.has_unfinished_requests():
        _, outputs = step(s, token=9)
        finished += [(o.finish_reason, o.stop_reason) for o in outputs if o.finish_reason]
    assert finished == [("error", "lexer error: too many expressions constructed")]
    assert r.status is RequestStatus.FINISHED_ERROR and s.kv.pool.usage == 0.0
