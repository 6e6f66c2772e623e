"""The scheduler stage's ring handling: aborts that overtake requests, and every uid's end."""

from __future__ import annotations

import time
from concurrent.futures import Future

import msgspec

from tokenline import protocol
from tokenline.scheduler.stage import SchedulerStage
from tokenline.stage_runtime import StageRuntime


class RecordingRing:
    """The stage handler under its runtime, with a list for an outbox."""

    def __init__(self, engine) -> None:
        self.sent: list = []
        self.handler = SchedulerStage(engine, "tiny")
        self.runtime = StageRuntime(self.handler, self.sent.append)
        self.engine = engine
        self.ledger = self.runtime.ledger

    def handle(self, message) -> None:
        self.runtime.process([(time.monotonic(), message)])

    def step(self) -> None:
        self.runtime.step()

    def terminals(self) -> dict[str, str]:
        return {
            o.uid: o.finish_reason
            for m in self.sent
            if isinstance(m, protocol.TokenBatch)
            for o in m.outputs
            if o.finish_reason
        }


def _request(uid: str) -> protocol.Tokenized:
    return protocol.Tokenized(
        uid=uid,
        prompt_ids=[5, 6, 7],
        sampling=protocol.SamplingParams(max_tokens=4, ignore_eos=True),
        timeout_s=30,
    )


def test_an_empty_prompt_that_skipped_the_tokenizer_ends_alone(make_engine):
    """The tokenizer stage refuses empty prompts; one that reached the scheduler anyway (a
    bug upstream) ends its own uid with internal_error, holds nothing, and its neighbour runs."""
    stage = ring = RecordingRing(make_engine())
    stage.handle(_request("ok"))
    stage.handle(msgspec.structs.replace(_request("empty"), prompt_ids=[]))
    failed = [m for m in ring.sent if isinstance(m, protocol.Failed)]
    assert [(f.uid, f.code) for f in failed] == [("empty", "internal_error")]
    assert not stage.engine.holds("empty")
    while stage.engine.has_work():
        stage.step()
    assert ring.terminals() == {"ok": "length"}
    assert len(stage.ledger) == 0


def test_an_abort_that_overtakes_its_request_refuses_it_on_arrival(make_engine):
    stage = ring = RecordingRing(make_engine())
    stage.handle(protocol.Abort(uid="late-1", reason="client_disconnect"))
    assert isinstance(ring.sent[0], protocol.Abort)  # forwarded: later stages may hold it
    stage.handle(_request("late-1"))
    assert not stage.engine.holds("late-1")
    begin = [m for m in ring.sent if isinstance(m, protocol.Begin)]
    assert [b.uid for b in begin] == ["late-1"]  # the detokenizer sees its start...
    assert ring.terminals() == {"late-1": "abort"}  # ...and exactly one end
    stage.handle(_request("late-1"))  # the tombstone is spent: a retry with the uid runs
    assert stage.engine.holds("late-1")


def test_an_abort_for_a_held_uid_frees_its_kv_at_the_next_step(make_engine):
    stage = ring = RecordingRing(make_engine())
    stage.handle(_request("a"))
    stage.step()
    assert stage.engine.pool.usage > 0
    stage.handle(protocol.Abort(uid="a", reason="deadline"))
    assert stage.engine.pool.usage == 0
    stage.step()
    assert ring.terminals() == {"a": "abort"}
    assert len(stage.ledger) == 0


def test_every_admitted_uid_ends_exactly_once(make_engine):
    stage = ring = RecordingRing(make_engine())
    for i in range(6):
        stage.handle(_request(f"r{i}"))
    stage.handle(protocol.Abort(uid="r2", reason="client_disconnect"))
    while stage.engine.has_work():
        stage.step()
    ends = [
        o.uid
        for m in ring.sent
        if isinstance(m, protocol.TokenBatch)
        for o in m.outputs
        if o.finish_reason
    ]
    assert sorted(ends) == [f"r{i}" for i in range(6)]
    assert ring.terminals()["r2"] == "abort"
    assert len(stage.ledger) == 0


