"""InstanceToken: a reload's new instance replaces the old one of the same name in one server."""
from tritium.serving.retirement import InstanceToken


def test_newer_instance_of_a_name_replaces_the_older(tmp_path):
    old = InstanceToken(123, "llm_0_0", str(tmp_path))
    other = InstanceToken(123, "llm_0_1", str(tmp_path))  # a second instance of one load
    old.claim()
    other.claim()
    assert not old.replaced() and not other.replaced()
    new = InstanceToken(123, "llm_0_0", str(tmp_path))
    assert not old.replaced() and not new.replaced()  # the new one is still starting
    new.claim()
    assert old.replaced() and not new.replaced() and not other.replaced()
    old.release()  # the old one's finalize leaves the new one's file alone
    assert not new.replaced() and (tmp_path / "tritium-instance-123-llm_0_0").read_text() == new.token
    new.release()
    assert not (tmp_path / "tritium-instance-123-llm_0_0").exists()
    assert not new.replaced()  # a missing file (a cleaned /tmp) is not a replacement


def test_servers_do_not_share_tokens(tmp_path):
    first = InstanceToken(1, "llm_0_0", str(tmp_path))
    first.claim()
    InstanceToken(2, "llm_0_0", str(tmp_path)).claim()
    assert not first.replaced()
