"""JAXRING_TRANSPORT and the host identity that decide, per pair of
processes, between a shared-memory ring and TCP (jaxring/_src/distributed.py;
the rings themselves are tested across processes in test_multiprocess.py)."""

import pytest

from jaxring._src import distributed


@pytest.mark.parametrize(
    "value, want",
    [(None, "auto"), ("", "auto"), ("auto", "auto"), ("tcp", "tcp"), (" TCP ", "tcp")],
)
def test_transport_choice_reads_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("JAXRING_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("JAXRING_TRANSPORT", value)
    assert distributed.transport_choice() == want


@pytest.mark.parametrize("value", ["shm", "nccl", "tcp,auto"])
def test_an_unknown_transport_is_refused_with_the_choices(monkeypatch, value):
    monkeypatch.setenv("JAXRING_TRANSPORT", value)
    with pytest.raises(ValueError, match="is not one of auto, tcp"):
        distributed.transport_choice()


def test_host_identity_is_stable_and_host_id_sets_processes_apart(monkeypatch):
    monkeypatch.delenv("JAXRING_HOST_ID", raising=False)
    plain = distributed.host_identity()
    assert plain == distributed.host_identity()
    monkeypatch.setenv("JAXRING_HOST_ID", "node-a")
    a = distributed.host_identity()
    monkeypatch.setenv("JAXRING_HOST_ID", "node-b")
    assert len({plain, a, distributed.host_identity()}) == 3
