"""A round that takes at most K contributions a part: drawn from the sets' lists, and only those fetched.

With ``outer.max_contributions`` = K > 0 the merge of a round's groups (peer/round/merge.py) fetches
the other groups' sets as **lists** (protocol/round/set_manifests.py: each payload's owner, digest and
claimed part, checked by the set's name), not whole. ``take`` then

1. forms the union of every held set's entries, our group's whole set included, as the union of
   payloads is formed (a sender with two payloads counts with neither);
2. where two lists name one payload with different parts (a list's author misstated it), fetches that
   payload and reads its part: at most K such payloads, the senders past them sit the round out;
3. draws K per part from the claimed parts (``RoundEngine.draw``: every member holding that union
   draws the same senders);
4. fetches the chosen payloads it does not hold, all at once, one envelope each from a peer that
   holds its list (the next one for those that failed), checked against the list's entry; one
   whose header claims another part than its entry is refused for the round, on every member alike.

Before all this, the round's gather sent only the payloads of the members the lineage's
eligibility table lets send (``senders``, protocol/round/eligibility.py): the sets and lists hold
about 5/4 K a part.
So a peer downloads at most K payloads a part from the round's other groups (and at most K more
where lists disagree on parts), whatever the swarm's size. A chosen payload that cannot be had in
time is left out here: this member's θ is then short of what its union names, so it announces no
base for the round, and the next round's start vote sends it to the majority's state
(peer/round/loop.py). Guarded by tests/round/test_draw.py and tests/round/test_choice_swarm.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from peer.exchange.results import base58
from protocol.dht.records import Progress
from protocol.round import set_manifests
from protocol.round import group_sets
from protocol.round.group_sets import SetError
from protocol.round.set_manifests import Entry, SetManifest, entries_of
from protocol.wire.payload import claimed_part
from protocol.wire.signed import Binding

logger = logging.getLogger("voloco.peer")

Bindings = List[Tuple[List[str], List[str]]]  # (members, owners) of each group whose set a merge holds

NOT_FETCHED = "its payload was drawn and could not be fetched in time"
PARTS_DISAGREE = "the round's lists disagree on its payload's part, and more such senders than K were read"
TRIES_PER_PAYLOAD = 3  # peers asked for one chosen payload, one after the other


@dataclass
class SetList:
    """A set known by its list: the checked list, its entries by sender (base58), and the peers to ask
    for its envelopes (the one that served the list first)."""

    manifest: SetManifest
    entries: Dict[str, Entry]
    sources: List[str] = field(default_factory=list)
    fetched: Dict[str, bytes] = field(default_factory=dict)  # sender -> its payload, once fetched and checked

    def owner(self, sender: str) -> bytes:
        return next(o for o in self.manifest.entries if base58(o) == sender)


@dataclass
class Drawn:
    """What ``take`` made of a round's sets."""

    payloads: Dict[str, bytes]  # sender -> payload: the chosen ones held, in no particular order
    excluded: Dict[str, str]  # sender -> why its contribution is left out (two payloads, a misstated part, not had)
    invalid: Dict[str, str]  # sender -> why its payload claims no part of this run
    passed: List[str]  # senders passed over by the draw
    senders: List[str]  # every sender in the union (whose signed payload reached us)


def contributions(peer, merged, payloads: Dict[str, bytes], excluded: Dict[str, str], fetch_s: float):
    """The round's contributions after its merge (``merged``: peer/round/merge.py's Merged, or None
    for a group alone): drawn from the lists (``take``) where the sets came as lists, else chosen
    from every payload held (``RoundEngine.choose``). (chosen sender -> payload, invalid, passed over,
    every sender of the union, excluded: the group's, less senders the union holds, and the merge's)."""
    engine = peer.engine
    if merged is not None and merged.lists is not None:
        drawn = take(peer, engine.round, engine.params_hash(), merged.held, merged.lists, fetch_s)
        senders = drawn.senders
        excluded = {**{s: why for s, why in excluded.items() if s not in senders}, **merged.excluded, **drawn.excluded}
        return drawn.payloads, dict(drawn.invalid), drawn.passed, senders, excluded
    if merged is not None:
        payloads = merged.payloads
        excluded = {**{s: why for s, why in excluded.items() if s not in payloads}, **merged.excluded}
    chosen, invalid, passed = engine.choose(payloads, engine.round, engine.params_hash())
    return chosen, invalid, passed, list(payloads), excluded


