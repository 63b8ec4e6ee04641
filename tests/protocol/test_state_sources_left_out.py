"""protocol/round/state_sources.py's LeftOut: who a view leaves out, until when, and which for lying."""

from protocol.round.state_sources import LeftOut


def test_peers_are_left_out_until_their_time_and_only_liars_count_as_lying():
    out = LeftOut()
    out.leave_out("liar", until=600.0, now=0.0, lied=True)
    out.leave_out("silent", until=60.0, now=0.0, lied=False)
    assert out.hides("liar", 10.0) and out.hides("silent", 10.0)
    assert out.lied("liar", 10.0) and not out.lied("silent", 10.0)
    assert not out.hides("silent", 60.0) and not out.lied("liar", 600.0)
    out.leave_out("liar", until=500.0, now=100.0, lied=False)  # left out again, for silence: still a liar
    assert out.hides("liar", 110.0) and out.lied("liar", 110.0)
    out.leave_out("other", until=700.0, now=650.0, lied=False)
    assert set(out._until) == {"other"} and not out.lied("liar", 650.0)  # past their time: dropped, and the liar mark with them
