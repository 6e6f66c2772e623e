"""What the engine asks of disaggregation, in one place: which requests it refuses, which wait
for their KV (pulls.py), which lend theirs (lending.py), and the side channel's releases."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenline.protocol import KVTransferParams, SamplingParams
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_transfer.config import KVTransferConfig
from tokenline.scheduler.kv_transfer.lending import Lending
from tokenline.scheduler.kv_transfer.link import KVLayout, NixlLink
from tokenline.scheduler.kv_transfer.pulls import PullFailed, Pulls, RankReads
from tokenline.scheduler.kv_transfer.side_channel import RankKV, SideChannelServer
from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.refusals import InvalidRequest, KVLoadFailed
from tokenline.scheduler.sequence import Sequence

log = logging.getLogger(__name__)


class KVTransfers:
    def __init__(
        self,
        pool: BlockPool,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: KVTransferConfig,
        ranks: list[RankKV] | None = None,
        rank_reads: RankReads | None = None,
    ) -> None:
        """``layout``: this rank's; ``ranks``: the other ranks of a tensor-parallel pod, each
        with its agent over its own pool (a prefill pod's readers read them all), and
        ``rank_reads`` what has them read their own heads (a decode pod's)."""
        if not pool.caching:
            raise SystemExit(
                "--kv-transfer-config needs prefix caching: read blocks join the batch as "
                "cached prefixes; drop --no-enable-prefix-caching"
            )
        self.config = config
        self.link = NixlLink(f"tokenline-{config.engine_id}", kv_cache, layout, config.produces)
        self.lending: Lending | None = None
        self.server: SideChannelServer | None = None
        if config.produces:
            host, port = config.side_channel_host, config.side_channel_port
            self.lending = Lending(pool, config, host, port, layout.tp_size)
            self.server = SideChannelServer(
                host,
                port,
                self.link.metadata,
                self.link.layout,
                config.engine_id,
                self.lending.claim,
                config.side_channel_keys,
                ranks,
            )
            self.lending.port = int(self.server.address.rsplit(":", 1)[1])  # 0: the one bound
            log.info("kv transfer: lending prompts' KV, side channel at %s", self.server.address)
        self.pulls = Pulls(pool, config, self.link, rank_reads) if config.consumes else None
        self.bytes_sent = 0  # read from this pod's loans, as the readers said, since start

    def check(self, sampling: SamplingParams) -> None:
        """Refuse what this pod's role cannot do, naming the flag that would."""
        params = sampling.kv_transfer
        if params is None:
            return
        if params.do_remote_decode and self.lending is None:
            raise _refusal("do_remote_decode", "kv_producer")
        if params.do_remote_prefill:
            if self.pulls is None:
                raise _refusal("do_remote_prefill", "kv_consumer")
            if not params.remote_host or not params.remote_port or params.remote_block_ids is None:
                raise InvalidRequest(
                    "kv_transfer_params.do_remote_prefill needs remote_host, remote_port and "
                    "remote_block_ids: pass on the prefill pod's kv_transfer_params as it sent "
                    "them",
                    param="kv_transfer_params",
                )

    def waits(self, seq: Sequence) -> bool:
        """True: ``seq`` waits for its prompt's KV to be read before it joins the batch."""
        params = seq.sampling.kv_transfer
        if self.pulls is None or params is None or not params.do_remote_prefill:
            return False
        return self.pulls.arrive(seq, params)

    def admit(
        self,
        join: Callable[[Sequence, bool], None],
        rejected: list[tuple[str, InvalidRequest]],
    ) -> None:
        """Requests whose KV was read ``join`` the batch (the engine's, ``read`` True); those
        whose read failed are prefilled here (``recompute``) or refused (``fail``)."""
        ready, failed = self.between_steps()
        for seq in ready:
            join(seq, True)
        for seq, failure in failed:
            if self.config.failure_policy == "recompute":
                seq.cached_tokens = None  # counted at admission, as any prompt's
                join(seq, True)
            else:
                rejected.append((seq.uid, KVLoadFailed(f"{failure}; retry the request")))

    def between_steps(self) -> tuple[list[Sequence], list[tuple[Sequence, PullFailed]]]:
        """Releases applied; reads that ended: the sequences to join, those that failed."""
        self._take_releases()
        if self.pulls is None:
            return [], []
        return self.pulls.poll()

    def lend_computed(self, samplers: list[Chunk]) -> None:
        """Sequences whose prompt this step completed and a decode pod will read: lend it."""
        if self.lending is None:
            return
        for chunk in samplers:
            params = chunk.seq.sampling.kv_transfer
            if params is not None and params.do_remote_decode and not chunk.seq.output_ids:
                self.lending.lend(chunk.seq)

    def params(self, uid: str) -> KVTransferParams | None:
        return self.lending.params(uid) if self.lending is not None else None

    def drop(self, uid: str) -> Sequence | None:
        return self.pulls.drop(uid) if self.pulls is not None else None

    def waiting(self) -> list[Sequence]:
        if self.pulls is None:
            return []
        return [self.pulls.pending[uid].seq for uid in self.pulls.uids()]

    def lent(self) -> list[str]:
        """The requests whose prompt KV this pod still holds for a reader."""
        return list(self.lending.loans) if self.lending is not None else []

    def in_flight(self) -> bool:
        return self.pulls is not None and bool(self.pulls.pending)

    def ready(self) -> bool:
        """A read has ended: the next step takes it up."""
        if self.pulls is None:
            return False
        return any(p.future is not None and p.future.done() for p in self.pulls.pending.values())

    def _take_releases(self) -> None:
        if self.lending is not None and self.server is not None:
            for release in self.server.take_releases():
                granted, _ = self.lending.release(release)
                if granted:  # only a reader this pod let read says what it read
                    self.bytes_sent += release.bytes_read

    def expire(self, now: float) -> None:
        """Also while no step runs: loans released or past their lease go back, reads that
        waited for room start, and blocks held for requests admitted since are let go."""
        if self.lending is not None:
            self._take_releases()
            self.lending.expire(now)
        if self.pulls is not None:
            self.pulls.tend()

    def close(self) -> None:
        self.link.close()
        if self.server is not None:
            self.server.close()
        if self.pulls is not None:
            self.pulls.close()


def _refusal(field: str, role: str) -> InvalidRequest:
    return InvalidRequest(
        f"kv_transfer_params.{field}: this scheduler does not take part in prefill/decode "
        f"disaggregation as a {role.removeprefix('kv_')} pod; start it with --kv-transfer-config "
        f'\'{{"kv_connector": "NixlConnector", "kv_role": "{role}"}}\'',
        param="kv_transfer_params",
    )


def transfers_for(pool: BlockPool, runner, config: KVTransferConfig | None) -> KVTransfers | None:
    """The engine's disaggregation over ``runner``'s pool; None without a configuration."""
    if config is None:
        return None
    layout = KVLayout(
        model=runner.source.spec,
        dtype=str(runner.dtype),
        block_size=runner.block_size,
        num_layers=runner.num_layers,
        num_kv_heads=runner.num_kv_heads,
        head_dim=runner.head_dim,
        tp_size=1,
    )
    shares = getattr(runner, "kv_shares", None)
    if shares is None:
        return KVTransfers(pool, runner.kv_cache, layout, config)
    # tensor parallel: every rank's agent over its own share of the heads, which a prefill
    # pod lends and into which a decode pod's ranks read (each its own, the runner's workers)
    name = f"tokenline-{config.engine_id}"
    layout, others = shares(name, layout, config.produces)
    ranks = [RankKV(metadata, share) for metadata, share in others]
    return KVTransfers(pool, runner.kv_cache, layout, config, ranks, runner)


def check_kv_transfer(transfers: KVTransfers | None, sampling: SamplingParams) -> None:
    """Refuse ``kv_transfer_params`` this scheduler cannot honour."""
    if transfers is not None:
        transfers.check(sampling)
    elif sampling.kv_transfer is not None:
        raise InvalidRequest(
            "kv_transfer_params: this scheduler runs without --kv-transfer-config (no "
            "prefill/decode disaggregation); send the request without them",
            param="kv_transfer_params",
        )
