"""The verl pin: REQUIRED_VERL.txt, the external/verl gitlink and the installed verl must agree."""

from __future__ import annotations

import pytest

from beyond_agent.verl_pin import (
    TRYING_VARIABLE,
    VerlPin,
    VerlVersionError,
    ensure_pinned_verl,
    read_pin,
    submodule_commit,
)


def test_pin_file_names_a_release_and_its_commit():
    pin = read_pin()
    assert pin.tag == f"v{pin.version}"
    assert len(pin.commit) == 40 and int(pin.commit, 16) >= 0


def test_gitlink_points_at_the_pinned_commit(repo_root):
    # Mode 160000 is a submodule gitlink: verl is referenced, never committed into our tree.
    assert submodule_commit(repo_root) == read_pin().commit


def test_installed_verl_is_the_pinned_release():
    import verl

    pin = read_pin()
    assert verl.__version__ == pin.version
    assert ensure_pinned_verl(pin) == pin.version


def test_a_different_installed_verl_is_refused_with_both_versions_named():
    import verl

    wanted = VerlPin(version="0.0.1", tag="v0.0.1", commit="0" * 40)
    with pytest.raises(VerlVersionError) as caught:
        ensure_pinned_verl(wanted, environ={TRYING_VARIABLE: "0.0.2"})  # trying another release is no excuse
    message = str(caught.value)
    assert "needs verl 0.0.1" in message
    assert f"verl {verl.__version__} is installed" in message
    assert "scripts/install.sh" in message


def test_the_release_being_tried_starts_with_a_warning():
    """scripts/try_verl.sh names the release it installed in its scratch venv: that one may start a training."""
    import verl

    wanted = VerlPin(version="0.0.1", tag="v0.0.1", commit="0" * 40)
    with pytest.warns(UserWarning, match=f"verl {verl.__version__} instead of the pinned 0.0.1: trying a release"):
        assert ensure_pinned_verl(wanted, environ={TRYING_VARIABLE: verl.__version__}) == verl.__version__


def test_pin_file_with_a_missing_field_is_a_clear_error(tmp_path):
    broken = tmp_path / "REQUIRED_VERL.txt"
    broken.write_text("# comment\nversion=0.9.0\n")
    with pytest.raises(ValueError, match="missing tag, commit"):
        read_pin(broken)