def senders(engine, start_hash: str, payload: bytes, me: str) -> Dict[str, object]:
    """What the round's gather needs to send only the payloads its draw can take (protocol/round/
    eligibility.py): that the round takes at most K a part, and our payload's part to announce if the
    lineage's table lets ``me`` send this round (none: we send nothing, our update waits); nothing
    where the round takes every contribution (``outer.max_contributions`` = 0)."""
    if getattr(engine.strategy, "max_contributions", 0) <= 0:
        return {}
    part = claimed_part(payload)
    sending = part is not None and me in engine.senders({me: part}, engine.round, start_hash)
    return {"senders": True, "part": part if sending else None}


def awaited(engine, start_hash: str) -> Optional[Callable[[str, Progress], bool]]:
    """Which peers of the round are worth waiting for, from (peer id, its progress record): with
    ``outer.max_contributions`` = K, only those the lineage's eligibility table lets send this round,
    as far as their records tell (a chain stage's ``sends``), since the draw passes over any other's
    payload; a round's barrier and merge then wait for about 5/4 K peers a part, not for every peer
    of the round (docs/scale.md). None where the round takes every contribution: wait for everyone.
    ``start_hash`` gives the seed: the barrier's is the θ before the group repairs the last round's
    union, so its choice is an estimate; the merge's, judged after that repair, is the seed the draw
    uses. Guarded by tests/round/test_awaited.py."""
    test = engine.may_send(engine.round, start_hash)
    if test is None:
        return None
    return lambda peer, progress: test(peer, progress.part, progress.sends)


def fetch_into(held: Dict[str, Dict[str, bytes]], lists: Optional[Dict[str, SetList]], gatherer, spec,
               sources: List[str], digest: str, round_no: int, timeout: float,
               members: Optional[Bindings] = None) -> bool:
    """Fetch the set ``digest`` from ``sources[0]`` into ``held`` whole, or, where ``lists`` is kept,
    as its list (the other ``sources`` asked later for its payloads); whether it came. ``members``:
    where given, its binding's members and its owners are added to it."""
    if lists is None:
        got = fetch_checked_set(gatherer, spec, sources[0], digest, round_no, timeout, members)
        if got is not None:
            held[digest] = got
        return got is not None
    listed = fetch_checked_list(gatherer, spec, sources[0], digest, round_no, timeout)
    if listed is not None:
        listed.sources += [p for p in sources if p not in listed.sources]
        lists[digest] = listed
        if members is not None:
            members.append(([base58(m) for m in listed.manifest.binding.members], [base58(o) for o in listed.manifest.entries]))
    return listed is not None


def _opened(what: str, source: str, round_no: int, check: Callable[[], Any]) -> Optional[Any]:
    """``check()``: what ``source`` served, opened and checked; None where the check refuses it (a
    warning), and where it fails in a way a check should not: a parser's bug is logged with its
    traceback and the bytes refused all the same, so that a hostile peer cannot stop this one through
    it (tests/round/test_checked_fetches.py)."""
    try:
        return check()
    except SetError as e:
        logger.warning(f"round {round_no}: {source} served {what} that is refused: {e}")
    except Exception:
        logger.exception(f"round {round_no}: checking {what} {source} served failed unexpectedly; it is refused")
    return None


