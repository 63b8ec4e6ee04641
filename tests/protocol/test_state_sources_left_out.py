"""protocol/round/state_sources.py's LeftOut: who a view leaves out, until when, and which for lying."""

from protocol.round.state_sources import LeftOut


def test_peers_are_left_out_until_their_time_and_only_liars_count_as_lying():
    out = LeftOut()
    out.leave_out("liar", until=600.0, now=0.0, lied=True)
    out.leave_out("silent", until=60.0, now=0.0, lied=False)
    assert out.hides("liar", 10.0) and out.hides("silent", 10.0)
    assert out.lied("liar", 10.0) and not out.lied("silent", 10.0)
    assert not out.hides("silent", 60.0) and not out.lied("liar", 600.0)
    out.leave_out("liar", until=700.0, now=650.0, lied=False)  # silent now: no longer counted a liar
    assert out.hides("liar", 660.0) and not out.lied("liar", 660.0)
    assert set(out._until) == {"liar"}  # entries past their time are dropped: the table is bounded by the live ones