def test_a_pooling_request_on_a_generating_model_is_refused_by_the_scheduler(make_engine):
    """The api refuses embeddings on a generating model from the scheduler's heartbeat; one
    that slipped past (a heartbeat not seen yet) ends with a 400 naming the model, holds
    nothing, and its neighbour runs."""
    stage = ring = RecordingRing(make_engine())
    pooled = msgspec.structs.replace(_request("embed"), pooling=protocol.PoolingParams())
    stage.handle(pooled)
    stage.handle(_request("ok"))
    [failed] = [m for m in ring.sent if isinstance(m, protocol.Failed)]
    assert (failed.uid, failed.http_status, failed.param) == ("embed", 400, "model")
    assert "--runner pooling" in failed.message
    assert not stage.engine.holds("embed")
    while stage.engine.has_work():
        stage.step()
    assert ring.terminals() == {"ok": "length"}
    assert len(stage.ledger) == 0


def _ends(ring: RecordingRing) -> list[tuple[str, str]]:
    """Every terminal the stage sent, in order: (uid, finish reason or failure code)."""
    ends = []
    for m in ring.sent:
        if isinstance(m, protocol.Failed):
            ends.append((m.uid, m.code))
        elif isinstance(m, protocol.TokenBatch):
            ends += [(o.uid, o.finish_reason) for o in m.outputs if o.finish_reason]
    return ends


def test_a_request_failing_while_scheduled_ends_alone_and_once(make_engine, monkeypatch):
    """A sequence whose admission raises (its adapter's files gone bad since it was loaded)
    ends with internal_error, once; the request decoding beside it and the one queued behind
    it run to their ends, each ended once."""
    stage = ring = RecordingRing(make_engine())
    stage.handle(_request("innocent"))
    stage.step()
    policy = stage.engine.policy
    acquire = policy._acquire_slot

    def acquire_or_fail(seq):
        if seq.uid == "bad":
            raise OSError("adapter_model.safetensors: no such file")
        return acquire(seq)

    monkeypatch.setattr(policy, "_acquire_slot", acquire_or_fail)
    stage.handle(_request("bad"))
    stage.handle(_request("later"))
    while stage.engine.has_work():
        stage.step()
    ends = _ends(ring)
    assert sorted(ends) == [("bad", "internal_error"), ("innocent", "length"), ("later", "length")]
    assert len(stage.ledger) == 0 and not stage.engine.held_uids()


def test_a_grammar_compiler_crash_ends_its_request_alone(make_engine, monkeypatch):
    """Not a grammar the compiler refuses (a 400) but the compiler itself failing: that request
    ends with internal_error, nothing else does."""
    from tokenline.scheduler.grammar import GrammarCompiler

    stage = ring = RecordingRing(make_engine(grammars=True))
    stage.handle(_request("innocent"))
    stage.step()
    monkeypatch.setattr(GrammarCompiler, "cached", lambda self, grammar: None)

    def submit(self, grammar):
        future = Future()
        future.set_exception(RuntimeError("the compiler panicked"))
        return future

    monkeypatch.setattr(GrammarCompiler, "submit", submit)
    sampling = msgspec.structs.replace(_request("g").sampling, grammar="any grammar")
    stage.handle(msgspec.structs.replace(_request("g"), sampling=sampling))
    while stage.engine.has_work():
        stage.step()
    assert sorted(_ends(ring)) == [("g", "internal_error"), ("innocent", "length")]
    assert len(stage.ledger) == 0 and not stage.engine.held_uids()


def test_a_shutdown_whose_last_step_raises_still_ends_every_uid(make_engine, monkeypatch):
    """Drain time is up and the stage's last step fails: each request it held still ends."""
    stage = ring = RecordingRing(make_engine())
    stage.handle(_request("a"))
    stage.handle(_request("b"))
    stage.step()

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(stage.engine, "step", broken_step)
    stage.runtime.shutdown()
    assert sorted(_ends(ring)) == [("a", "internal_error"), ("b", "internal_error")]
    assert len(stage.ledger) == 0 and not stage.engine.held_uids()