def fetch_checked_set(gatherer, spec, source: str, digest: str, round_no: int, timeout: float,
                      members: Optional[Bindings] = None):
    """The set ``digest`` from ``source``, checked, as sender (base58) -> payload; None on any failure
    (``_opened``). ``members``: where given, its binding's members and its owners are added to it.
    The round's empty set (``group_sets.empty_set_name``) is known without a fetch: it holds nothing."""
    if digest == group_sets.empty_set_name(gatherer.run_digest, round_no):
        return {}
    raw = gatherer.fetch_set(source, digest, timeout=timeout)
    if raw is None:
        return None
    checked = _opened("a set", source, round_no, lambda: group_sets.open_set(
        raw, gatherer.run_digest, round_no, digest, spec.swarm.max_group_size, gatherer.max_payload_bytes))
    if checked is None:
        return None
    gatherer.keep_checked_set(source, digest)  # served on to peers that ask us for it
    if members is not None:
        members.append(([base58(m) for m in checked.binding.members], [base58(o) for o in checked.payloads]))
    return {base58(owner): payload for owner, payload in checked.payloads.items()}


def fetch_checked_list(gatherer, spec, source: str, digest: str, round_no: int, timeout: float) -> Optional[SetList]:
    """The list of the set ``digest`` from ``source``, checked; None on any failure (``_opened``). The
    round's empty set's list is known without a fetch (no binding: it names no group)."""
    if digest == group_sets.empty_set_name(gatherer.run_digest, round_no):
        empty = SetManifest(Binding(gatherer.run_digest, round_no, b"", ()), {}, digest)
        return SetList(empty, {}, [source])
    raw = gatherer.fetch_manifest(source, digest, timeout=timeout)
    if raw is None:
        return None
    manifest = _opened("a set list", source, round_no, lambda: set_manifests.open_manifest(
        raw, gatherer.run_digest, round_no, digest, spec.swarm.max_group_size))
    if manifest is None:
        return None
    return SetList(manifest, {base58(o): e for o, e in manifest.entries.items()}, [source])


def take(peer, round_no: int, base: str, held: Mapping[str, Mapping[str, bytes]], lists: Mapping[str, SetList],
         fetch_s: float, standing: Optional[Mapping[str, int]] = None, table: Optional[Mapping[str, int]] = None) -> Drawn:
    """Draw the round's contributions from ``held`` (set name -> sender -> payload, sets held whole)
    and ``lists`` (set name -> SetList), and fetch the chosen payloads not held, all within ``fetch_s``
    (see the module docstring). ``standing``, ``table``: the tables the draw weighs by and sends by
    (``RoundEngine.draw``)."""
    engine, gatherer = peer.engine, peer.gatherer
    limit = gatherer.max_payload_bytes
    sets: Dict[str, Dict[str, Entry]] = {name: entries_of(payloads) for name, payloads in held.items()}
    sets.update({name: dict(lst.entries) for name, lst in lists.items()})
    entries, excluded = set_manifests.manifest_union(sets[n] for n in sorted(sets))
    have: Dict[str, bytes] = {}
    for payloads in held.values():
        have.update({s: p for s, p in payloads.items() if s in entries})
    deadline = time.monotonic() + fetch_s
    # a list's author can misstate parts, and any peer can name a list: at most K conflicts are read
    # (in the order of the senders), the rest sit the round out, alike on every member
    conflicted = sorted(set_manifests.conflicts(sets[n] for n in sorted(sets)) & set(entries))
    k = max(getattr(engine.strategy, "max_contributions", 0), 1)
    for sender in conflicted[k:]:
        excluded[sender] = PARTS_DISAGREE
        del entries[sender]
    got = _fetch_all(peer, round_no, {s: entries[s] for s in conflicted[:k] if s not in have}, lists, deadline)
    for sender in conflicted[:k]:
        payload = have.get(sender) or got.get(sender)
        if payload is None:
            excluded[sender] = NOT_FETCHED
            del entries[sender]
            continue
        have[sender] = payload
        entries[sender] = Entry(entries[sender].digest, claimed_part(payload, limit))
    chosen, invalid, passed = engine.draw({s: e.part for s, e in entries.items()}, round_no, base, standing, table)
    wanted = [s for s in chosen if s not in invalid]
    got = _fetch_all(peer, round_no, {s: entries[s] for s in wanted if s not in have}, lists, deadline)
    payloads: Dict[str, bytes] = {}
    for sender in wanted:
        payload = have.get(sender) or got.get(sender)
        if payload is None:
            excluded[sender] = NOT_FETCHED
        elif set_manifests.part_mismatch(entries[sender], payload):
            excluded[sender] = set_manifests.PART_MISMATCH
        else:
            payloads[sender] = payload
    logger.info(f"round {round_no}: drew {len(chosen)} of {len(entries)} contributions and fetched {len(got)} "
                f"of them from the round's other groups")
    return Drawn(payloads, excluded, invalid, passed, sorted(entries))


