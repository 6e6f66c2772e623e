"""One engine step: schedule, run the model, sample, decide who finished.

The engine is usable in-process (benchmarks, tests) and is what the scheduler stage drives.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future

from tokenline.protocol import SamplingParams, TokenOutput
from tokenline.reasoning import ReasoningFormat, ReasoningSplit
from tokenline.scheduler import prompt_logprobs
from tokenline.scheduler.engine_limits import DEADLINE_MARGIN_S, EngineLimits
from tokenline.scheduler.grammar import GrammarCompiler, GrammarError
from tokenline.scheduler.intake import check_request
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_transfer.config import KVTransferConfig
from tokenline.scheduler.kv_transfer.transfers import transfers_for
from tokenline.scheduler.lora.options import LoraOptions, lora_slots
from tokenline.scheduler.lora.slots import LoraSlots
from tokenline.scheduler.policy import BatchPolicy, Chunk, StepOutput
from tokenline.scheduler.refusals import InvalidRequest, UnknownModel
from tokenline.scheduler.runner import ModelRunner
from tokenline.scheduler.sampler import plain_sampling, sample_with_logprobs
from tokenline.scheduler.sequence import Sequence, Status
from tokenline.scheduler.speculative.build import proposer_for
from tokenline.scheduler.speculative.config import SpeculativeConfig
from tokenline.scheduler.speculative.verify import Acceptance, emitted
from tokenline.scheduler.step_inputs import long_tensor, to_device
from tokenline.scheduler.step_times import StepTimes, lap
from tokenline.scheduler.waiting import Scheduling

log = logging.getLogger(__name__)


class Engine:
    """``prefix_caching`` (on by default): full KV blocks of computed tokens stay cached and
    are shared by later requests whose prompts start with the same tokens (kv_cache.py).

    ``grammars``: builds the matchers of requests whose output follows a grammar
    (``sampling.grammar``); without one such requests are refused, saying ``grammar_refusal``.
    A request whose grammar is new waits in ``compiling``, outside the decode batch, while a
    worker thread builds it. With ``reasoning`` (the model's `ReasoningFormat`), a chat
    request's grammar holds from the first token of its answer: its thinking is free.

    ``sampling.prompt_logprobs``: the prompt's own logprobs, gathered during its prefill and
    sent on the first output (prompt_logprobs.py). ``max_tokens`` 0 reads the prompt and ends
    with ``length`` and no token: how echo with logprobs scores a text.

    Requests come checked by the tokenizer stage; what `add` still refuses is intake.py's.
    """

    def __init__(
        self,
        runner: ModelRunner,
        limits: EngineLimits,
        eos_ids: list[int],
        prefix_caching: bool = True,
        grammars: GrammarCompiler | None = None,
        lora: LoraOptions | None = None,
        grammar_refusal: str = "this scheduler runs without grammar support",
        reasoning: ReasoningFormat | None = None,
        speculative: SpeculativeConfig | None = None,
        scheduling: Scheduling = Scheduling(),
        kv_transfer: KVTransferConfig | None = None,
    ) -> None:
        self.runner = runner
        self.reasoning = reasoning
        self.limits = limits
        self.eos_ids = eos_ids
        self.grammars = grammars
        self.grammar_refusal = "" if grammars is not None else grammar_refusal
        self.compiling: dict[str, tuple[Sequence, Future]] = {}
        # requests refused after add() returned (a grammar that failed to build); the caller
        # takes them with take_rejected() and reports each as the request's error
        self._rejected: list[tuple[str, InvalidRequest]] = []
        self._failed: list[tuple[str, Exception]] = []  # see take_failed
        self.pool = BlockPool(runner.num_blocks, runner.block_size, caching=prefix_caching)
        # prefill/decode disaggregation (kv_transfer/): prompts' KV lent to or read from others
        self.transfers = transfers_for(self.pool, runner, kv_transfer)
        # LoRA (None: off): adapters by name, in host memory and in the runner's device slots
        self.loras: LoraSlots | None = None
        if lora is not None:
            self.loras = lora_slots(runner, lora)
        self.policy = BatchPolicy(
            self.pool,
            limits.max_num_seqs,
            limits.max_num_batched_tokens,
            eos_ids=eos_ids,
            max_model_len=limits.max_model_len,
            loras=self.loras,
            proposer=proposer_for(speculative, runner),
            scheduling=scheduling,
        )
        self.acceptance = Acceptance()  # speculative decoding's, since the stage last took it
        # (tenant, priority, tokens, queue seconds or None) per output since the stage took
        # them, for its per-tenant metrics; None where tenants and priorities play no part
        self.tenant_log: list[tuple[str, int, int, float | None]] | None = None
        if scheduling.policy == "priority" or scheduling.tenant_weights is not None:
            self.tenant_log = []
        self._finished: list[TokenOutput] = []  # terminal outputs not tied to a forward pass
        # tokens generated per LoRA adapter since the stage last took them (its metric)
        self.lora_tokens: Counter[str] = Counter()
        self.step_uids: list[str] = []  # the sequences of the last step
        self.last_step_times = StepTimes()  # the last step that ran the model

    # ── requests ───────────────────────────────────────────────────────────────────────────────
    def add(
        self,
        uid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        timeout_s: float = float("inf"),
        arrival: float | None = None,
        lora: str = "",
        priority: int = 0,
        tenant: str = "",
    ) -> Sequence:
        max_tokens = check_request(
            uid,
            prompt_ids,
            sampling,
            lora=lora,
            loras=self.loras,
            vocab_size=self.runner.vocab_size,
            pool=self.pool,
            grammar_refusal=self.grammar_refusal,
            transfers=self.transfers,
        )
        seq = Sequence(
            uid=uid,
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            deadline=time.monotonic() + timeout_s,
            arrival=time.monotonic() if arrival is None else arrival,
            lora=lora,
            plain_sampling=plain_sampling(sampling),
            priority=priority,
            tenant=tenant,
        )
        if sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has nothing before it
        if sampling.seed is not None:
            seq.generator = self.runner.make_generator(sampling.seed)
        if sampling.grammar is not None:
            if sampling.reasoning and self.reasoning is not None:
                seq.reasoning = ReasoningSplit(self.reasoning, prompt_ids)
            seq.matcher = self.grammars.cached(sampling.grammar)
            if seq.matcher is None:
                self.compiling[uid] = (seq, self.grammars.submit(sampling.grammar))
                return seq
        self._join(seq)
        return seq

    def _join(self, seq: Sequence, read: bool = False) -> None:
        """Into the batch policy, unless its prompt's KV is to be read from a prefill pod first
        (``read``: it has been); an adapter unloaded while it waited outside ends it."""
        if seq.lora and seq.lora not in self.loras.uris:
            seq.status = Status.FINISHED
            missing = UnknownModel(f"The model `{seq.lora}` does not exist.")
            self._rejected.append((seq.uid, missing))
        elif read or self.transfers is None or not self.transfers.waits(seq):
            self.policy.add(seq)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is built join the scheduler; failed ones are rejected."""
        done = [uid for uid, (_, future) in self.compiling.items() if future.done()]
        for uid in done:
            seq, future = self.compiling.pop(uid)
            try:
                seq.matcher = self.grammars.keep(seq.sampling.grammar, future.result())
            except GrammarError as exc:
                error = InvalidRequest(
                    f"the output format cannot be enforced: {exc}", param="response_format"
                )
                self._rejected.append((uid, error))
                continue
            except Exception as exc:  # the compiler's failure, on this request alone
                log.exception("%s: building its grammar failed", uid)
                self._failed.append((uid, exc))
                continue
            self._join(seq)

    def take_rejected(self) -> list[tuple[str, InvalidRequest]]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def take_failed(self) -> list[tuple[str, Exception]]:
        """Requests that failed on their own outside a forward pass (already out of the
        engine): each ends with an internal error, the others run on."""
        failed, self._failed = self._failed, []
        return failed

    def abort(self, uid: str, finish_reason: str = "abort") -> Sequence | None:
        """End a uid now; its KV blocks go back to the pool at once."""
        seq = self.policy.remove(uid)
        if seq is None and uid in self.compiling:
            seq, future = self.compiling.pop(uid)
            future.cancel()
        if self.transfers is not None:  # a read in flight, or blocks held for admission
            seq = self.transfers.drop(uid) or seq
        if seq is not None:
            self._finished.append(self._terminal(seq, [], finish_reason))
        return seq

    def pause(self, uid: str) -> bool:
        return self.policy.pause(uid)

    def resume(self, uid: str) -> bool:
        return self.policy.resume(uid)

    def has_work(self) -> bool:
        if any(future.done() for _, future in self.compiling.values()):
            return True
        if self.transfers is not None and self.transfers.ready():
            return True
        return self.policy.has_work() or bool(self._finished)

    @property
    def prefix_caching(self) -> bool:
        return self.pool.caching

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far: every request's prompt, once, at
        its first admission (a preempted request's recompute is not counted again)."""
        return self.policy.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens found (and so not computed): the sum of ``cached_tokens``."""
        return self.policy.prefix_cache_hits

    def lora_usage(self) -> tuple[list[str], list[str]]:
        """Adapters of running sequences and of waiting ones (vllm:lora_requests_info)."""
        policy = self.policy
        running = {s.lora for s in policy.running if s.lora}
        waiting = {s.lora for s in policy.waiting if s.lora}
        waiting |= {s.lora for s in self._outside() if s.lora}
        return sorted(running), sorted(waiting)

    def holds(self, uid: str) -> bool:
        return uid in self.policy.by_uid or any(s.uid == uid for s in self._outside())

    def _outside(self) -> list[Sequence]:
        """Sequences held outside the policy: a grammar being built, KV being read."""
        held = [seq for seq, _ in self.compiling.values()]
        return held + (self.transfers.waiting() if self.transfers is not None else [])

    # ── one step ───────────────────────────────────────────────────────────────────────────────
    def step(self) -> list[TokenOutput]:
        """One forward pass. If it raises, nothing is lost but the step itself: terminal
        outputs made before it wait for the next step, and `step_uids` names the sequences
        that were in it (their state is suspect; the caller ends them)."""
        started = time.perf_counter()
        self.step_uids = []  # a failure before the forward is no sequence's but its own
        if self.compiling:
            self._admit_compiled()
        if self.transfers is not None:  # reads ended: join, recompute or fail
            self.transfers.admit(self._join, self._rejected)
        chunks = self.policy.schedule()
        if self.policy.failed:
            self._failed += self.policy.failed
            self.policy.failed = []
        self.step_uids = [c.seq.uid for c in chunks]
        computed: list[TokenOutput] = []
        if chunks:
            times = StepTimes(sequences=len(chunks))
            times.schedule = time.perf_counter() - started
            self._run(chunks, computed, times)
            self.last_step_times = times
        outputs, self._finished = self._finished, []
        if not self.policy.running:
            self.runner.release_decode_contexts()
            prune = getattr(self.policy.proposer, "prune", None)
            if prune is not None:
                prune()
        return outputs + computed

    def drop(self, uid: str) -> bool:
        """Forget a uid without a terminal output (its end is reported by the caller)."""
        compiling = self.compiling.pop(uid, None)
        if compiling is not None:
            compiling[1].cancel()
        reading = self.transfers.drop(uid) if self.transfers is not None else None
        return self.policy.remove(uid) is not None or compiling is not None or reading is not None

    def held_uids(self) -> list[str]:
        return list(self.policy.by_uid) + [seq.uid for seq in self._outside()]

    def lent_uids(self) -> list[str]:
        """Ended requests whose prompt KV a decode pod may still read (not the ledger's)."""
        return self.transfers.lent() if self.transfers is not None else []

    def counts(self) -> dict[str, int]:
        """Sequences waiting, running and paused right now."""
        policy = self.policy
        return {
            "waiting": len(policy.waiting) + len(self._outside()),
            "running": len(policy.running),
            "paused": len(policy.paused),
        }

    def _run(self, chunks: list[Chunk], outputs: list[TokenOutput], times: StepTimes) -> None:
        """Run the model over the chunks and sample; the policy applies what came out
        (`update_from_output`), and its account of each sequence becomes the outputs."""
        mark = time.perf_counter()
        inputs = self.runner.step_inputs(chunks)
        times.inputs, mark = lap(mark)
        spans = prompt_logprobs.spans(chunks)
        scored = []
        if spans:
            kept = [(span.chunk, span.offset, span.count) for span in spans]
            logits, hidden = self.runner.execute(inputs, kept)
            scored = prompt_logprobs.score(self.runner, hidden, spans)
        else:
            logits = self.runner.execute(inputs)[0]
        times.forward, mark = lap(mark)
        samplers = [c for c in chunks if c.samples]
        # max_tokens 0: the prompt is only read (for its logprobs); nothing is sampled
        read_only = [c.seq for c in samplers if c.seq.sampling.max_tokens == 0]
        if read_only:  # never speculating: a row each
            rest = [i for i, c in enumerate(samplers) if c.seq.sampling.max_tokens != 0]
            keep = to_device(long_tensor(rest), logits.device)
            logits, samplers = logits.index_select(0, keep), [samplers[i] for i in rest]
        rows = [c.seq for c in samplers for _ in range(1 + len(c.proposals))]  # a proposal's too
        tokens: list[int] = []
        logprobs: list = []
        if rows:
            allowed = None
            if self.grammars is not None:
                start_id = self.reasoning.start_id if self.reasoning is not None else None
                allowed = self.grammars.step_masks(rows, logits, start_id)
            tokens, logprobs = sample_with_logprobs(logits, rows, self.eos_ids, allowed)
        times.sample, mark = lap(mark)
        sampled, logprob_of = emitted(samplers, tokens, logprobs, self.acceptance)
        step = StepOutput(
            chunks=chunks, sampled=sampled, read_only=read_only, prompt_logprobs=scored
        )
        if self.transfers is not None:  # before the policy frees the blocks of those that end
            self.transfers.lend_computed(samplers)
        now = time.monotonic()
        for update in self.policy.update_from_output(step):
            seq = update.seq
            token_ids = update.tokens
            if seq.lora and token_ids:
                self.lora_tokens[seq.lora] += len(token_ids)
            if update.finish_reason is not None:
                out = self._terminal(seq, token_ids, update.finish_reason)
                if update.finish_reason == "error":
                    out.error_code = "grammar_error"
                if self.transfers is not None:
                    out.kv_transfer = self.transfers.params(seq.uid)
            else:
                out = TokenOutput(uid=seq.uid, token_ids=token_ids)
            if logprob_of and token_ids:
                entries = logprob_of.get(id(seq))
                if entries is not None:
                    out.logprobs = entries[: len(token_ids)]
            if update.first:  # what a uid's first output carries
                out.queue_s = (seq.first_scheduled or now) - seq.arrival
                out.cached_tokens = seq.cached_tokens or 0
                if update.prompt_logprobs is not None:
                    out.prompt_logprobs = update.prompt_logprobs
            if self.tenant_log is not None:
                queued = out.queue_s if update.first else None
                self.tenant_log.append((seq.tenant, seq.priority, len(token_ids), queued))
            outputs.append(out)
        times.outputs = time.perf_counter() - mark

    @staticmethod
    def _terminal(seq: Sequence, token_ids: list[int], reason: str) -> TokenOutput:
        return TokenOutput(
            uid=seq.uid,
            token_ids=token_ids,
            finish_reason=reason,
            scheduler_s=time.monotonic() - seq.arrival,
        )

    def expire(self, now: float | None = None) -> list[str]:
        """Abort sequences past their deadline plus a margin.

        The api enforces deadlines and tells the client why; this is the backstop for a uid
        whose abort never arrived, so it waits a little longer than the api does.
        """
        now = time.monotonic() if now is None else now
        held = list(self.policy.by_uid.items()) + [(s.uid, s) for s in self._outside()]
        late = [uid for uid, seq in held if now > seq.deadline + DEADLINE_MARGIN_S]
        for uid in late:
            self.abort(uid)
        if self.transfers is not None:
            self.transfers.expire(now)
        return late
