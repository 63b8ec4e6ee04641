"""State sync: serve our state to late joiners, download the swarm's, check what we install.

The state is θ, its round and the strategy's shared state (DiLoCo's outer momentum), served
through hivemind's state sharing (``rpc_download_state``) and downloaded from a peer this peer
chooses (peer/exchange/state_download.py), never from whoever declares the highest priority.

What other peers claim is weighed, not believed:
- the round to catch up to is the second-highest two or more live peers this peer knows have reached
  (seen to come, or with standing in its lineage), or a later one a strict majority of the active peers
  it sees have reached (protocol/round/round_policy.py ``sync_target``): one peer announcing a round
  far ahead cannot make everyone chase it, nor can two new identities that vouch for each other's θ;
- sources are peers at or a little above that round, the rounds most peers report first; where
  known peers set the round, only they serve it and only their reports check its θ; where the
  majority does, only peers at that round serve it;
- a peer that serves a state we refuse (malformed, older than it announced, non-finite, off the
  hash its round's peers report) is left out of the membership view for ``Timing.refuse_source_s``
  (once in that time not, where its θ is only unreported while it and another peer still announce
  the round before: their next records may report it); one that serves nothing, for
  ``Timing.silent_source_s``; but a repair (a lost start vote) asks the groupmates that won it
  whatever their records say, again where one serves an older state or nothing (for a gather slot
  and a set fetch), and hides none for being late;
  a catch-up makes at most ``MAX_ATTEMPTS`` downloads, a round that could not be had is not chased
  again for ``Timing.retry_target_s``;
- a downloaded state must name this run spec and exactly this run's tensors, with their shapes,
  every value finite and at most ``STATE_MAX_ABS`` after the cast to float32, and be of a round
  between the one we need and the one its server announced (+1: it may have just finished one). A
  state further ahead is checked once more against a view read after the download (a fast peer's
  rounds go by while its state travels), and refused only if its server still announces less;
- peers that others cannot dial (``reach`` "client": hivemind's client mode shares no state) last.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from peer.outer.engine import RoundEngine
from peer.checkpoints.files import params_hash, state_digest
from peer.exchange.state_download import StateDownloader, StateServerBusy
from protocol.errors import ProtocolError
from protocol.round.round_policy import swarm_round, sync_target
from protocol.round import eligibility, standing
from protocol.round.state_sources import ROUND_SPREAD, finishing, grouped, order_sources, repair_sources, reported_hashes
from protocol.round.peer_states import DONE, IN_ROUND, NOT_A_SOURCE
from protocol.spec import RunSpec

logger = logging.getLogger("voloco.peer")

MAX_ATTEMPTS = 3  # downloads per catch-up
BUSY_TRIES = 5  # busy answers a catch-up takes (a pause growing by one each) before it gives up on them
BUSY = "busy"  # ``StateSync.download``'s answer where the source serves as many downloads as it will now
STATE_MAX_ABS = 1e6  # no trained weight or momentum comes near it; 1e300 or inf never passes


class StateTooOld(ProtocolError):
    """A state of a round before the one this peer needs."""


class StateUnreported(ProtocolError):
    """A state whose θ is none of those the peers of its round report. The view may be older than
    the state: a peer that applies its round's delayed update (overlap) stores a record with the new
    θ, and a view read before that record shows the old one."""

    def __init__(self, message: str, round_no: int):
        super().__init__(message)
        self.round = round_no


@dataclass(frozen=True)
class Basis:
    """What the last state this peer installed derives from: its round and θ hash, and the set its
    server's group agreed in the round before (its server's record at the download; "" if it named
    none). A peer whose θ came from a download has no groupmates of its own lineage; the peers that
    name that set for that round concluded it as its server did (peer/round/adopt.py ``adopt_round_set``)."""

    round: int
    theta: str
    set_before: str

    def lineage(self, round_no: int, theta: str) -> Optional[Tuple[int, str]]:
        """(round_no - 1, the set) for ``adopt_round_set`` if this peer still holds this state's θ of
        ``round_no`` and its server named a set; None otherwise (a later round, another θ, no set)."""
        if self.round == round_no and self.theta == theta and self.set_before:
            return round_no - 1, self.set_before
        return None


class StateAhead(ProtocolError):
    """A state of a round beyond the one its server announced (+1)."""

    def __init__(self, message: str, round_no: int):
        super().__init__(message)
        self.round = round_no


class StateSync:
    """Serving and downloading the replica state of one peer."""

    def __init__(self, spec: RunSpec, engine: RoundEngine, gatherer, membership, peer_id: str,
                 set_state: Callable[[str], str], on_installed: Callable[[int], None]):
        """``set_state(s)``: shows state ``s`` in the progress record, returns the previous one;
        ``on_installed(nbytes)``: θ changed (load it into the model) and ``nbytes`` were received."""
        self.spec, self.engine, self.gatherer, self.membership = spec, engine, gatherer, membership
        self.peer_id = peer_id
        self.layout = spec.param_shapes()
        self.consistent = True  # False after a round whose group started from other parameters than ours
        self._set_state, self._on_installed = set_state, on_installed
        self._fetch = StateDownloader(membership.dht, gatherer, membership.timing.download_min_rate)
        self._failed_target: Tuple[int, float] = (-1, 0.0)  # a round no peer served, and when to try again
        # servers whose unreported θ was refused without hiding them (``_refuse``), until when: once a window
        self._spared: Dict[str, float] = {}
        self.basis: Optional[Basis] = None  # what the last installed state derives from (Basis)

    # ---- serving --------------------------------------------------------------------------------
    def shareable_state(self) -> Tuple[dict, List[torch.Tensor]]:
        meta, tensors = self.engine.shareable()
        meta["spec"] = self.spec.digest()
        return meta, tensors

    def enable_sharing(self) -> None:
        if getattr(self.gatherer, "client_mode", False):  # hivemind's client mode shares no state (connect-out only peer)
            return
        self.gatherer.allow_state_sharing = True  # rpc_download_state serves (no DHT declaration: peer/exchange/state_serving.py)

    # ---- downloading ----------------------------------------------------------------------------
    def download(self, peer: str, timeout: float) -> Any:
        """``peer``'s state; None (logged) if it could not be had; ``BUSY`` if it serves as many downloads as it
        will now (protocol/round/serve_gate.py; tests/round/test_state_sources.py)."""
        tensors = [*self.engine.theta.values(), *self.engine.strategy.shared_state().values()]
        expected = 4 * sum(t.numel() for t in tensors)
        try:
            return self._fetch(peer, expected, timeout, len(tensors))
        except StateServerBusy as e:
            logger.info(f"{peer} does not serve our download now: {e!r}")
            return BUSY
        except Exception as e:
            logger.info(f"could not download the state of {peer}: {e!r}")
            return None

    def catch_up(self, even_at_same_round: bool = False, only: Optional[Set[str]] = None, solo: bool = False) -> None:
        """Download the current state if live peers are ahead of us (round 0 is the seed's, everywhere).

        ``solo``: this peer's last round was one it trained alone (cut off, its view empty), or it has
        found no group in the first round since it started (its checkpoint may be of such rounds). If the
        swarm it lost is back in view at an earlier round (two or more peers there that gather in
        groups), it takes the swarm's state of that round: its solo rounds raced ahead of the swarm's
        (no waiting) and are one peer's lineage, the swarm's is everyone else's.

        ``even_at_same_round``: this peer ended a round off its group's parameters and must take a
        state of at least its own (new) round, even if no groupmate has published that round yet:
        a groupmate still evaluating it serves an older state, which is refused and asked again.
        ``only``: download from these peers alone (the groupmates that started the round from the
        group's parameters: any other source may hold another lineage), with ``even_at_same_round``
        asked whatever their records say yet (protocol/round/state_sources.py ``repair_sources``)."""
        now = time.monotonic()
        repair = only is not None and even_at_same_round
        views = repair_sources(self.membership.view(), only, self.engine.round, self.membership.lied, self.membership.digest) if repair \
            else [v for v in self.membership.others(excluding=NOT_A_SOURCE) if only is None or v.peer_id in only]
        # a repair to the round's group (its start vote named the sources) takes them as they are; a
        # catch-up, whom we know: new identities vouching for each other must not set the round
        vouchers, by_majority = None, False  # who may serve the state and vouch for its θ (None: any)
        if only is None and not even_at_same_round:
            # (standing holders count from the start: a peer restored from a checkpoint has met nobody yet)
            known = self.membership.known() | set(self.engine.standing)
            active = {v.peer_id for v in views if v.progress.state in IN_ROUND}
            target, vouchers = sync_target({v.peer_id: v.progress.round for v in views}, known, active)
            by_majority = vouchers is None
        else:
            target = swarm_round([v.progress.round for v in views])
        if vouchers is not None:
            views = [v for v in views if v.peer_id in vouchers]
        rejoin = solo and not even_at_same_round and 0 <= target < self.engine.round and grouped(views, target) >= 2
        if even_at_same_round:
            if not views:
                if only is not None:
                    logger.warning(f"cannot take the group's state of round {self.engine.round}: none of the groupmates "
                                   f"that hold it ({', '.join(sorted(only))}) can serve it: stopped, or left out for lying")
                return
            target = max(target, self.engine.round)
        elif target <= self.engine.round and not rejoin:
            return
        if not even_at_same_round and self._failed_target[0] == target and now < self._failed_target[1]:
            return
        # a peer that knows nobody it sees asks no peer past the majority's round: new identities a round
        # ahead, vouching for each other, would come first (higher rounds do)
        sources = views if repair else order_sources(views, target, slack=1 if even_at_same_round else 0,
                                                     spread=0 if by_majority else ROUND_SPREAD)
        if not sources:
            return
        if rejoin:
            logger.info(f"rejoining the swarm: this peer's last round was solo and raced ahead to round "
                        f"{self.engine.round}; taking the state of the swarm's round {target}")
        previous, started = self._set_state("syncing"), self.engine.round
        try:
            if self._download_and_install(sources, target, views, vouchers, repair=repair):
                if rejoin:  # the swarm it lost is training: the peers it skipped as no-shows are waited for again
                    self.membership.forgive(v.peer_id for v in views)
                return
            self._failed_target = (target, time.monotonic() + self.membership.timing.retry_target_s)
            logger.warning(f"could not download the state of round {target}; continuing from our own")
        finally:
            # done with a round it has not trained, once another round is installed: no (a barrier of
            # that round would count it ready: peer_states.keeps_waiting)
            self._set_state("training" if previous in DONE and self.engine.round != started else previous)

    def _download_and_install(self, sources: List[Any], target: int, views: Sequence[Any],
                              vouchers: Optional[AbstractSet[str]], repair: bool = False) -> bool:
        """``repair``: the sources are groupmates our start vote named, finishing the round we just
        concluded. An older state or no answer from one of them is its round still ending (its merge of
        other groups' sets may take ``Timing.set_fetch_s``) or a stream that broke, not a lie: it is
        asked again, a pause growing by a second each time, until a gather slot and a set fetch have
        passed, and is not hidden from the view; hiding the only source would leave this peer off its
        group's θ for rounds (tests/round/test_resync.py::test_a_repair_asks_its_groupmate_again_and_hides_it_from_nobody)."""
        timing = self.membership.timing
        queue, attempt, busy, waits = list(sources), 0, 0, 0
        patience = time.monotonic() + timing.gather_slot_s + timing.set_fetch_s if repair else 0.0

        def later(view) -> bool:
            """A repair's source not ready yet: asked again after a pause, while the repair's patience lasts."""
            nonlocal waits
            if not repair or time.monotonic() >= patience:
                return False
            waits += 1
            queue.append(view)
            time.sleep(min(timing.download_pause_s * waits, max(0.0, patience - time.monotonic())))
            return True

        while queue and attempt < MAX_ATTEMPTS:
            view = queue.pop(0)
            peer, claimed = view.peer_id, view.progress.round
            logger.info(f"downloading the state of round {target} from {peer} (it reports round {claimed})")
            asked = time.monotonic()
            got = self.download(peer, timeout=timing.gather_slot_s)
            if got is BUSY:  # it serves others now: not a silent source; asked again after the other sources
                busy += 1
                if busy < BUSY_TRIES:
                    queue.append(view)
                time.sleep(timing.download_pause_s * min(busy, BUSY_TRIES))
                continue
            if got is None:
                if getattr(view.progress, "reach", "") != "client" and later(view):
                    continue
                attempt += 1
                if not repair:
                    # (a --client-mode peer too: left out, this peer trains on, and the client, which can
                    # dial out, downloads our state instead: waiting on it would leave both stuck)
                    self.membership.ignore(peer, timing.silent_source_s, lied=False)
                continue
            attempt += 1
            reported = reported_hashes(views, excluding=peer, among=vouchers)
            try:
                self.install(*got, min_round=target, max_round=claimed + 1, reported=reported)
            except StateTooOld as e:
                if repair:  # a groupmate still finishing the round: asked again while the repair lasts, never hidden
                    if later(view):
                        attempt -= 1
                        logger.info(f"{peer} is still finishing round {target - 1}: {e}")
                    continue
                if claimed < target:  # a groupmate still finishing the round: ask again
                    logger.info(f"{peer} is still finishing round {claimed}: {e}")
                    queue.append(view)
                    time.sleep(timing.download_pause_s * attempt)
                    continue
                self._refuse(peer, e)
                continue
            except StateAhead as e:
                view = self._install_ahead(got, peer, target, asked, e, vouchers)  # the server's record read after
                if view is None:
                    continue
            except StateUnreported as e:
                if not self._install_rechecked(got, peer, target, claimed, asked, e, vouchers):
                    continue
            except ProtocolError as e:
                self._refuse(peer, e)
                continue
            self.consistent = True
            self.basis = Basis(self.engine.round, self.engine.params_hash(), view.progress.set_of(self.engine.round - 1))
            self.enable_sharing()
            return True
        return False

    def _install_ahead(self, got, peer: str, target: int, asked: float, ahead: StateAhead,
                       vouchers: Optional[AbstractSet[str]]):
        """A state of a round past its server's claim: install it if a view read after the download
        shows the server announcing that round (-1), or up to ``Timing.record_lag_rounds`` before it (a
        record lags a fast run's rounds), with that view's hashes; refuse it otherwise
        (tests/round/test_liveness.py::test_a_state_a_few_rounds_past_its_servers_record_is_installed).
        Returns the server's record in that view once installed, else None."""
        views = self.membership.fresh_view(since=asked, timeout=self.membership.timing.recheck_wait(self.membership.read_interval()))
        server = next((v for v in views if v.peer_id == peer), None)
        lag = self.membership.timing.record_lag_rounds  # its record lags its rounds by a heartbeat
        if server is None or server.progress.round + 1 + lag < ahead.round:
            self._refuse(peer, ahead)
            return None
        try:
            self.install(*got, min_round=target, max_round=server.progress.round + 1 + lag,
                         reported=reported_hashes(views, excluding=peer, among=vouchers))
        except ProtocolError as e:
            self._refuse(peer, e, views, vouchers)
            return None
        return server

    def _install_rechecked(self, got, peer: str, target: int, claimed: int, asked: float, why: StateUnreported,
                           vouchers: Optional[AbstractSet[str]]) -> bool:
        """A state whose θ the view does not report: check it again against a view read after the
        download, and refuse it (``_refuse``) only if it does not fit that one either.
        Refused at once, a newcomer whose first view lags the peers by one record would refuse every
        honest server and leave them all out of its view, training alone meanwhile (tests/round/test_liveness.py,
        ``test_a_state_newer_than_the_view_is_checked_against_a_view_read_after_the_download``)."""
        views = self.membership.fresh_view(since=asked, timeout=self.membership.timing.recheck_wait(self.membership.read_interval()))
        try:
            self.install(*got, min_round=target, max_round=claimed + 1,
                         reported=reported_hashes(views, excluding=peer, among=vouchers))
        except ProtocolError as e:
            self._refuse(peer, e, views, vouchers)
            return False
        logger.info(f"the state {peer} served fits a view read after the download (the first one, {why}, was older)")
        return True

    def _refuse(self, peer: str, why: Exception, views: Sequence[Any] = (),
                vouchers: Optional[AbstractSet[str]] = None) -> None:
        """Leave ``peer`` out of the view for ``Timing.refuse_source_s``. Once in that time a server is
        spared it: where its state's θ is only unreported, its own record and another live peer's
        (of ``vouchers``, where given; not ours) still announce the round before the state's, whose
        next records may report that θ. The state is refused, the server stays in view as a source
        for the repair the next start vote may ask for
        (tests/round/test_state_sources.py::test_a_state_unreported_only_because_its_round_is_still_finishing_does_not_hide_its_server)."""
        now, window = time.monotonic(), self.membership.timing.refuse_source_s
        if isinstance(why, StateUnreported) and self._spared.get(peer, -1.0) < now \
                and finishing(views, peer, why.round - 1, vouchers, self.peer_id):
            self._spared = {p: t for p, t in self._spared.items() if t >= now}
            self._spared[peer] = now + window
            logger.info(f"did not install the state {peer} served: {why}, and it and another peer still announce "
                        f"round {why.round - 1}; asking the next source")
            return
        logger.warning(f"refused the state {peer} served: {why}; not asking it again for {window:.0f} s")
        self.membership.ignore(peer, window)

    def install(self, meta: Any, tensors: Sequence[torch.Tensor], min_round: int = 0, max_round: Optional[int] = None,
                reported: Optional[Mapping[int, Set[str]]] = None) -> None:
        """Check a downloaded state and make it ours; ProtocolError (nothing changed) if it does not fit.

        ``reported``: round -> what other peers report for it, each θ's hash, or ``θ hash:state digest``
        (``reported_hashes``); a state of a round some peers report must have one of their θ hashes,
        and where those peers report a digest with it, its standing table and shared state must have
        that digest too: a server cannot hand a newcomer an honest θ with a standing table that makes
        it established, or with a forged outer momentum (tests/round/test_liveness.py
        ``test_a_served_state_whose_table_or_momentum_no_peer_reports_is_refused``)."""
        if not isinstance(meta, dict) or meta.get("spec") != self.spec.digest():
            raise ProtocolError("state is from another run spec")
        names, shared_names = meta.get("names"), meta.get("shared")
        if names != list(self.layout) or not isinstance(shared_names, list) or len(tensors) != len(names) + len(shared_names):
            raise ProtocolError("state does not list this run's tensors")
        if not all(isinstance(k, str) for k in shared_names) or len(set(shared_names)) != len(shared_names):
            raise ProtocolError("state's shared tensors are not distinct names")
        round_no = meta.get("round")
        if isinstance(round_no, bool) or not isinstance(round_no, int) or round_no < 0:
            raise ProtocolError("state has no valid round")
        if round_no < min_round:  # a peer that has not finished the round yet: try again
            raise StateTooOld(f"state of round {round_no} is older than the swarm's round {min_round}")
        if max_round is not None and round_no > max_round:
            raise StateAhead(f"state of round {round_no} is ahead of the round {max_round - 1} its server reports", round_no)
        try:
            table = standing.checked(meta.get("standing"))  # absent from an older peer's state: empty
            pools = standing.checked_evidence(meta.get("evidence"))  # absent: no fresh sender pools scores
        except standing.StandingError as e:  # says which table
            raise ProtocolError(f"state's standing: {e}") from None
        try:
            who_sends = eligibility.checked(meta.get("eligibility"))  # absent from an older peer's state: empty
        except eligibility.EligibilityError as e:
            raise ProtocolError(f"state's eligibility table: {e}") from None
        theta = {name: _checked(name, t, self.layout[name]) for name, t in zip(names, tensors)}
        shared = {k: _checked(k, t, None) for k, t in zip(shared_names, tensors[len(names):])}
        hashes = (reported or {}).get(round_no)
        if hashes:
            theta_hash = params_hash(theta)
            digests = {h.partition(":")[2] for h in hashes if h.partition(":")[0] == theta_hash}
            if not digests:
                raise StateUnreported(f"θ {theta_hash} of round {round_no} is none of those its peers report", round_no)
            digest, reported_digests = state_digest(shared, table, who_sends, pools), digests - {""}  # "": a record of θ alone
            if reported_digests and digest not in reported_digests:
                raise StateUnreported(f"the standing table and shared state served with θ {theta_hash} of round "
                                      f"{round_no} (digest {digest}) are none that its peers report with it", round_no)
        # a few rounds missed (no group found, a short stall): the local buffers hold this peer's
        # updates, which its next payloads still carry. Further (a restart from an older checkpoint, a
        # long stall) or a solo lineage left behind: they hold updates to a θ the swarm has moved on from
        own_round = self.engine.round
        forget = not own_round <= round_no <= own_round + self.membership.timing.keep_local_rounds
        try:
            self.engine.install(theta, round_no, shared, forget_local=forget, standing=table, eligibility=who_sends,
                                evidence=pools)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        if forget and own_round > 0:  # (a newcomer's buffers were empty)
            logger.info(f"cleared this peer's local {self.engine.strategy.name} buffers: they were of round "
                        f"{own_round}'s lineage, not of round {round_no}'s")
        self._on_installed(sum(t.numel() * t.element_size() for t in tensors))
        logger.info(f"installed the state of round {round_no} (θ {self.engine.params_hash()})")


def _checked(name: str, t: Any, shape: Optional[Sequence[int]]) -> torch.Tensor:
    """``t`` as a float32 copy, if it is a real tensor (of ``shape`` when given) whose values are
    finite and bounded after the cast; ProtocolError otherwise."""
    if not torch.is_tensor(t) or not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ProtocolError(f"state tensor {name} is not a real tensor")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ProtocolError(f"state tensor {name} has shape {tuple(t.shape)}, not {tuple(shape)}")
    t = t.to(torch.float32).clone()
    if not bool(torch.isfinite(t).all()) or (t.numel() and float(t.abs().max()) > STATE_MAX_ABS):
        raise ProtocolError(f"state tensor {name} has non-finite values or values beyond {STATE_MAX_ABS:g} (as float32)")
    return t