def _fetch_all(peer, round_no: int, wanted: Mapping[str, Entry], lists: Mapping[str, SetList],
               deadline: float) -> Dict[str, bytes]:
    """The payloads of ``wanted`` (sender -> its entry) that can be had before ``deadline``: each asked
    of one peer (its owner, then the other members of its set, then peers that served the set's list),
    all at once, then the missing ones of the next peer, at most ``TRIES_PER_PAYLOAD`` times, each try
    with a share of the time left; a peer that failed once is not asked again this round, so a
    stalling one costs one share, not the round."""
    gatherer, timing = peer.gatherer, peer.membership.timing
    out: Dict[str, bytes] = {}
    options: Dict[str, List[Tuple[str, str]]] = {}  # sender -> (set name, source), in order
    for sender, entry in wanted.items():
        for name in sorted(lists):
            lst = lists[name]
            if lst.entries.get(sender, None) is None or lst.entries[sender].digest != entry.digest:
                continue
            if sender in lst.fetched:  # a round drawn again takes what the first draw fetched
                out[sender] = lst.fetched[sender]
                break
            # the owner first, then the set's other members that hold it whole, then peers that served its list
            members = [base58(m) for m in lst.manifest.binding.members]
            ask = [sender] + [m for m in members if m != sender and m in lst.entries] + lst.sources
            options.setdefault(sender, []).extend((name, source) for source in dict.fromkeys(ask))
    failed: set = set()
    for attempt in range(TRIES_PER_PAYLOAD):
        asks = []
        for sender, choices in sorted(options.items()):
            if sender in out:
                continue
            pick = next(((n, src) for n, src in choices if src not in failed), None)
            if pick is not None:
                choices.remove(pick)
                asks.append((sender, *pick))
        left = deadline - time.monotonic()
        if not asks or left <= 0:
            break
        # a share of what is left per try: a source that stalls costs one share, not the whole wait
        share = max(timing.set_fetch_min_s, left / (TRIES_PER_PAYLOAD - attempt))
        raws = gatherer.fetch_members([(src, name, lists[name].owner(sender)) for sender, name, src in asks],
                                      timeout=min(timing.set_fetch_s, share, left))
        for (sender, name, src), raw in zip(asks, raws):
            lst = lists[name]
            try:
                if raw is None:
                    raise SetError("nothing in time")
                lst.fetched[sender] = out[sender] = set_manifests.open_member(lst.manifest, lst.owner(sender), raw,
                                                                             gatherer.max_payload_bytes)
            except SetError as e:
                failed.add(src)
                logger.debug(f"round {round_no}: the payload of {sender} in set {name[:12]} from {src}: {e}")
    return out


def fetch_list_from(gatherer, spec, sources: List[str], digest: str, round_no: int, deadline: float,
                    tries: int) -> Tuple[Optional[SetList], List[str]]:
    """The list of ``digest`` from the first of ``sources`` that serves it before ``deadline`` (at most
    ``tries`` asked), with the peers that failed."""
    failed: List[str] = []
    for source in sources[:tries]:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        got = fetch_checked_list(gatherer, spec, source, digest, round_no, left)
        if got is not None:
            got.sources += [s for s in sources if s not in got.sources]
            return got, failed
        failed.append(source)
    return None, failed
